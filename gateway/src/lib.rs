//! sbx-gateway

pub mod cli;

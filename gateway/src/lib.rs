//! sbx-gateway: the tonic service ([`service`]), the `sbxd` daemon ([`daemon`]) and the `sbx`
//! CLI ([`cli`]).

pub mod auth;
pub mod cli;
pub mod daemon;
pub mod service;
pub mod tls;

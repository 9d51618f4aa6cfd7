//! sbx-gateway

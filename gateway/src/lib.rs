//! sbx-gateway: the tonic service ([`service`]) and the `sbxd` daemon ([`daemon`]). The `sbx`
//! CLI is its own crate (`sbx-cli`), which shares only the public API and [`tls`] with it.

pub mod auth;
pub mod daemon;
pub mod service;

pub use sbx_tls as tls;

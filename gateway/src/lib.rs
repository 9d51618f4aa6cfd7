//! sbx-gateway: the `sbxd` daemon ([`daemon`]) and its doors over one front door
//! ([`frontdoor`]): the tonic service ([`grpc`]), the E2B API ([`e2b`]) and the routed service
//! endpoints ([`routes`]), the HTTP ones on one listener loop ([`http`]). The `sbx`
//! CLI is its own crate (`sbx-cli`), which shares only the public API and [`tls`] with it.

pub mod auth;
pub mod daemon;
pub mod e2b;
pub mod frontdoor;
pub mod grpc;
pub mod http;
pub mod routes;

pub use sbx_tls as tls;

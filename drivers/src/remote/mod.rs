//! `remote`: any [`ComputeDriver`](crate::ComputeDriver) served over `sbx.driver.v1` on a Unix
//! socket or over TCP, and the client that uses one.
//!
//! - [`serve`] runs the gRPC server over a driver on a Unix socket (the driver host side);
//! - [`serve_node`] runs it over TCP (TLS, mutual for `sbxd node`), with the node service
//!   (`sbx.driver.v1.Node`: what the node is) beside it;
//! - [`RemoteDriver`] is a `ComputeDriver` whose calls go to such a server, on a socket
//!   ([`RemoteDriver::connect_lazy`]) or over TCP ([`RemoteDriver::connect_tcp_lazy`]);
//! - [`run_driver_host`] opens an in-tree driver and serves it until a signal
//!   (`sbx-driver-host`, and `sbxd driver`); `sbxd node` opens one with
//!   [`open_backend_with`] (an oci node with an image store of its own);
//! - [`images`]: a node's own image store, filled from the image mirror a create names;
//! - [`status`] is the one place where a [`DriverError`](crate::DriverError) becomes a
//!   `tonic::Status` and back.
//!
//! **Invariant:** an error crosses the socket unchanged: `status_to_driver_error` inverts
//! `driver_error_to_status` for every variant, fields included. A status that did not come
//! from a driver (refused connection, reset, the client's deadline) is `Unavailable` or
//! `DeadlineExceeded`, never mistaken for a driver's answer.
//!
//! Known limits: no authentication beyond the socket file's mode (0600, so the host's user
//! only) on a socket, nor beyond mutual TLS (which `sbxd node` requires off loopback) over
//! TCP; streams have no deadline once opened; a host killed mid-stream ends the stream with
//! `Unavailable`, and the caller reopens it. A call sent in the instant between a host's death
//! and the client noticing the closed connection answers `Unavailable` even if a new host
//! already listens; the next call reconnects (callers retry `Unavailable` anyway).

mod client;
pub mod fence;
mod host;
pub mod images;
mod node;
mod server;
pub mod status;

pub use client::{RemoteDriver, RemoteTarget};
pub use host::{
    BackendArgs, DriverHostArgs, open_backend, open_backend_with, run_driver_host,
    termination_signal,
};
pub use node::{NodeIdentity, serve_node};
pub use server::{SHUTDOWN_GRACE, serve};

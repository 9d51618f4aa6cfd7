//! `remote`: any [`ComputeDriver`](crate::ComputeDriver) served over `sbx.driver.v1` on a Unix
//! socket, and the client that uses one.
//!
//! - [`serve`] runs the gRPC server over a driver (the driver host side);
//! - [`RemoteDriver`] is a `ComputeDriver` whose calls go to such a server;
//! - [`run_driver_host`] opens an in-tree driver and serves it until a signal
//!   (`sbx-driver-host`, and later `sbxd driver`);
//! - [`status`] is the one place where a [`DriverError`](crate::DriverError) becomes a
//!   `tonic::Status` and back.
//!
//! **Invariant:** an error crosses the socket unchanged: `status_to_driver_error` inverts
//! `driver_error_to_status` for every variant, fields included. A status that did not come
//! from a driver (refused connection, reset, the client's deadline) is `Unavailable` or
//! `DeadlineExceeded`, never mistaken for a driver's answer.
//!
//! Known limits: no authentication beyond the socket file's mode (0600, so the host's user
//! only); streams have no deadline once opened; a host killed mid-stream ends the stream with
//! `Unavailable`, and the caller reopens it. A call sent in the instant between a host's death
//! and the client noticing the closed connection answers `Unavailable` even if a new host
//! already listens; the next call reconnects (callers retry `Unavailable` anyway).

mod client;
mod host;
mod server;
pub mod status;

pub use client::RemoteDriver;
pub use host::{
    DriverHostArgs, OciArgs, VmArgs, open_backend, run_driver_host, termination_signal,
};
pub use server::{SHUTDOWN_GRACE, serve};

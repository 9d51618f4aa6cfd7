//! `sbx-agent`: a small program of ours inside every `oci` and `process` sandbox, started by
//! the sandbox's init next to the main process, serving exec — with stdin, a terminal,
//! resizes and signals — over a Unix socket whose listening end the driver made and handed
//! to the sandbox (so the socket's path is in the driver's state, out of the workload's
//! reach, and the workload cannot put another socket or a symlink in its place).
//!
//! Why an agent rather than a helper per call (`runc exec`, `nsenter`): a helper re-enters
//! the sandbox from outside for every exec — tens of milliseconds of runtime start-up, and
//! one more way for an exec'd process to end up less confined than the workload. The agent
//! is already inside; an exec is one connection and one fork, and its command inherits the
//! workload's confinement whole.
//!
//! The main process and each exec run in Landlock domains of their own ([`confine`]), so no
//! process of the sandbox reaches into another's descriptors or memory but its own.
//!
//! The library holds the wire format ([`wire`]), shared with the driver's client, the
//! server ([`server`]), and its form for a `vm` guest, where exec comes over a virtio-serial
//! port instead of a socket ([`port`]) and copy and port-forward are commands run through
//! that exec ([`tools`]). A stopped sandbox's files are copied by the agent on the host,
//! confined to them ([`offline`]). The binary is built static by the drivers crate's
//! build script, so it runs in any image, with or without a libc.

pub use sbx_archive as archive;
pub mod confine;
pub mod feed;
pub mod log;
pub mod offline;
pub mod port;
pub mod server;
pub mod signals;
pub mod tools;
pub mod user;
pub mod wire;

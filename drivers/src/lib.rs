//! The compute drivers of sbx, in one place for the gateway and the driver host: the driver
//! boundary ([`sbx_driver_api`], re-exported whole), each driver's crate under its name
//! ([`oci`], [`process`], [`vm`], [`sim`]), the gateway services drivers use ([`image`],
//! [`network`]), [`registry`]: the table every driver is opened from, and [`remote`]: a driver
//! behind a Unix socket, and the host that serves one.
//!
//! **Invariant:** a driver resolves a sandbox by its id only. Nothing in these crates looks a
//! sandbox up by name; workspace and name are stored to be reported back, never to be matched.

pub use sbx_driver_api::*;
pub use sbx_driver_oci as oci;
pub use sbx_driver_process as process;
pub use sbx_driver_sim as sim;
pub use sbx_driver_vm as vm;
pub use sbx_host_kit as host_kit;
pub use sbx_host_kit::{ptys, uidpool};
pub use sbx_images as image;
pub use sbx_images::{BUSYBOX_PATHS, find_static_busybox};
pub use sbx_network as network;
pub use sbx_proto::quantity::human_bytes;

pub mod registry;
pub mod remote;

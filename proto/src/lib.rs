//! The sbx gRPC contracts and the pure rules shared by every layer.
//!
//! - [`v1`]: the public API (`sbx.v1`), served by the gateway.
//! - [`driver`]: the compute driver API (`sbx.driver.v1`).
//! - [`names`]: the naming rules for workspaces and sandboxes.
//! - [`image_ref`]: image references, the naming rule of images.
//! - [`quote`]: how an error quotes a bad value (short).
//! - [`quantity`]: sizes and CPU as people write them, and sizes for people to read.
//! - [`time`]: times as the APIs write them (RFC 3339, nine fractional digits).
//! - [`local`]: where a gateway on this machine keeps its state and its socket by default.

/// The public API, package `sbx.v1`.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("sbx.v1");
}

impl v1::ExecRequest {
    /// The input stream of an exec that sends nothing but its request (no stdin): what a
    /// client passes to `Exec` for a command that needs only its arguments.
    pub fn alone(self) -> tonic::codegen::tokio_stream::Once<v1::ExecInput> {
        tonic::codegen::tokio_stream::once(v1::ExecInput {
            input: Some(v1::exec_input::Input::Start(self)),
        })
    }
}

/// The compute driver API, package `sbx.driver.v1`.
#[allow(clippy::all, missing_docs)]
pub mod driver {
    tonic::include_proto!("sbx.driver.v1");
}

pub mod image_ref;
pub mod local;
pub mod names;
pub mod quantity;
pub mod quote;
pub mod time;

/// The encoded file descriptor set of both contracts, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("sbx_descriptor");

pub use prost_types::Timestamp;

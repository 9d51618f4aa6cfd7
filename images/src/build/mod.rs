//! The pure parts of a Dockerfile build, below the gateway that runs one (the `sbx-build`
//! crate): the Dockerfile as the steps a build takes ([`dockerfile`]), and the layer a COPY or
//! ADD makes from the build context ([`context`]). Text in, steps out; a context tar in, a
//! layer tar out: no sandbox, no record, no network.

pub mod context;
pub mod dockerfile;

use crate::ImageError;

/// Why a Dockerfile, or a COPY from the build context, was refused.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The Dockerfile, its arguments or the build context are at fault; the message says
    /// what to change.
    #[error("{0}")]
    Invalid(String),
    /// Writing the layer failed (the spool's disk): not the caller's doing.
    #[error("{0}")]
    Internal(String),
    /// The parent image's content could not be read.
    #[error(transparent)]
    Image(#[from] ImageError),
}

/// A result of the build's pure parts.
pub type Result<T, E = BuildError> = std::result::Result<T, E>;

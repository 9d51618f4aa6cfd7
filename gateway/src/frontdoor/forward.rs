//! Forwarding at the front door: gateways sharing a PostgreSQL store serve each workspace on
//! one of them (its lease holder), and a call that changes a sandbox of a workspace held
//! elsewhere is answered by the local actor API with `HeldElsewhere{address}`. The gRPC
//! listener forwards such a request by replaying its bytes (`daemon::forward`, a tower layer:
//! the request is already `sbx.v1`); a door of another protocol (E2B) cannot replay its
//! bytes to a gRPC server, so the front door makes the same operation on the holder over
//! `sbx.v1` gRPC ([`Holder`]) and answers the holder's answer as a domain result.
//!
//! The holder checks the caller again: the call carries the caller's bearer token (an E2B key
//! is an sbx token), and [`FORWARDED_HEADER`] so that it is never forwarded twice. Without a
//! bearer (a caller known by something the holder cannot check again) the call is not
//! forwarded and the `HeldElsewhere` failure is answered as it is (class
//! [`Class::Elsewhere`](super::Class::Elsewhere): unavailable, naming the holder).

use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use tonic::Code;
use tonic_types::StatusExt;

use super::{Class, Failure};
use crate::daemon::forward::{FORWARDED_HEADER, Peers};

/// What puts the caller's credential and the forwarder's id on each forwarded call.
#[derive(Clone)]
pub struct Credential {
    bearer: Option<AsciiMetadataValue>,
    me: Option<AsciiMetadataValue>,
}

impl tonic::service::Interceptor for Credential {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(bearer) = &self.bearer {
            req.metadata_mut().insert("authorization", bearer.clone());
        }
        if let Some(me) = &self.me {
            req.metadata_mut().insert(FORWARDED_HEADER, me.clone());
        }
        Ok(req)
    }
}

/// A client of the gateway holding a workspace, acting as the caller.
pub type Holder = SandboxServiceClient<InterceptedService<Channel, Credential>>;

/// The holder at `address`, reached as the caller whose bearer token is `bearer`; `None`
/// when the call may not be forwarded (no peers configured, or no credential the holder can
/// check again), and `failure` is then the answer.
pub fn holder(
    peers: Option<&Peers>,
    address: &str,
    bearer: Option<&str>,
    failure: &Failure,
) -> Result<Holder, Failure> {
    let Some(peers) = peers else {
        return Err(failure.clone());
    };
    let bearer = match bearer {
        Some(token) => Some(
            format!("Bearer {token}")
                .parse::<AsciiMetadataValue>()
                .map_err(|_| Failure::invalid("the API key is not text"))?,
        ),
        None if peers.anyone() => None,
        None => return Err(failure.clone()),
    };
    let channel = peers.channel(address).map_err(|why| {
        Failure::new(
            super::Class::Unavailable,
            "HOLDER_UNREACHABLE",
            format!("the gateway holding the workspace cannot be reached: {why}"),
        )
    })?;
    let credential = Credential {
        bearer,
        me: peers.me().to_str().ok().and_then(|me| me.parse().ok()),
    };
    Ok(SandboxServiceClient::with_interceptor(channel, credential)
        .max_decoding_message_size(sbx_actors::limits::MAX_MESSAGE_BYTES))
}

/// The holder's error answer as a front-door failure (its ErrorInfo kept).
pub fn from_holder(status: tonic::Status) -> Failure {
    failure_of(&status)
}

/// The class of a gRPC code, as a client reads an answer (the holder's, or a status a check
/// made): the code is the class, `UNAVAILABLE` the class `Unavailable` (a holder never
/// answers `Elsewhere`: a forwarded call is not forwarded again), `UNKNOWN` and `DATA_LOSS`
/// `Internal`.
pub fn class_of(code: Code) -> Class {
    match code {
        Code::Cancelled => Class::Cancelled,
        Code::InvalidArgument => Class::InvalidArgument,
        Code::DeadlineExceeded => Class::DeadlineExceeded,
        Code::NotFound => Class::NotFound,
        Code::AlreadyExists => Class::AlreadyExists,
        Code::PermissionDenied => Class::PermissionDenied,
        Code::Unauthenticated => Class::Unauthenticated,
        Code::ResourceExhausted => Class::ResourceExhausted,
        Code::FailedPrecondition => Class::FailedPrecondition,
        Code::Aborted => Class::Aborted,
        Code::OutOfRange => Class::OutOfRange,
        Code::Unimplemented => Class::Unimplemented,
        Code::Unavailable => Class::Unavailable,
        Code::Ok | Code::Unknown | Code::Internal | Code::DataLoss => Class::Internal,
    }
}

/// A status a check made (`Caller::require`) as a front-door failure, kept as it was: its
/// ErrorInfo's reason and metadata when it has one, else bare.
pub fn failure_of(status: &tonic::Status) -> Failure {
    match status.get_details_error_info() {
        Some(info) => Failure {
            metadata: info.metadata.clone(),
            ..Failure::new(class_of(status.code()), &info.reason, status.message())
        },
        None => Failure::bare(class_of(status.code()), status.message()),
    }
}

/// A status a check made (`Caller::require`, `Caller::revoked`) as a front-door failure:
/// [`failure_of`].
impl From<tonic::Status> for super::Failure {
    fn from(status: tonic::Status) -> super::Failure {
        failure_of(&status)
    }
}

//! The driver contract's words in the public API's, for what the actors pass on from a driver
//! (a layer of its own, below both the sandbox actor and the API that use it).

use sbx_driver_api::pb;
use sbx_proto::v1::NetworkDenial;

/// The driver's word for a denial, in the public API's.
pub(crate) fn public_denial(d: pb::NetworkDenial) -> NetworkDenial {
    NetworkDenial {
        destination: d.destination,
        protocol: d.protocol,
        port: d.port,
        packets: d.packets,
    }
}

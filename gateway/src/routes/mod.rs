//! The HTTP listener of service endpoints (`sbxd serve --service-listen ADDR`), a door over the
//! front door as the gRPC and E2B APIs are: [`endpoint`] is its adapter (a request's Host to
//! an endpoint, then the request over a forwarded connection), this module its serving.
//!
//! A request whose Host is `NAME--SANDBOX--WORKSPACE.<domain>` goes to the port endpoint
//! `NAME` of that sandbox exposes (`sbx service expose`). The target is looked up in the store
//! on every request (`FrontDoor::route_service`), and the request is forwarded by the
//! endpoint's stored sandbox **id**: a sandbox deleted and made again under the same name has
//! no endpoint until one is exposed for it, and a request never reaches a sandbox it was not
//! meant for. Each request gets a connection of its own to the sandbox's port, through the
//! driver's port-forward (the same path as `sbx port-forward`): HTTP/1.1 from the client
//! (keep-alive is kept on the client's side), spoken over that connection by hyper's client
//! (`http::bridge`).
//!
//! Answers of its own: 404 for a Host that names no endpoint, 421 for a Host under another
//! domain, 409 for a Host two endpoints could answer (names holding `--`), 502 when the
//! sandbox is not Ready or nothing listens on the port, 503 while the gateway cannot tell or
//! another gateway of the store serves the sandbox (naming none). Each says why in a one-line
//! text body. Upgrades (WebSocket) are not forwarded.
//!
//! There is no authentication on this listener: exposing a port makes it reachable by
//! whoever reaches the listener (bind it to loopback, the default suggestion, or behind a
//! proxy that authenticates).

mod endpoint;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::daemon::connections;
use crate::frontdoor::FrontDoor;

/// Serves service endpoints on `listener` (under `limits`) over `front` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    limits: connections::Limits,
    front: FrontDoor,
    shutdown: CancellationToken,
) {
    crate::http::serve_http1(listener, "service", None, limits, shutdown, move |req| {
        let front = front.clone();
        async move { endpoint::route(&front, req).await }
    })
    .await
}

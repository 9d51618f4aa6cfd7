//! An HTTP/1.1 request spoken to a sandbox's port over a connection the front door forwarded
//! (the driver's port-forward, the path `sbx port-forward` takes): hyper's client on one end
//! of a duplex pipe, the forwarded connection's bytes on the other. Each request gets a
//! connection of its own; upgrades (WebSocket) are not forwarded.
//!
//! A door makes the forward's input with [`inputs`], opens the forward through the front door
//! with it (which decides who may wake the sandbox), then hands the open forward to [`send`],
//! or its failure to [`refused`].

use futures::StreamExt;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use sbx_actors::ForwardInputs;
use sbx_proto::v1::PortForwardOutput;
use sbx_proto::v1::port_forward_input::Input;
use sbx_proto::v1::port_forward_output::Output;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use super::{Body, text};
use crate::frontdoor::{Class, Failure, FrontStream};

/// Bytes in flight between hyper's client and a forwarded connection, each way.
const BRIDGE_BYTES: usize = 64 * 1024;

/// The door's end of a forward's input: what hyper's client writes goes there.
pub struct Upstream(mpsc::Sender<Input>);

/// A forward's input, as the front door takes it to open the forward, and the end [`send`]
/// writes the request into.
pub fn inputs() -> (Upstream, ForwardInputs) {
    let (tx, rx) = mpsc::channel::<Input>(16);
    let input: ForwardInputs = Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx));
    (Upstream(tx), input)
}

/// `req` sent to `port` of sandbox `sandbox_id` over the forward `output` (opened with the
/// input `up` is the end of), and the sandbox's answer; 502 when nothing answers on the port.
pub async fn send(
    req: Request<Incoming>,
    up: Upstream,
    output: FrontStream<PortForwardOutput>,
    sandbox_id: uuid::Uuid,
    port: u32,
) -> Response<Body> {
    let (client_io, bridge_io) = tokio::io::duplex(BRIDGE_BYTES);
    tokio::spawn(bridge(bridge_io, up.0, output));
    let (mut sender, conn) =
        match hyper::client::conn::http1::handshake(TokioIo::new(client_io)).await {
            Ok(pair) => pair,
            Err(e) => return text(StatusCode::BAD_GATEWAY, format!("the sandbox's port: {e}")),
        };
    tokio::spawn(async move {
        let _ = conn.await;
    });
    match sender.send_request(req).await {
        Ok(response) => response.map(|b| b.map_err(Into::into).boxed()),
        Err(e) => text(
            StatusCode::BAD_GATEWAY,
            format!("port {port} of sandbox {sandbox_id} did not answer the request: {e}"),
        ),
    }
}

/// The answer to a request whose forward the front door did not open: 502 saying why (the
/// sandbox is not Ready, the port is none), or 503 when another gateway of the store serves
/// the sandbox ([`Class::Elsewhere`]) — said without naming it: these requests are not
/// authenticated as a gRPC call is, and the gateways' ids and addresses are none of their
/// business.
pub fn refused(failure: &Failure) -> Response<Body> {
    if failure.class == Class::Elsewhere {
        return text(
            StatusCode::SERVICE_UNAVAILABLE,
            "this sandbox is served by another gateway of the store; send its service \
             requests to that gateway"
                .to_string(),
        );
    }
    text(StatusCode::BAD_GATEWAY, failure.message.clone())
}

/// Copies bytes between hyper's side of a duplex pipe and a forwarded connection, each way
/// until its end (a half-close passes through as one).
async fn bridge(
    io: tokio::io::DuplexStream,
    tx: mpsc::Sender<Input>,
    mut output: FrontStream<PortForwardOutput>,
) {
    let (mut reader, mut writer) = tokio::io::split(io);
    let up = async move {
        let mut buf = vec![0u8; BRIDGE_BYTES];
        loop {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => {
                    let _ = tx.send(Input::CloseWrite(true)).await;
                    return;
                }
                Ok(n) => {
                    if tx.send(Input::Data(buf[..n].to_vec())).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    let down = async move {
        while let Some(item) = output.next().await {
            match item {
                Ok(PortForwardOutput {
                    output: Some(Output::Data(data)),
                }) => {
                    if writer.write_all(&data).await.is_err() {
                        return;
                    }
                }
                Ok(PortForwardOutput {
                    output: Some(Output::Closed(_)),
                })
                | Err(_) => break,
                Ok(_) => {}
            }
        }
        let _ = writer.shutdown().await;
    };
    tokio::join!(up, down);
}

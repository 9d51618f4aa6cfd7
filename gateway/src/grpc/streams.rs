//! Server streams: an exec's first message and the rest of its input, and the forwarding task
//! that ends every stream when sbxd shuts down. (What the driver says is put in the public
//! API's words by the actors.)

use std::pin::Pin;

use futures::{Stream, StreamExt};
use sbx_actors::{ActorError, ExecInputs};
use sbx_proto::v1;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::status::actor_error_to_status;

/// What every streaming handler answers.
pub type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Messages buffered between the source and the client; the source waits when it is full.
const STREAM_BUFFER: usize = 64;
/// The same for a watch, whose every message carries a whole sandbox (a spec may be 256 KiB):
/// the event hub holds each event once already, so a deeper buffer here would only hold
/// copies — 64 of them were 15 MiB per watch that does not read.
pub const WATCH_STREAM_BUFFER: usize = 4;

/// Forwards `source` to the client until it ends, the client goes away, or `shutdown` is
/// cancelled — then the client gets one last `UNAVAILABLE` saying sbxd is shutting down.
pub fn forward<T, S>(source: S, shutdown: CancellationToken) -> ResponseStream<T>
where
    T: Send + 'static,
    S: Stream<Item = Result<T, Status>> + Send + 'static,
{
    forward_buffered(source, shutdown, STREAM_BUFFER)
}

/// [`forward`] with at most `buffer` messages between the source and the client.
pub fn forward_buffered<T, S>(
    source: S,
    shutdown: CancellationToken,
    buffer: usize,
) -> ResponseStream<T>
where
    T: Send + 'static,
    S: Stream<Item = Result<T, Status>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(buffer);
    tokio::spawn(async move {
        let mut source = Box::pin(source);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => {
                    let _ = tx
                        .send(Err(actor_error_to_status(&ActorError::Unavailable(
                            "sbxd is shutting down; retry (or resume) against the restarted gateway"
                                .into(),
                        ))))
                        .await;
                    return;
                }
                _ = tx.closed() => return,
                item = source.next() => match item {
                    Some(item) => {
                        let failed = item.is_err();
                        if tx.send(item).await.is_err() || failed {
                            return;
                        }
                    }
                    None => return,
                },
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

/// An INVALID_ARGUMENT for a client stream that broke the stream's rules, with its
/// ErrorInfo (reason INVALID_ARGUMENT) like every other refusal.
pub fn invalid_input(message: impl Into<String>) -> Status {
    actor_error_to_status(&ActorError::InvalidArgument(message.into()))
}

/// The first message of an exec's input stream, which must be its request.
pub async fn exec_start(
    messages: &mut tonic::Streaming<v1::ExecInput>,
) -> Result<v1::ExecRequest, Status> {
    match messages.message().await? {
        Some(v1::ExecInput {
            input: Some(v1::exec_input::Input::Start(req)),
        }) => Ok(req),
        Some(_) => Err(invalid_input(
            "the first message of an exec stream must be its request (start), not input",
        )),
        None => Err(invalid_input(
            "the exec stream ended before its request (start)",
        )),
    }
}

/// The rest of an exec's input, as the actors take it: the caller's messages until its stream
/// ends or breaks (the client is gone; its output goes with it), a message without input
/// skipped. The actors refuse input that makes no sense.
pub fn exec_inputs(messages: tonic::Streaming<v1::ExecInput>) -> ExecInputs {
    let inputs = messages
        .take_while(|m| std::future::ready(m.is_ok()))
        .filter_map(|m| std::future::ready(m.ok().and_then(|m| m.input)));
    Box::pin(inputs)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_finite_stream_is_forwarded_whole() {
        let source = futures::stream::iter((1..=5).map(Ok::<u32, Status>));
        let out: Vec<u32> = forward(source, CancellationToken::new())
            .map(|r| r.unwrap())
            .collect()
            .await;
        assert_eq!(out, vec![1, 2, 3, 4, 5]);
    }

    #[tokio::test]
    async fn an_error_ends_the_stream() {
        let source = futures::stream::iter(vec![Ok(1u32), Err(Status::internal("boom")), Ok(2)]);
        let out: Vec<Result<u32, Status>> =
            forward(source, CancellationToken::new()).collect().await;
        assert_eq!(out.len(), 2);
        assert_eq!(out[1].as_ref().unwrap_err().code(), tonic::Code::Internal);
    }

    #[tokio::test]
    async fn shutdown_ends_an_endless_stream_with_unavailable() {
        let token = CancellationToken::new();
        let endless = futures::stream::pending::<Result<u32, Status>>();
        let mut out = forward(endless, token.clone());
        token.cancel();
        let last = tokio::time::timeout(Duration::from_secs(5), out.next())
            .await
            .expect("the stream did not end after shutdown");
        assert_eq!(last.unwrap().unwrap_err().code(), tonic::Code::Unavailable);
        let end = tokio::time::timeout(Duration::from_secs(5), out.next())
            .await
            .unwrap();
        assert!(end.is_none());
    }
}

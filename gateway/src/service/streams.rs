//! Server streams: conversion of the driver's exec/log messages to `sbx.v1`, and the forwarding
//! task that ends every stream when sbxd shuts down.

use std::pin::Pin;

use futures::{Stream, StreamExt};
use sbx_actors::ActorError;
use sbx_drivers::{DriverError, pb};
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

/// Forwards `source` to the client until it ends, the client goes away, or `shutdown` is
/// cancelled — then the client gets one last `UNAVAILABLE` saying sbxd is shutting down.
pub fn forward<T, S>(source: S, shutdown: CancellationToken) -> ResponseStream<T>
where
    T: Send + 'static,
    S: Stream<Item = Result<T, Status>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
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

/// A driver error inside a stream, as the client sees it.
pub fn driver_stream_error(err: DriverError) -> Status {
    actor_error_to_status(&ActorError::Driver(err))
}

pub fn exec_output(out: pb::ExecOutput) -> v1::ExecOutput {
    use pb::exec_output::Chunk as In;
    use v1::exec_output::Chunk as Out;
    v1::ExecOutput {
        chunk: out.chunk.map(|chunk| match chunk {
            In::Stdout(data) => Out::Stdout(data),
            In::Stderr(data) => Out::Stderr(data),
            In::Exit(exit) => Out::Exit(v1::ExecExit {
                code: exit.code,
                signal: exit.signal,
            }),
        }),
    }
}

pub fn log_chunk(chunk: pb::LogChunk) -> v1::LogChunk {
    v1::LogChunk { data: chunk.data }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn exec_output_keeps_every_kind_of_chunk() {
        use pb::exec_output::Chunk as In;
        use v1::exec_output::Chunk as Out;
        let cases = [
            (
                Some(In::Stdout(b"out".to_vec())),
                Some(Out::Stdout(b"out".to_vec())),
            ),
            (
                Some(In::Stderr(b"err".to_vec())),
                Some(Out::Stderr(b"err".to_vec())),
            ),
            (
                Some(In::Exit(pb::ExecExit {
                    code: -1,
                    signal: 9,
                })),
                Some(Out::Exit(v1::ExecExit {
                    code: -1,
                    signal: 9,
                })),
            ),
            (None, None),
        ];
        for (input, expected) in cases {
            assert_eq!(exec_output(pb::ExecOutput { chunk: input }).chunk, expected);
        }
        assert_eq!(
            log_chunk(pb::LogChunk {
                data: b"x".to_vec()
            })
            .data,
            b"x"
        );
    }

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

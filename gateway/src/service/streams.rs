//! Server streams: conversion of the driver's exec/log messages to `sbx.v1`, and the forwarding
//! task that ends every stream when sbxd shuts down.

use std::pin::Pin;

use futures::{Stream, StreamExt};
use sbx_actors::ActorError;
use sbx_drivers::{DriverError, pb};
use sbx_proto::v1;
use tokio::sync::{mpsc, oneshot};
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

/// A driver error inside a stream, as the client sees it.
pub fn driver_stream_error(err: DriverError) -> Status {
    actor_error_to_status(&ActorError::Driver(err))
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

/// The rest of an exec's input, as the driver takes it. Input that makes no sense — a second
/// request, a resize without a terminal, a signal number that is none — stops the input (it
/// is not taken for the end of stdin), and `refused` then says why: the exec ends with that
/// INVALID_ARGUMENT (see [`until_refused`]), which ends the command.
/// A broken client stream ends the input (the client is gone; its output goes with it).
pub fn exec_input(
    messages: tonic::Streaming<v1::ExecInput>,
    tty: bool,
) -> (sbx_drivers::ExecInputStream, oneshot::Receiver<Status>) {
    use pb::exec_input::Input as Out;
    use v1::exec_input::Input as In;
    let (refuse, refused) = oneshot::channel();
    let input = futures::stream::unfold(
        (messages, Some(refuse)),
        move |(mut messages, mut refuse)| async move {
            loop {
                let message = messages.message().await.ok().flatten()?;
                let converted = match message.input {
                    Some(In::Stdin(bytes)) => Ok(Out::Stdin(bytes)),
                    Some(In::CloseStdin(close)) => Ok(Out::CloseStdin(close)),
                    Some(In::Resize(size)) if tty => Ok(Out::Resize(pb::TerminalSize {
                        rows: size.rows,
                        cols: size.cols,
                    })),
                    Some(In::Resize(_)) => Err("a resize for an exec without a terminal (tty)"),
                    Some(In::Signal(n)) if (1..=64).contains(&n) => Ok(Out::Signal(n)),
                    Some(In::Signal(_)) => Err("a signal number outside 1..=64"),
                    Some(In::Start(_)) => Err("a second request (start) in one exec stream"),
                    None => continue,
                };
                match converted {
                    Ok(input) => {
                        let item = pb::ExecInput { input: Some(input) };
                        return Some((item, (messages, refuse)));
                    }
                    Err(why) => {
                        if let Some(refuse) = refuse.take() {
                            let _ =
                                refuse.send(invalid_input(format!("exec input refused: {why}")));
                        }
                        // Not an end of stdin (a command could then exit cleanly before
                        // the refusal is seen): the input stays open until the refusal ends
                        // the exec, and with it the command.
                        return std::future::pending().await;
                    }
                }
            }
        },
    );
    (Box::pin(input), refused)
}

/// `output` until it ends, or until `refused` says the client's input was refused: then that
/// error, last.
pub fn until_refused<S>(
    output: S,
    refused: oneshot::Receiver<Status>,
) -> impl Stream<Item = Result<v1::ExecOutput, Status>> + Send + 'static
where
    S: Stream<Item = Result<v1::ExecOutput, Status>> + Send + 'static,
{
    let state = (Box::pin(output), Some(refused));
    futures::stream::unfold(Some(state), |state| async move {
        let (mut output, mut refused) = state?;
        loop {
            let Some(waiting) = refused.as_mut() else {
                let item = output.next().await?;
                return Some((item, Some((output, refused))));
            };
            tokio::select! {
                // A refusal first: output already on its way does not hide it.
                biased;
                said = waiting => match said {
                    Ok(status) => return Some((Err(status), None)),
                    // The input ended without a refusal: only the output is left.
                    Err(_) => refused = None,
                },
                item = output.next() => {
                    let item = item?;
                    return Some((item, Some((output, refused))));
                }
            }
        }
    })
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
                timed_out: exit.timed_out,
            }),
        }),
    }
}

pub fn log_chunk(chunk: pb::LogChunk) -> v1::LogChunk {
    let stream = match pb::LogStream::try_from(chunk.stream) {
        Ok(pb::LogStream::Stderr) => v1::LogStream::Stderr,
        Ok(pb::LogStream::Stdout) | Err(_) => v1::LogStream::Stdout,
    };
    v1::LogChunk {
        data: chunk.data,
        stream: stream as i32,
        time: chunk.time,
    }
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
                    timed_out: false,
                })),
                Some(Out::Exit(v1::ExecExit {
                    code: -1,
                    signal: 9,
                    timed_out: false,
                })),
            ),
            (
                Some(In::Exit(pb::ExecExit {
                    code: 124,
                    signal: 0,
                    timed_out: true,
                })),
                Some(Out::Exit(v1::ExecExit {
                    code: 124,
                    signal: 0,
                    timed_out: true,
                })),
            ),
            (None, None),
        ];
        for (input, expected) in cases {
            assert_eq!(exec_output(pb::ExecOutput { chunk: input }).chunk, expected);
        }
        let time = Some(sbx_proto::Timestamp {
            seconds: 1_772_359_200,
            nanos: 5,
        });
        let chunk = |stream: pb::LogStream| pb::LogChunk {
            data: b"x".to_vec(),
            stream: stream as i32,
            time,
        };
        let err = log_chunk(chunk(pb::LogStream::Stderr));
        assert_eq!(
            (err.data.as_slice(), err.stream, err.time),
            (&b"x"[..], v1::LogStream::Stderr as i32, time)
        );
        let out = log_chunk(chunk(pb::LogStream::Stdout));
        assert_eq!(out.stream, v1::LogStream::Stdout as i32);
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

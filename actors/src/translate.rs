//! The driver contract's words in the public API's and back, for what the actors pass between
//! a caller and a driver (a layer of its own, below both the sandbox actor and the API that
//! use it): the gateway above speaks only the public API.

use futures::{Stream, StreamExt};
use sbx_driver_api::{ExecInputStream, pb};
use sbx_proto::v1::{self, NetworkDenial};
use tokio::sync::oneshot;

use crate::error::ActorError;

/// The driver's create request for a sandbox as its record says (`id` its record's). The
/// sandbox actor sets what the record does not say: the run's environment, and `stopped`.
pub(crate) fn create_request(id: uuid::Uuid, sb: &v1::Sandbox) -> pb::CreateRequest {
    let spec = sb.spec.clone().unwrap_or_default();
    let resources = spec.resources.unwrap_or_default();
    pb::CreateRequest {
        run_env: Default::default(),
        sandbox_id: id.to_string(),
        workspace: sb.workspace.clone(),
        name: sb.name.clone(),
        spec: Some(pb::SandboxSpec {
            command: spec.command,
            env: spec.env,
            resources: Some(pb::Resources {
                cpu_millis: resources.cpu_millis,
                memory_bytes: resources.memory_bytes,
                disk_bytes: resources.disk_bytes,
            }),
            // A driver with images is given the digest pinned at create, never the name.
            image: if spec.image_digest.is_empty() {
                spec.image
            } else {
                spec.image_digest
            },
            network: spec.network.map(|n| pb::NetworkPolicy {
                mode: n.mode,
                allow: n.allow,
            }),
        }),
        generation: sb.generation,
        stopped: false,
    }
}

/// The driver's word for a denial, in the public API's.
pub(crate) fn public_denial(d: pb::NetworkDenial) -> NetworkDenial {
    NetworkDenial {
        destination: d.destination,
        protocol: d.protocol,
        port: d.port,
        packets: d.packets,
    }
}

/// The driver's count of budget refusals, in the public API's words.
pub(crate) fn public_refusals(r: pb::BudgetRefusals) -> v1::BudgetRefusals {
    v1::BudgetRefusals {
        ptys: r.ptys,
        pids: r.pids,
        dns_queries: r.dns_queries,
        connections: r.connections,
    }
}

/// A terminal as the driver takes it.
pub(crate) fn tty(t: v1::Tty) -> pb::Tty {
    pb::Tty {
        rows: t.rows,
        cols: t.cols,
        term: t.term,
    }
}

/// An exec's output chunk in the public API's words.
pub(crate) fn exec_output(out: pb::ExecOutput) -> v1::ExecOutput {
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

/// A log chunk in the public API's words.
pub(crate) fn log_chunk(chunk: pb::LogChunk) -> v1::LogChunk {
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

/// A port-forward's input as the driver takes it: data and the end of the caller's writes
/// (a second start is none of the driver's business: dropped).
pub(crate) fn forward_input(input: v1::port_forward_input::Input) -> Option<pb::PortForwardInput> {
    use pb::port_forward_input::Input as Out;
    use v1::port_forward_input::Input as In;
    let input = match input {
        In::Data(bytes) => Out::Data(bytes),
        In::CloseWrite(close) => Out::CloseWrite(close),
        In::Start(_) => return None,
    };
    Some(pb::PortForwardInput { input: Some(input) })
}

/// A port-forward's output in the public API's words.
pub(crate) fn forward_output(o: pb::PortForwardOutput) -> v1::PortForwardOutput {
    use pb::port_forward_output::Output as From;
    use v1::port_forward_output::Output as To;
    v1::PortForwardOutput {
        output: o.output.map(|o| match o {
            From::Data(d) => To::Data(d),
            From::Closed(c) => To::Closed(c),
        }),
    }
}

/// The rest of an exec's input, as the driver takes it. Input that makes no sense — a second
/// request, a resize without a terminal, a signal number that is none — stops the input (it
/// is not taken for the end of stdin), and `refused` then says why: the exec ends with that
/// INVALID_ARGUMENT (see [`until_refused`]), which ends the command.
pub(crate) fn exec_input(
    inputs: impl Stream<Item = v1::exec_input::Input> + Send + 'static,
    tty: bool,
) -> (ExecInputStream, oneshot::Receiver<ActorError>) {
    use pb::exec_input::Input as Out;
    use v1::exec_input::Input as In;
    let (refuse, refused) = oneshot::channel();
    let input = futures::stream::unfold(
        (Box::pin(inputs), Some(refuse)),
        move |(mut inputs, mut refuse)| async move {
            let converted = match inputs.next().await? {
                In::Stdin(bytes) => Ok(Out::Stdin(bytes)),
                In::CloseStdin(close) => Ok(Out::CloseStdin(close)),
                In::Resize(size) if tty => Ok(Out::Resize(pb::TerminalSize {
                    rows: size.rows,
                    cols: size.cols,
                })),
                In::Resize(_) => Err("a resize for an exec without a terminal (tty)"),
                In::Signal(n) if (1..=64).contains(&n) => Ok(Out::Signal(n)),
                In::Signal(_) => Err("a signal number outside 1..=64"),
                In::Start(_) => Err("a second request (start) in one exec stream"),
            };
            match converted {
                Ok(input) => {
                    let item = pb::ExecInput { input: Some(input) };
                    Some((item, (inputs, refuse)))
                }
                Err(why) => {
                    if let Some(refuse) = refuse.take() {
                        let _ = refuse.send(ActorError::InvalidArgument(format!(
                            "exec input refused: {why}"
                        )));
                    }
                    // Not an end of stdin (a command could then exit cleanly before the
                    // refusal is seen): the input stays open until the refusal ends the
                    // exec, and with it the command.
                    std::future::pending().await
                }
            }
        },
    );
    (Box::pin(input), refused)
}

/// `output` until it ends, or until `refused` says the caller's input was refused: then that
/// error, last.
pub(crate) fn until_refused<S>(
    output: S,
    refused: oneshot::Receiver<ActorError>,
) -> impl Stream<Item = Result<v1::ExecOutput, ActorError>> + Send + 'static
where
    S: Stream<Item = Result<v1::ExecOutput, ActorError>> + Send + 'static,
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
                    Ok(err) => return Some((Err(err), None)),
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

#[cfg(test)]
mod tests {
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
}

//! Copy and port-forward of the vm driver, through its exec ([`streams`](super::streams)):
//! the guest's virtio ports carry exec only, so each operation is one exec of the guest's
//! own `sbx-agent` as a command (the agent crate's `tools` module) — `pack PATH` for
//! copy_from, `unpack DEST` for copy_to, `connect PORT` for a forwarded connection — with the
//! tar or the connection's bytes as its stdin and stdout. The archive code and the error
//! kinds are the socket drivers': a missing path or an escaping archive entry is
//! `InvalidArgument`, nothing listening on the port `FailedPrecondition`, both as the call's
//! error (before any byte), a sandbox that is not running `FailedPrecondition`.
//!
//! Each operation holds one of the VM's exec channels while it lasts (a forwarded connection
//! for its whole life; more wait for a free one, see [`qemu::EXEC_CHANNELS`](super::qemu)).
//! Dropping a returned stream drops the exec's, which ends the guest's command (SIGKILL to
//! its process group) as for any abandoned exec.

use std::collections::VecDeque;

use futures::StreamExt;
use sbx_agent::tools;

use super::VmDriver;
use pb::exec_output::Chunk;
use pb::port_forward_output::Output;
use sbx_driver_api::{DriverError, DriverStream, ExecInputStream, no_exec_input, pb};

/// The agent in the guest's initramfs (`guest/init.sh` starts it from there); in a sandbox
/// of an image, where execs run in the image's root, its copy there (`guest::AGENT_IN_ROOT`).
const AGENT: &str = "/bin/sbx-agent";

/// What one of the exec's output messages is to an operation.
enum Event {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    /// Exit 0.
    Done,
    /// A failed exit, already the error it stands for.
    Failed(DriverError),
}

/// An exec of `sbx-agent TOOL ARGS` and the stderr it wrote so far.
struct ToolRun {
    tool: &'static str,
    sandbox: String,
    out: DriverStream<pb::ExecOutput>,
    stderr: Vec<u8>,
}

impl ToolRun {
    async fn start(
        driver: &VmDriver,
        what: &str,
        sandbox: &str,
        tool: &'static str,
        arg: String,
        input: Option<ExecInputStream>,
    ) -> Result<ToolRun, DriverError> {
        let agent = match sandbox
            .parse()
            .ok()
            .and_then(|id| driver.inner.records.get(id))
        {
            Some(rec) if rec.spec.process.is_some() => super::guest::AGENT_IN_ROOT,
            _ => AGENT,
        };
        let req = pb::ExecRequest {
            sandbox_id: sandbox.to_string(),
            command: vec![agent.to_string(), tool.to_string(), arg],
            stdin: input.is_some(),
            ..Default::default()
        };
        let out = driver
            .exec_for(
                what,
                req,
                input.unwrap_or_else(no_exec_input),
                tool != "connect",
            )
            .await?;
        Ok(ToolRun {
            tool,
            sandbox: sandbox.to_string(),
            out,
            stderr: Vec::new(),
        })
    }

    /// The next output; an exec that ends without its exit is an error.
    async fn next(&mut self) -> Event {
        loop {
            match self.out.next().await {
                Some(Ok(pb::ExecOutput { chunk: Some(chunk) })) => {
                    return match chunk {
                        Chunk::Stdout(data) => Event::Stdout(data),
                        Chunk::Stderr(data) => {
                            self.stderr.extend_from_slice(&data);
                            Event::Stderr(data)
                        }
                        Chunk::Exit(exit) if exit.code == 0 && exit.signal == 0 => Event::Done,
                        Chunk::Exit(exit) => Event::Failed(self.error(&exit)),
                    };
                }
                Some(Ok(pb::ExecOutput { chunk: None })) => {}
                Some(Err(e)) => return Event::Failed(e),
                None => {
                    return Event::Failed(DriverError::Internal(format!(
                        "sandbox {}'s agent ({}) ended without an exit",
                        self.sandbox, self.tool
                    )));
                }
            }
        }
    }

    /// The error a failed exit of the tool stands for (see the agent's `tools` module): its
    /// last line on stderr, of the kind its status says.
    fn error(&self, exit: &pb::ExecExit) -> DriverError {
        let said = String::from_utf8_lossy(&self.stderr);
        let prefix = format!("sbx-agent {}: ", self.tool);
        let line = said
            .lines()
            .rev()
            .map(str::trim)
            .find(|l| !l.is_empty() && !is_connect_status(l))
            .unwrap_or("");
        let message = line.strip_prefix(&prefix).unwrap_or(line).to_string();
        let status = u8::try_from(exit.code).ok().filter(|_| exit.signal == 0);
        match status {
            Some(tools::INVALID) => DriverError::InvalidArgument(message),
            Some(tools::NOT_LISTENING) => DriverError::FailedPrecondition(message),
            Some(tools::USAGE | 126 | 127) => DriverError::Internal(format!(
                "sandbox {}'s agent cannot run {} ({message}); a vm booted by an older sbx has \
                 an agent without it: restart the sandbox",
                self.sandbox, self.tool
            )),
            _ if exit.signal != 0 => DriverError::Internal(format!(
                "sandbox {}'s agent ({}) was ended by signal {}",
                self.sandbox, self.tool, exit.signal
            )),
            _ => DriverError::Internal(format!(
                "the sandbox's agent: {message} (exit {})",
                exit.code
            )),
        }
    }
}

/// Whether a stderr line of `connect` is one of its reports rather than an error.
fn is_connect_status(line: &str) -> bool {
    line == tools::CONNECTED || closed_after(line).is_some()
}

/// The byte count of a `closed N` line.
fn closed_after(line: &str) -> Option<u64> {
    line.strip_prefix(tools::CLOSED)?
        .strip_prefix(' ')?
        .parse()
        .ok()
}

impl VmDriver {
    /// `sbx-agent pack PATH` in the guest. The tar's first bytes come before the call
    /// answers: a path that cannot be packed is the call's error.
    pub(super) async fn copy_from_vm(
        &self,
        req: pb::CopyFromRequest,
    ) -> Result<DriverStream<pb::CopyChunk>, DriverError> {
        let mut run = ToolRun::start(
            self,
            "copying files",
            &req.sandbox_id,
            "pack",
            req.path.clone(),
            None,
        )
        .await?;
        let first = loop {
            match run.next().await {
                Event::Stdout(data) => break Some(data),
                Event::Stderr(_) => {}
                Event::Done => break None,
                Event::Failed(e) => return Err(e),
            }
        };
        let Some(first) = first else {
            return Ok(Box::pin(futures::stream::empty()));
        };
        let chunks = futures::stream::unfold((Some(run), Some(first)), |(run, first)| async move {
            let mut run = run?;
            if let Some(data) = first {
                return Some((Ok(pb::CopyChunk { data }), (Some(run), None)));
            }
            loop {
                match run.next().await {
                    Event::Stdout(data) => {
                        return Some((Ok(pb::CopyChunk { data }), (Some(run), None)));
                    }
                    Event::Stderr(_) => {}
                    Event::Done => return None,
                    Event::Failed(e) => return Some((Err(e), (None, None))),
                }
            }
        });
        Ok(Box::pin(chunks))
    }

    /// `sbx-agent unpack DEST` in the guest, the tar as its stdin; answers with its exit.
    pub(super) async fn copy_to_vm(
        &self,
        req: pb::CopyToStart,
        data: sbx_driver_api::ByteStream,
    ) -> Result<pb::CopyToResponse, DriverError> {
        use pb::exec_input::Input;
        // The exec closes stdin when this ends.
        let input = data.map(|bytes| pb::ExecInput {
            input: Some(Input::Stdin(bytes)),
        });
        let mut run = ToolRun::start(
            self,
            "copying files",
            &req.sandbox_id,
            "unpack",
            req.path.clone(),
            Some(Box::pin(input)),
        )
        .await?;
        loop {
            match run.next().await {
                Event::Stdout(_) | Event::Stderr(_) => {}
                Event::Done => return Ok(pb::CopyToResponse {}),
                Event::Failed(e) => return Err(e),
            }
        }
    }

    /// `sbx-agent connect PORT` in the guest: the caller's data as its stdin (close_write
    /// its end), its stdout as the connection's data; answers once it says it is connected.
    /// `closed` comes when it says the port's side ended and every byte before has been
    /// passed on; the stream ends with its exit, once both directions are done.
    pub(super) async fn port_forward_vm(
        &self,
        req: pb::PortForwardStart,
        input: sbx_driver_api::ForwardInputStream,
    ) -> Result<DriverStream<pb::PortForwardOutput>, DriverError> {
        use pb::exec_input::Input as ExecIn;
        use pb::port_forward_input::Input;
        let port = sbx_host_kit::agent::forward_port(&req)?;
        let input = input.filter_map(|msg| async move {
            let input = match msg.input? {
                Input::Data(bytes) => ExecIn::Stdin(bytes),
                Input::CloseWrite(true) => ExecIn::CloseStdin(true),
                // A second start, `close_write: false`: nothing to do.
                Input::CloseWrite(false) | Input::Start(_) => return None,
            };
            Some(pb::ExecInput { input: Some(input) })
        });
        let run = ToolRun::start(
            self,
            "port forwarding",
            &req.sandbox_id,
            "connect",
            port.to_string(),
            Some(Box::pin(input)),
        )
        .await?;
        let mut forward = Forward {
            run,
            lines: Vec::new(),
            connected: false,
            passed: 0,
            closed_after: None,
            closed_sent: false,
            queue: VecDeque::new(),
            over: false,
        };
        while !forward.connected {
            forward.step().await?;
            if forward.over {
                return Err(DriverError::Internal(format!(
                    "sandbox {}'s agent (connect) ended without saying it connected",
                    req.sandbox_id
                )));
            }
        }
        let stream = futures::stream::unfold(forward, |mut forward| async move {
            loop {
                if let Some(item) = forward.queue.pop_front() {
                    return Some((item, forward));
                }
                if forward.over {
                    return None;
                }
                if let Err(e) = forward.step().await {
                    return Some((Err(e), forward));
                }
            }
        });
        Ok(Box::pin(stream))
    }
}

/// A forwarded connection's exec, read into what the caller gets.
struct Forward {
    run: ToolRun,
    /// stderr not yet cut into lines.
    lines: Vec<u8>,
    connected: bool,
    /// Bytes of data passed on (queued).
    passed: u64,
    /// `closed N` said, not yet passed on: N.
    closed_after: Option<u64>,
    closed_sent: bool,
    queue: VecDeque<Result<pb::PortForwardOutput, DriverError>>,
    /// The exec has ended: nothing more to read.
    over: bool,
}

impl Forward {
    /// Reads one output of the exec into the queue; an error is returned instead (and the
    /// forward is over).
    async fn step(&mut self) -> Result<(), DriverError> {
        match self.run.next().await {
            Event::Stdout(data) => {
                // Data before the report: connected all the same (stdout and stderr race).
                self.connected = true;
                self.passed += data.len() as u64;
                self.queue.push_back(Ok(output(Output::Data(data))));
            }
            Event::Stderr(data) => {
                self.lines.extend_from_slice(&data);
                while let Some(end) = self.lines.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = self.lines.drain(..=end).collect();
                    let line = String::from_utf8_lossy(&line);
                    let line = line.trim();
                    if line == tools::CONNECTED {
                        self.connected = true;
                    } else if let Some(n) = closed_after(line) {
                        self.closed_after = Some(n);
                    }
                }
            }
            Event::Done => {
                self.over = true;
                // Every byte is in: the exit comes after the output.
                self.closed_after = Some(0);
            }
            Event::Failed(e) => {
                self.over = true;
                return Err(e);
            }
        }
        if !self.closed_sent && self.closed_after.is_some_and(|n| self.passed >= n) {
            self.closed_sent = true;
            self.queue.push_back(Ok(output(Output::Closed(true))));
        }
        Ok(())
    }
}

fn output(output: Output) -> pb::PortForwardOutput {
    pb::PortForwardOutput {
        output: Some(output),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_reports_are_told_from_errors() {
        assert_eq!(closed_after("closed 102400"), Some(102_400));
        assert_eq!(closed_after("closed"), None);
        assert_eq!(closed_after("closed x"), None);
        assert!(is_connect_status("connected"));
        assert!(!is_connect_status(
            "sbx-agent connect: nothing accepts connections on 127.0.0.1:7778"
        ));
    }
}

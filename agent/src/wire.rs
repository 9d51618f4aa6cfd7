//! The agent's wire format, spoken over one Unix-socket connection per operation.
//!
//! Every message is a frame: a kind byte, a big-endian `u32` payload length, the payload
//! (at most [`MAX_PAYLOAD`] bytes). The agent's first frame is a [`Kind::Hello`] with its
//! version, sent the moment it accepts (a client that gets none knows no agent serves the
//! socket, even where the listening socket outlives it); the client's first frame is a
//! [`Kind::Exec`] request;
//! after it the client sends stdin bytes, an end of stdin, terminal sizes and signals, and
//! the agent sends stdout and stderr bytes and, last, the exit or an error. A connection that
//! closes before the exit is a client gone: the agent ends the command.
//!
//! One connection per operation keeps flow control in the kernel: the agent blocks writing a
//! full socket, so a slow reader slows the command and nothing piles up in between.
//!
//! Strings and byte strings in a payload are a `u32` length and the bytes; lists a `u32`
//! count and their items. The format is versioned by [`VERSION`], the request's first byte.
//!
//! Fields added since version 1 come at the end of a request, and only when set: an agent
//! reads them when its request has bytes left, so an older request reads as before. An older
//! agent (one still running in a sandbox started before the host kit was upgraded) refuses a
//! request that sets a newer field ("bytes left over") rather than run it without: an exec
//! that names a user never runs as the agent's own.

use std::io::{self, Read, Write};

/// The request format's version; an agent refuses a request of another.
pub const VERSION: u8 = 1;

/// The largest payload of one frame (stdin and output chunks are cut to at most this).
pub const MAX_PAYLOAD: usize = 64 * 1024;

/// The largest request frame (argv and environment): the kernel's own limit on an exec's
/// arguments is of the same order.
pub const MAX_REQUEST: usize = 4 * 1024 * 1024;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Client → agent, first frame: an [`ExecRequest`].
    Exec = 1,
    /// Client → agent, first frame: connect to a TCP port on the sandbox's loopback and carry
    /// bytes (stdin frames out, stdout frames back; close-stdin is a half-close; [`Kind::Eof`]
    /// the other side's).
    Forward = 6,
    /// Client → agent, first frame: unpack the tar that follows (as stdin frames, then
    /// close-stdin) at a path; the agent answers an exit (0) or an error.
    CopyIn = 7,
    /// Client → agent, first frame: send a path as a tar (stdout frames), then an exit (0).
    CopyOut = 8,
    /// Client → agent: bytes for the command's stdin (or the terminal).
    Stdin = 2,
    /// Client → agent: no more stdin (the pipe is closed; on a terminal, an end-of-file
    /// character is typed).
    CloseStdin = 3,
    /// Client → agent: the terminal's new size, rows and columns as two `u16`.
    Resize = 4,
    /// Client → agent: a signal for the command's process group, an `i32`.
    Signal = 5,
    /// Agent → client, first: the agent's version (UTF-8), sent on accept; after a
    /// [`Kind::Forward`], a second one says the port accepted the connection.
    Hello = 10,
    /// Agent → client: output of the command's stdout (or of the terminal).
    Stdout = 11,
    /// Agent → client: output of the command's stderr.
    Stderr = 12,
    /// Agent → client, last: the exit code (`i32`, -1 when killed) and signal (`i32`, or 0).
    Exit = 13,
    /// Agent → client, last: the command did not run; a [`Failure`] byte and a message.
    Error = 14,
    /// Agent → client: no more bytes will come from the forwarded port (its half-close).
    Eof = 15,
}

impl Kind {
    fn from_byte(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Exec,
            2 => Kind::Stdin,
            3 => Kind::CloseStdin,
            4 => Kind::Resize,
            5 => Kind::Signal,
            6 => Kind::Forward,
            7 => Kind::CopyIn,
            8 => Kind::CopyOut,
            15 => Kind::Eof,
            10 => Kind::Hello,
            11 => Kind::Stdout,
            12 => Kind::Stderr,
            13 => Kind::Exit,
            14 => Kind::Error,
            _ => return None,
        })
    }
}

/// Why a command did not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Failure {
    /// The request was wrong (a missing working directory, a bad request): the caller's fault.
    Invalid = 1,
    /// The agent could not do what was asked (a pty, a spawn that failed for another reason).
    Internal = 2,
    /// The sandbox has spent a budget the host gives it: no terminal is left in its exec pty
    /// instance (`max=` of the devpts the driver mounted). Neither the caller's fault nor the
    /// agent's; the driver counts it as a refusal.
    Exhausted = 3,
}

/// A terminal for the command.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Tty {
    pub rows: u16,
    pub cols: u16,
    /// The terminal type (`TERM`); empty means `xterm`.
    pub term: String,
}

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExecRequest {
    pub argv: Vec<Vec<u8>>,
    /// Set on top of the sandbox's own environment.
    pub env: Vec<(Vec<u8>, Vec<u8>)>,
    /// Empty means the sandbox's working directory.
    pub workdir: Vec<u8>,
    /// Whether the client sends stdin; without it the command's stdin is `/dev/null`.
    pub stdin: bool,
    /// A terminal: stdin, stdout and stderr are then one pty, and output comes as stdout.
    pub tty: Option<Tty>,
    /// Who the command runs as (`NAME`, `UID`, `NAME:GROUP`, `UID:GID`); empty: the agent's
    /// default user. Sent after the terminal, only when set (see the module docs).
    pub user: Vec<u8>,
}

/// One frame, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Exec(ExecRequest),
    Forward { port: u16 },
    CopyIn { path: Vec<u8> },
    CopyOut { path: Vec<u8> },
    Eof,
    Stdin(Vec<u8>),
    CloseStdin,
    Resize { rows: u16, cols: u16 },
    Signal(i32),
    Hello(String),
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit { code: i32, signal: i32 },
    Error { failure: Failure, message: String },
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(b);
}

/// A cursor over a payload that refuses to read past its end.
struct Payload<'a>(&'a [u8]);

impl<'a> Payload<'a> {
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(bad("a frame ends too early"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> io::Result<u16> {
        Ok(u16::from_be_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }

    fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn i32(&mut self) -> io::Result<i32> {
        Ok(i32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn bytes(&mut self) -> io::Result<Vec<u8>> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }

    fn count(&mut self) -> io::Result<usize> {
        let n = self.u32()? as usize;
        // Each item takes at least 4 bytes: a count beyond that is a lie, refused before any
        // allocation is made for it.
        if n > self.0.len() / 4 {
            return Err(bad("a list longer than its frame"));
        }
        Ok(n)
    }

    fn end(&self) -> io::Result<()> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(bad("a frame with bytes left over"))
        }
    }
}

fn check_version(version: u8) -> io::Result<()> {
    if version == VERSION {
        Ok(())
    } else {
        Err(bad(format!(
            "request version {version}; this agent speaks version {VERSION}"
        )))
    }
}

impl ExecRequest {
    fn encode(&self, out: &mut Vec<u8>) {
        out.push(VERSION);
        out.extend_from_slice(&(self.argv.len() as u32).to_be_bytes());
        for a in &self.argv {
            put_bytes(out, a);
        }
        out.extend_from_slice(&(self.env.len() as u32).to_be_bytes());
        for (k, v) in &self.env {
            put_bytes(out, k);
            put_bytes(out, v);
        }
        put_bytes(out, &self.workdir);
        out.push(u8::from(self.stdin));
        match &self.tty {
            None => out.push(0),
            Some(t) => {
                out.push(1);
                out.extend_from_slice(&t.rows.to_be_bytes());
                out.extend_from_slice(&t.cols.to_be_bytes());
                put_bytes(out, t.term.as_bytes());
            }
        }
        if !self.user.is_empty() {
            put_bytes(out, &self.user);
        }
    }

    fn decode(p: &mut Payload<'_>) -> io::Result<ExecRequest> {
        check_version(p.u8()?)?;
        let argv = (0..p.count()?)
            .map(|_| p.bytes())
            .collect::<io::Result<_>>()?;
        let env = (0..p.count()?)
            .map(|_| Ok((p.bytes()?, p.bytes()?)))
            .collect::<io::Result<_>>()?;
        let workdir = p.bytes()?;
        let stdin = p.u8()? != 0;
        let tty = match p.u8()? {
            0 => None,
            _ => Some(Tty {
                rows: p.u16()?,
                cols: p.u16()?,
                term: String::from_utf8(p.bytes()?).map_err(|_| bad("TERM is not UTF-8"))?,
            }),
        };
        let user = if p.0.is_empty() {
            Vec::new()
        } else {
            p.bytes()?
        };
        Ok(ExecRequest {
            argv,
            env,
            workdir,
            stdin,
            tty,
            user,
        })
    }
}

impl Frame {
    /// The frame as bytes on the wire.
    pub fn encode(&self) -> Vec<u8> {
        let mut payload = Vec::new();
        let kind = match self {
            Frame::Exec(req) => {
                req.encode(&mut payload);
                Kind::Exec
            }
            Frame::Forward { port } => {
                payload.push(VERSION);
                payload.extend_from_slice(&port.to_be_bytes());
                Kind::Forward
            }
            Frame::CopyIn { path } => {
                payload.push(VERSION);
                put_bytes(&mut payload, path);
                Kind::CopyIn
            }
            Frame::CopyOut { path } => {
                payload.push(VERSION);
                put_bytes(&mut payload, path);
                Kind::CopyOut
            }
            Frame::Eof => Kind::Eof,
            Frame::Stdin(b) => {
                payload.extend_from_slice(b);
                Kind::Stdin
            }
            Frame::CloseStdin => Kind::CloseStdin,
            Frame::Resize { rows, cols } => {
                payload.extend_from_slice(&rows.to_be_bytes());
                payload.extend_from_slice(&cols.to_be_bytes());
                Kind::Resize
            }
            Frame::Signal(n) => {
                payload.extend_from_slice(&n.to_be_bytes());
                Kind::Signal
            }
            Frame::Hello(version) => {
                payload.extend_from_slice(version.as_bytes());
                Kind::Hello
            }
            Frame::Stdout(b) => {
                payload.extend_from_slice(b);
                Kind::Stdout
            }
            Frame::Stderr(b) => {
                payload.extend_from_slice(b);
                Kind::Stderr
            }
            Frame::Exit { code, signal } => {
                payload.extend_from_slice(&code.to_be_bytes());
                payload.extend_from_slice(&signal.to_be_bytes());
                Kind::Exit
            }
            Frame::Error { failure, message } => {
                payload.push(*failure as u8);
                payload.extend_from_slice(message.as_bytes());
                Kind::Error
            }
        };
        let mut out = Vec::with_capacity(5 + payload.len());
        out.push(kind as u8);
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(&payload);
        out
    }

    /// Checks a frame header (kind byte and length) before its payload is read: the length
    /// must fit the kind, so a hostile peer cannot make the reader allocate without bound.
    pub fn check_header(header: [u8; 5]) -> io::Result<(Kind, usize)> {
        let kind = Kind::from_byte(header[0])
            .ok_or_else(|| bad(format!("unknown frame kind {}", header[0])))?;
        let len = u32::from_be_bytes(header[1..].try_into().expect("4 bytes")) as usize;
        let max = if matches!(kind, Kind::Exec | Kind::CopyIn | Kind::CopyOut) {
            MAX_REQUEST
        } else {
            MAX_PAYLOAD
        };
        if len > max {
            return Err(bad(format!(
                "a {kind:?} frame of {len} bytes (at most {max})"
            )));
        }
        Ok((kind, len))
    }

    /// Decodes a frame from its kind and payload.
    pub fn decode(kind: Kind, payload: &[u8]) -> io::Result<Frame> {
        let mut p = Payload(payload);
        let frame = match kind {
            Kind::Exec => Frame::Exec(ExecRequest::decode(&mut p)?),
            Kind::Forward => {
                check_version(p.u8()?)?;
                Frame::Forward { port: p.u16()? }
            }
            Kind::CopyIn => {
                check_version(p.u8()?)?;
                Frame::CopyIn { path: p.bytes()? }
            }
            Kind::CopyOut => {
                check_version(p.u8()?)?;
                Frame::CopyOut { path: p.bytes()? }
            }
            Kind::Eof => Frame::Eof,
            Kind::Stdin => Frame::Stdin(p.take(payload.len())?.to_vec()),
            Kind::CloseStdin => Frame::CloseStdin,
            Kind::Resize => Frame::Resize {
                rows: p.u16()?,
                cols: p.u16()?,
            },
            Kind::Signal => Frame::Signal(p.i32()?),
            Kind::Hello => {
                Frame::Hello(String::from_utf8_lossy(p.take(payload.len())?).into_owned())
            }
            Kind::Stdout => Frame::Stdout(p.take(payload.len())?.to_vec()),
            Kind::Stderr => Frame::Stderr(p.take(payload.len())?.to_vec()),
            Kind::Exit => Frame::Exit {
                code: p.i32()?,
                signal: p.i32()?,
            },
            Kind::Error => {
                let failure = match p.u8()? {
                    1 => Failure::Invalid,
                    3 => Failure::Exhausted,
                    _ => Failure::Internal,
                };
                let rest = p.take(p.0.len())?;
                Frame::Error {
                    failure,
                    message: String::from_utf8_lossy(rest).into_owned(),
                }
            }
        };
        p.end()?;
        Ok(frame)
    }

    /// Reads one frame; `None` at a clean end of the stream (before a header).
    pub fn read_from(r: &mut impl Read) -> io::Result<Option<Frame>> {
        let mut header = [0u8; 5];
        let mut got = 0;
        while got < header.len() {
            match r.read(&mut header[got..]) {
                Ok(0) if got == 0 => return Ok(None),
                Ok(0) => return Err(bad("the stream ended inside a frame header")),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let (kind, len) = Frame::check_header(header)?;
        let mut payload = vec![0u8; len];
        r.read_exact(&mut payload)?;
        Frame::decode(kind, &payload).map(Some)
    }

    /// Writes the frame whole.
    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        w.write_all(&self.encode())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(f: Frame) {
        let bytes = f.encode();
        let back = Frame::read_from(&mut &bytes[..]).unwrap().unwrap();
        assert_eq!(back, f);
    }

    #[test]
    fn every_frame_round_trips() {
        round_trip(Frame::Exec(ExecRequest {
            argv: vec![b"sh".to_vec(), b"-c".to_vec(), b"echo \xff".to_vec()],
            env: vec![(b"A".to_vec(), b"b=c".to_vec())],
            workdir: b"/tmp".to_vec(),
            stdin: true,
            tty: Some(Tty {
                rows: 24,
                cols: 80,
                term: "xterm-256color".into(),
            }),
            user: b"app:staff".to_vec(),
        }));
        round_trip(Frame::Exec(ExecRequest::default()));
        round_trip(Frame::Exec(ExecRequest {
            user: b"1000".to_vec(),
            ..ExecRequest::default()
        }));
        round_trip(Frame::Forward { port: 8080 });
        round_trip(Frame::CopyIn {
            path: b"/sandbox/in".to_vec(),
        });
        round_trip(Frame::CopyOut {
            path: b"/etc".to_vec(),
        });
        round_trip(Frame::Eof);
        round_trip(Frame::Stdin(vec![0; 1000]));
        round_trip(Frame::CloseStdin);
        round_trip(Frame::Resize {
            rows: 50,
            cols: 200,
        });
        round_trip(Frame::Signal(2));
        round_trip(Frame::Hello("0.1.0".into()));
        round_trip(Frame::Stdout(b"out".to_vec()));
        round_trip(Frame::Stderr(Vec::new()));
        round_trip(Frame::Exit {
            code: -1,
            signal: 9,
        });
        round_trip(Frame::Error {
            failure: Failure::Invalid,
            message: "workdir /nope does not exist".into(),
        });
        round_trip(Frame::Error {
            failure: Failure::Exhausted,
            message: "no terminal is left".into(),
        });
    }

    #[test]
    fn a_request_without_a_user_is_the_version_1_request() {
        // What an agent of before the user field reads, byte for byte: a request that sets
        // no user is unchanged; one that does has a field an older agent refuses (bytes left
        // over) instead of running the command as itself.
        let old = Frame::Exec(ExecRequest {
            argv: vec![b"id".to_vec()],
            ..ExecRequest::default()
        })
        .encode();
        let expected: &[u8] = &[
            1, 0, 0, 0, 21, VERSION, 0, 0, 0, 1, 0, 0, 0, 2, b'i', b'd', 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0,
        ];
        assert_eq!(old, expected);
        let mut named = Frame::Exec(ExecRequest {
            argv: vec![b"id".to_vec()],
            user: b"nobody".to_vec(),
            ..ExecRequest::default()
        })
        .encode();
        assert_eq!(named.len(), old.len() + 4 + 6);
        // Cut the user field off the payload: an older agent's reading (it stops at the tty).
        named.truncate(old.len());
        named[1..5].copy_from_slice(&21u32.to_be_bytes());
        assert_eq!(named, expected);
    }

    #[test]
    fn hostile_frames_are_refused_without_allocating() {
        // A length past the limit, an unknown kind, a list count larger than its frame, a
        // frame cut short, bytes left over.
        let mut huge = vec![Kind::Stdin as u8];
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(Frame::read_from(&mut &huge[..]).is_err());
        assert!(Frame::read_from(&mut &[99u8, 0, 0, 0, 0][..]).is_err());
        let mut lying = vec![VERSION];
        lying.extend_from_slice(&1_000_000u32.to_be_bytes());
        assert!(Frame::decode(Kind::Exec, &lying).is_err());
        assert!(Frame::decode(Kind::Exit, &[0, 0, 0]).is_err());
        assert!(Frame::decode(Kind::Signal, &[0, 0, 0, 2, 9]).is_err());
        let mut other_version = Frame::Exec(ExecRequest::default()).encode();
        other_version[5] = VERSION + 1;
        let err = Frame::read_from(&mut &other_version[..]).unwrap_err();
        assert!(err.to_string().contains("version"), "{err}");
        // A clean end before any header is not an error; inside one it is.
        assert!(Frame::read_from(&mut &[][..]).unwrap().is_none());
        assert!(Frame::read_from(&mut &[2u8, 0][..]).is_err());
    }
}

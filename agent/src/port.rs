//! `sbx-agent serve-port PATH`: exec over one byte stream — a virtio-serial port of a `vm`
//! sandbox (`/dev/vportNpM`, the port QEMU names `sbx.exec`) — instead of a listening socket.
//!
//! A port is not a listener: there is one stream for the VM's whole life, no connection per
//! exec, and no way to see the client go. So the stream is cut into turns, one exec each, by
//! the client:
//! - A turn begins with the client's [`Frame::Hello`] carrying a token of its choosing. The
//!   agent ends the command of an earlier turn if one still runs (SIGKILL to its process
//!   group: that client is gone) and echoes the greeting. Everything the client reads before
//!   that echo belongs to earlier turns and is skipped, so a client that died in the middle
//!   of one leaves nothing the next one mistakes for its own.
//! - Then the same frames as on a socket ([`crate::wire`]): the request, stdin, resizes and
//!   signals one way, output and, last, the exit or an error the other. The command runs as
//!   on a socket ([`crate::server::start`]).
//! - A client that gives up (a timeout, a caller gone) sends [`Frame::Signal`] 9; the exit
//!   then comes as for any other end.
//!
//! Frames from the client that come when no command runs are dropped. A header that cannot
//! start a frame (an unknown kind, a length past the limit) is skipped a byte at a time, so
//! a client that died in the middle of writing a frame can bring the stream back in step by
//! writing zeros (kind 0 starts no frame) before its greeting.

use std::fs::File;
use std::io::{self, Read, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::server::{Conn, Running, Sender, internal, start};
use crate::wire::{Frame, MAX_PAYLOAD};

/// How long to wait before reading again when the port reads end-of-file (no host side
/// connected).
const NOT_CONNECTED_RETRY: Duration = Duration::from_millis(100);

/// Serves execs on the port at `path`, one turn after the other, for ever.
pub fn serve(path: &Path) -> io::Result<()> {
    serve_file(open(path)?)
}

/// The port at `path`, opened to serve (before the agent drops to a user who may not open it).
pub fn open(path: &Path) -> io::Result<File> {
    File::options().read(true).write(true).open(path)
}

/// [`serve`] on a port already open.
pub fn serve_file(port: File) -> io::Result<()> {
    let out = Arc::new(Mutex::new(port.try_clone()?));
    let mut input = Input::new(port);
    let mut running: Option<Running> = None;
    loop {
        // An exec whose exit was sent is over: its process group may be gone, its id reused.
        if let Some(over) = running.take_if(|r| r.is_over()) {
            over.end();
        }
        match input.next_frame()? {
            Frame::Hello(token) => {
                if let Some(earlier) = running.take() {
                    earlier.end();
                }
                Turn(out.clone()).send(&Frame::Hello(token))?;
            }
            Frame::Exec(req) => {
                if running.is_some() {
                    // A second request within a turn: the client must greet first.
                    continue;
                }
                let sender = Sender::new(Turn(out.clone()));
                running = match start(&req, &sender) {
                    Ok(started) => started,
                    Err(e) => {
                        sender.finish(&internal(format!("the command could not start: {e}")));
                        None
                    }
                };
            }
            other => {
                if let Some(current) = running.as_mut() {
                    // A port has no hang-up to see: a client that gives up sends SIGKILL.
                    current.apply(other, &|| false);
                }
            }
        }
    }
}

/// One turn's hold on the port: each write is a whole frame, under the port's lock, so
/// frames of the output threads and of the next greeting never interleave.
struct Turn(Arc<Mutex<File>>);

impl Turn {
    fn send(mut self, frame: &Frame) -> io::Result<()> {
        frame.write_to(&mut self)
    }
}

impl Write for Turn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut port = self.0.lock().unwrap_or_else(|p| p.into_inner());
        port.write_all(buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The port stays open for the next turn.
impl Conn for Turn {}

/// The client's side of the stream, read into a buffer and cut into frames.
struct Input<R> {
    from: R,
    buf: Vec<u8>,
    /// Where the unread bytes of `buf` begin.
    at: usize,
}

impl<R: Read> Input<R> {
    fn new(from: R) -> Input<R> {
        Input {
            from,
            buf: Vec::new(),
            at: 0,
        }
    }

    /// Waits until at least `n` unread bytes are buffered.
    fn fill(&mut self, n: usize) -> io::Result<()> {
        while self.buf.len() - self.at < n {
            if self.at > MAX_PAYLOAD {
                self.buf.drain(..self.at);
                self.at = 0;
            }
            let len = self.buf.len();
            self.buf.resize(len + MAX_PAYLOAD, 0);
            match self.from.read(&mut self.buf[len..]) {
                Ok(0) => {
                    self.buf.truncate(len);
                    std::thread::sleep(NOT_CONNECTED_RETRY);
                }
                Ok(got) => self.buf.truncate(len + got),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => self.buf.truncate(len),
                Err(e) => {
                    self.buf.truncate(len);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// The next frame; bytes that start none, and frames that do not decode, are skipped.
    fn next_frame(&mut self) -> io::Result<Frame> {
        loop {
            self.fill(5)?;
            let header: [u8; 5] = self.buf[self.at..self.at + 5].try_into().expect("5 bytes");
            let Ok((kind, len)) = Frame::check_header(header) else {
                self.at += 1;
                continue;
            };
            self.fill(5 + len)?;
            let frame = Frame::decode(kind, &self.buf[self.at + 5..self.at + 5 + len]);
            self.at += 5 + len;
            if let Ok(frame) = frame {
                return Ok(frame);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that hands out its bytes a few at a time, then end-of-file for ever.
    struct Trickle(Vec<u8>, usize);

    impl Read for Trickle {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(3).min(self.0.len() - self.1);
            buf[..n].copy_from_slice(&self.0[self.1..self.1 + n]);
            self.1 += n;
            Ok(n)
        }
    }

    #[test]
    fn zeros_and_a_cut_frame_are_skipped_up_to_the_next_greeting() {
        // A stdin frame cut short by a client that died, the next client's zeros, its
        // greeting and its request.
        let mut cut = Frame::Stdin(vec![7; 1000]).encode();
        cut.truncate(400);
        let mut stream = cut;
        stream.extend(vec![0u8; MAX_PAYLOAD + 5]);
        stream.extend(Frame::Hello("turn-2".into()).encode());
        stream.extend(Frame::Signal(9).encode());
        let mut input = Input::new(Trickle(stream, 0));
        // The cut frame swallows 600 of the zeros and is passed on (as stdin of the dead
        // turn, dropped by the server); the rest are skipped.
        assert_eq!(input.next_frame().unwrap(), {
            let mut payload = vec![7; 395];
            payload.extend(vec![0; 605]);
            Frame::Stdin(payload)
        });
        assert_eq!(input.next_frame().unwrap(), Frame::Hello("turn-2".into()));
        assert_eq!(input.next_frame().unwrap(), Frame::Signal(9));
    }
}

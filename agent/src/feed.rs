//! A command's stdin, written by a thread of its own from a bounded queue, so that the
//! thread reading the client's frames never blocks on a command that does not read.
//!
//! Without it, a write of stdin to a command that stops reading (`sleep`, a REPL busy
//! computing) blocks the connection's reading thread: a signal frame behind the stdin is
//! never read (Ctrl-C does not reach the command), and a client that goes away is never
//! noticed (the command is never ended: a leaked process). With it:
//! - up to [`MAX_QUEUED`] bytes of stdin are taken from the connection and held while the
//!   command does not read, so a signal or a resize behind them is read and applied at once;
//! - past that the reading thread stops reading — the client is back-pressured through the
//!   socket, nothing is buffered without bound — and, while it waits for room, asks every
//!   [`GONE_CHECK`] whether the client is gone (the caller's `gone`), so a vanished client
//!   still ends the command.
//!
//! The writer thread ends when the input is closed and written (dropping the pipe: the
//! command reads end-of-file), or at the first failed write (the command closed its stdin or
//! exited; later input is dropped, as a pipe would). It holds nothing else, so a command
//! killed while the thread is blocked in a write frees it (the write fails).

use std::collections::VecDeque;
use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

/// How much stdin is held for a command that does not read: 4 MiB, 64 of the wire's frames.
pub const MAX_QUEUED: usize = 4 * 1024 * 1024;

/// How often a reader waiting for room asks whether the client is gone.
pub const GONE_CHECK: Duration = Duration::from_millis(100);

#[derive(Default)]
struct State {
    queue: VecDeque<Vec<u8>>,
    queued: usize,
    /// No more input will come: the writer drops the pipe once the queue is written.
    closed: bool,
    /// A write failed: the command does not take input any more.
    broken: bool,
}

type Shared = Arc<(Mutex<State>, Condvar)>;

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared.0.lock().unwrap_or_else(|p| p.into_inner())
}

/// The feeding end of a command's stdin.
pub struct StdinFeed {
    shared: Shared,
}

impl StdinFeed {
    /// Starts the writer thread on `sink` (the pipe or the pty).
    pub fn new(sink: Box<dyn Write + Send>) -> StdinFeed {
        let shared: Shared = Arc::default();
        let theirs = shared.clone();
        thread::spawn(move || write_all_queued(sink, &theirs));
        StdinFeed { shared }
    }

    /// Queues `bytes` for the command. Waits while [`MAX_QUEUED`] bytes are queued, asking
    /// `gone` every [`GONE_CHECK`]; `false` when `gone` said the client is gone (the bytes
    /// are then dropped). Bytes for a command that no longer reads are dropped at once.
    pub fn push(&self, bytes: Vec<u8>, gone: &dyn Fn() -> bool) -> bool {
        let mut state = lock(&self.shared);
        loop {
            if state.broken || state.closed {
                return true;
            }
            if state.queued < MAX_QUEUED {
                state.queued += bytes.len();
                state.queue.push_back(bytes);
                self.shared.1.notify_all();
                return true;
            }
            let (next, waited) = self
                .shared
                .1
                .wait_timeout(state, GONE_CHECK)
                .unwrap_or_else(|p| p.into_inner());
            state = next;
            if waited.timed_out() && gone() {
                return false;
            }
        }
    }

    /// No more input: the command reads end-of-file once what is queued is written.
    pub fn close(&self) {
        lock(&self.shared).closed = true;
        self.shared.1.notify_all();
    }
}

impl Drop for StdinFeed {
    fn drop(&mut self) {
        self.close();
    }
}

fn write_all_queued(mut sink: Box<dyn Write + Send>, shared: &Shared) {
    loop {
        let bytes = {
            let mut state = lock(shared);
            loop {
                if let Some(bytes) = state.queue.pop_front() {
                    state.queued -= bytes.len();
                    shared.1.notify_all();
                    break bytes;
                }
                if state.closed {
                    return;
                }
                state = shared.1.wait(state).unwrap_or_else(|p| p.into_inner());
            }
        };
        if sink.write_all(&bytes).and_then(|()| sink.flush()).is_err() {
            let mut state = lock(shared);
            state.broken = true;
            state.queue.clear();
            state.queued = 0;
            shared.1.notify_all();
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::time::Instant;

    fn pipe() -> (std::io::PipeReader, std::io::PipeWriter) {
        std::io::pipe().unwrap()
    }

    #[test]
    fn input_is_held_up_to_the_bound_and_then_the_reader_asks_whether_the_client_is_gone() {
        let (_unread, w) = pipe();
        let feed = StdinFeed::new(Box::new(w));
        let chunk = vec![7u8; 64 * 1024];
        // The pipe takes its own buffer's worth, the queue MAX_QUEUED: every push before
        // that returns at once, without asking.
        let asked = std::cell::Cell::new(0);
        let never = || {
            asked.set(asked.get() + 1);
            false
        };
        let began = Instant::now();
        for _ in 0..MAX_QUEUED / chunk.len() {
            assert!(feed.push(chunk.clone(), &never));
        }
        assert_eq!(asked.get(), 0);
        assert!(began.elapsed() < Duration::from_secs(2));
        // Past the bound, with nobody reading: the push waits, asking; a gone client ends it.
        let gone_after = std::cell::Cell::new(3);
        let gone = || {
            gone_after.set(gone_after.get() - 1);
            gone_after.get() == 0
        };
        let mut pushed = true;
        for _ in 0..3 {
            pushed = feed.push(chunk.clone(), &gone);
            if !pushed {
                break;
            }
        }
        assert!(
            !pushed,
            "a push past the bound must wait until the client is gone"
        );
        assert!(began.elapsed() >= 2 * GONE_CHECK);
    }

    #[test]
    fn what_is_queued_is_written_in_order_and_close_gives_end_of_file() {
        let (mut r, w) = pipe();
        let feed = StdinFeed::new(Box::new(w));
        let mut sent = Vec::new();
        for i in 0..100u32 {
            let bytes = i.to_le_bytes().repeat(1000);
            sent.extend_from_slice(&bytes);
            assert!(feed.push(bytes, &|| false));
        }
        feed.close();
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        assert_eq!(got, sent);
    }

    #[test]
    fn input_for_a_command_that_stopped_reading_is_dropped_at_once() {
        let (r, w) = pipe();
        drop(r);
        let feed = StdinFeed::new(Box::new(w));
        let began = Instant::now();
        for _ in 0..200 {
            assert!(feed.push(vec![1u8; 64 * 1024], &|| false));
        }
        assert!(began.elapsed() < Duration::from_secs(5));
    }
}

//! `sbx-agent log STREAM FIFO`: the logger of one of the main process's output streams.
//!
//! The sandbox's init makes a FIFO per stream, starts one logger on each, and starts the main
//! process with its stdout and stderr on them. A logger reads its FIFO and appends what it reads
//! to its own stdout (the sandbox's log file, opened `O_APPEND`) as records in the CRI log
//! format (what Kubernetes' container runtimes write, so the tools that read those read these):
//!
//! ```text
//! 2026-03-01T10:22:22.123456789Z stdout F hello
//! 2026-03-01T10:22:22.123461000Z stderr P a line the workload has not ended yet
//! ```
//!
//! a UTC time with nanoseconds (when the logger read the bytes), the stream, `F` for a full
//! line (its newline is the record's) or `P` for a part of one (the rest follows in later
//! records of the same stream), and the bytes, any but a newline. So the two streams stay
//! apart in one file, and each line has its time. A line is cut into `P` records of at most
//! [`MAX_RECORD`] (16 KiB) bytes; an unended line is written as a `P` record once nothing more
//! came for [`PARTIAL_WAIT`] (100 ms), so a prompt without a newline is seen. Records are written
//! whole, several per `write()` at most 64 KiB: writes to an `O_APPEND` file do not interleave,
//! so the other stream's logger never cuts into a record.
//!
//! Its life: it opens the FIFO only after it has blocked SIGTERM, SIGINT and SIGUSR1, and the
//! main process's own open of the FIFO waits for that one, so no signal finds a logger not yet
//! ready. Its own open does not wait for the main process's (a main process a stop ended
//! before it opened its end must not leave the logger, and so the init, waiting for ever). The init's stop sends SIGTERM to every process of the sandbox: the logger ignores it
//! and keeps reading until the main process is gone. It ends at the end of its input (every
//! writer closed), or on SIGUSR1, which the init sends once the main process has exited (a
//! background process the main started may hold the FIFO open for ever): then it reads what is
//! buffered in the FIFO without waiting (at most [`DRAIN_LIMIT`], 1 MiB), writes it, and ends.
//! A write to the log that fails drops those records and the logger reads on: a full disk
//! must not stop the workload on a full pipe.
//!
//! **A vm's console.** `sbx-agent log console - --rotate …` (`-`: stdin) is the host's logger of a vm
//! sandbox's serial console (the vm driver starts it next to QEMU, as an unprivileged user,
//! reading the pipe QEMU writes the console to): the bytes are written as they come, no
//! records (the console holds the guest's kernel, its init's lines and the guest loggers'
//! records already), within the same cap. It is the vm's log's bound: it runs on when the
//! driver is gone, so neither the host's disk fills nor the guest stalls on a full pipe.
//!
//! **The cap.** Given `--rotate MAX READ_FD PREVIOUS_FD`, the log and the part before it never
//! hold much more than MAX bytes together: before a write would take the log past MAX/2, the
//! logger copies the log into the previous part (PREVIOUS_FD, a file of the driver's, emptied
//! first; the copy read through READ_FD, the log opened for reading) and empties the log, then
//! writes. So the newest MAX/2 to MAX bytes are kept, whatever the workload writes, and a
//! reader that finds the log shorter than where it was reads the rest of it in the previous
//! part. The two streams' loggers take turns through a lock on the previous part (a POSIX
//! lock, held per process, for one check-rotate-write), so neither writes between the other's
//! copy and its emptying. Nothing of the files' names is needed: the driver opened all three.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{SigSet, SigmaskHow, Signal, sigprocmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use rustix::event::{PollFd, PollFlags, poll};

/// The most bytes of a line one record holds; a longer line is cut into `P` records.
pub const MAX_RECORD: usize = 16 * 1024;
/// How long an unended line is held for its end before it is written as a `P` record.
pub const PARTIAL_WAIT: Duration = Duration::from_millis(100);
/// The most the logger reads from its FIFO after SIGUSR1 before it ends.
pub const DRAIN_LIMIT: usize = 1024 * 1024;
/// The most one read takes, and about the most one write of records holds.
const READ_SIZE: usize = 64 * 1024;

/// Which of the main process's streams a logger records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
    /// A vm's serial console, written as it comes (see the module docs).
    Console,
}

impl Stream {
    /// `stdout` or `stderr`, the record's word for it.
    pub fn parse(word: &str) -> Option<Stream> {
        match word {
            "stdout" => Some(Stream::Stdout),
            "stderr" => Some(Stream::Stderr),
            "console" => Some(Stream::Console),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
            Stream::Console => "console",
        }
    }
}

/// Turns one stream's bytes into records: whole lines at once, an unended one when it is
/// [`MAX_RECORD`] long or [`Recorder::flush`] is called.
#[derive(Debug)]
pub struct Recorder {
    stream: Stream,
    /// The unended line so far (shorter than [`MAX_RECORD`]).
    pending: Vec<u8>,
}

impl Recorder {
    pub fn new(stream: Stream) -> Recorder {
        Recorder {
            stream,
            pending: Vec::new(),
        }
    }

    /// Whether an unended line is held.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Appends to `out` the records `data` completes, stamped `now`; keeps an unended rest.
    pub fn push(&mut self, data: &[u8], now: SystemTime, out: &mut Vec<u8>) {
        if self.stream == Stream::Console {
            out.extend_from_slice(data);
            return;
        }
        let stamp = rfc3339_nanos(now);
        let mut rest = data;
        while let Some(newline) = rest.iter().position(|&b| b == b'\n') {
            let (line, after) = rest.split_at(newline);
            self.pending.extend_from_slice(line);
            let mut whole = std::mem::take(&mut self.pending);
            let mut pieces = whole.chunks(MAX_RECORD).peekable();
            if pieces.peek().is_none() {
                self.record(&stamp, b'F', b"", out);
            }
            while let Some(piece) = pieces.next() {
                let tag = if pieces.peek().is_some() { b'P' } else { b'F' };
                self.record(&stamp, tag, piece, out);
            }
            whole.clear();
            self.pending = whole;
            rest = &after[1..];
        }
        self.pending.extend_from_slice(rest);
        while self.pending.len() >= MAX_RECORD {
            let piece: Vec<u8> = self.pending.drain(..MAX_RECORD).collect();
            self.record(&stamp, b'P', &piece, out);
        }
    }

    /// Appends the unended line, if any, to `out` as a `P` record stamped `now`.
    pub fn flush(&mut self, now: SystemTime, out: &mut Vec<u8>) {
        if self.pending.is_empty() {
            return;
        }
        let piece = std::mem::take(&mut self.pending);
        self.record(&rfc3339_nanos(now), b'P', &piece, out);
    }

    fn record(&self, stamp: &str, tag: u8, line: &[u8], out: &mut Vec<u8>) {
        out.extend_from_slice(stamp.as_bytes());
        out.push(b' ');
        out.extend_from_slice(self.stream.as_str().as_bytes());
        out.push(b' ');
        out.push(tag);
        out.push(b' ');
        out.extend_from_slice(line);
        out.push(b'\n');
    }
}

/// `time` in RFC 3339 UTC with all nine digits of its nanoseconds:
/// `2026-03-01T10:22:22.000000001Z` (a time before 1970 is written as 1970's start).
pub fn rfc3339_nanos(time: SystemTime) -> String {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, day_secs) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        day_secs / 3600,
        day_secs / 60 % 60,
        day_secs % 60,
        since.subsec_nanos()
    )
}

/// The proleptic Gregorian date `days` after 1970-01-01 (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// The smallest `--rotate` cap: each half holds a few of the largest writes.
pub const MIN_CAP: u64 = 1024 * 1024;

/// The log's cap and the descriptors its rotation uses (see the module docs).
#[derive(Debug)]
pub struct Rotation {
    /// The most bytes the log and its previous part hold together.
    pub max: u64,
    /// The log, opened for reading: what is copied into `previous`.
    pub read: OwnedFd,
    /// The previous part, opened for writing (not appending: it is written from its start).
    pub previous: OwnedFd,
}

/// `sbx-agent log STREAM FIFO [--rotate MAX READ_FD PREVIOUS_FD]`: see the module docs.
/// Returns the exit status and, for a failure, what to say.
pub fn run(args: &[String]) -> Result<(), String> {
    let usage =
        "usage: sbx-agent log stdout|stderr|console FIFO|- [--rotate MAX READ_FD PREVIOUS_FD]";
    let (stream, fifo, rotation) = match args {
        [stream, fifo] => (stream, fifo, None),
        [stream, fifo, flag, max, read, previous] if flag == "--rotate" => {
            (stream, fifo, Some(rotation_from(max, read, previous)?))
        }
        _ => return Err(usage.to_string()),
    };
    let Some(stream) = Stream::parse(stream) else {
        return Err(format!("{usage} (not {stream:?})"));
    };
    let mut mask = SigSet::empty();
    for sig in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGUSR1] {
        mask.add(sig);
    }
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&mask), None)
        .map_err(|e| format!("blocking signals: {e}"))?;
    let mut drain_mask = SigSet::empty();
    drain_mask.add(Signal::SIGUSR1);
    let signals = SignalFd::with_flags(&drain_mask, SfdFlags::SFD_CLOEXEC)
        .map_err(|e| format!("a signalfd for SIGUSR1: {e}"))?;
    // `-`: the logger's stdin (a vm's console: a pipe the driver made, which the logger,
    // another user, could not open by a path).
    let input = if fifo == "-" {
        std::io::stdin()
            .as_fd()
            .try_clone_to_owned()
            .map(File::from)
            .map_err(|e| format!("stdin: {e}"))?
    } else {
        open_fifo(Path::new(fifo)).map_err(|e| format!("opening {fifo}: {e}"))?
    };
    let output = std::io::stdout();
    pump(stream, &input, &signals, &mut |records| match &rotation {
        None => write_whole(output.as_fd(), records),
        Some(rotation) => write_capped(output.as_fd(), rotation, records),
    });
    Ok(())
}

/// `--rotate`'s arguments, checked: a cap of at least [`MIN_CAP`], two open descriptors above
/// stdio (made close-on-exec).
#[allow(unsafe_code)]
fn rotation_from(max: &str, read: &str, previous: &str) -> Result<Rotation, String> {
    let max: u64 = max
        .parse()
        .ok()
        .filter(|&m| m >= MIN_CAP)
        .ok_or_else(|| format!("--rotate {max:?}: not a number of bytes >= {MIN_CAP}"))?;
    let fd = |n: &str| -> Result<OwnedFd, String> {
        let fd: i32 = n
            .parse()
            .ok()
            .filter(|&fd| fd > 2)
            .ok_or_else(|| format!("--rotate: {n:?} is not a descriptor above 2"))?;
        // SAFETY: the descriptor is handed to this process for this purpose; fstat proves it
        // open before it is owned, and nothing else in the logger opens or closes it.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        rustix::fs::fstat(borrowed).map_err(|e| format!("--rotate: descriptor {fd}: {e}"))?;
        rustix::io::fcntl_setfd(borrowed, rustix::io::FdFlags::CLOEXEC)
            .map_err(|e| format!("--rotate: descriptor {fd}: {e}"))?;
        // SAFETY: as above.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    };
    Ok(Rotation {
        max,
        read: fd(read)?,
        previous: fd(previous)?,
    })
}

/// [`write_whole`], within the cap: under the lock both loggers take on the previous part,
/// the log is rotated first when `records` would take it past half the cap.
fn write_capped(log: BorrowedFd<'_>, rotation: &Rotation, records: &[u8]) {
    if records.is_empty() {
        return;
    }
    let locked = lock(&rotation.previous, true);
    if let Ok(stat) = rustix::fs::fstat(log) {
        let size = stat.st_size.max(0) as u64;
        if size > 0 && size + records.len() as u64 > rotation.max / 2 {
            // A rotation that fails leaves the log as it was, and it grows: what the disk
            // refused, nothing better can be done with here than to write on.
            let _ = rotate(log, rotation, size);
        }
    }
    write_whole(log, records);
    if locked {
        lock(&rotation.previous, false);
    }
}

/// Takes (`take`) or lets go of a POSIX write lock on all of `file`, waiting for it; whether
/// it was taken.
fn lock(file: &OwnedFd, take: bool) -> bool {
    use nix::fcntl::{FcntlArg, fcntl};
    let mut how: nix::libc::flock = whole_file();
    how.l_type = if take {
        nix::libc::F_WRLCK as i16
    } else {
        nix::libc::F_UNLCK as i16
    };
    how.l_whence = nix::libc::SEEK_SET as i16;
    loop {
        match fcntl(file, FcntlArg::F_SETLKW(&how)) {
            Ok(_) => return true,
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return false,
        }
    }
}

/// A lock request for the whole file (from its start to its end, whatever it grows to), its
/// type still to be set.
fn whole_file() -> nix::libc::flock {
    nix::libc::flock {
        l_type: 0,
        l_whence: 0,
        l_start: 0,
        l_len: 0,
        l_pid: 0,
    }
}

/// The log's first `size` bytes become the previous part, and the log is emptied.
fn rotate(log: BorrowedFd<'_>, rotation: &Rotation, size: u64) -> std::io::Result<()> {
    rustix::fs::ftruncate(&rotation.previous, 0)?;
    copy_range(&rotation.read, &rotation.previous, size)?;
    rustix::fs::ftruncate(log, 0)?;
    Ok(())
}

/// Copies `from`'s first `len` bytes to the start of `to`: in the kernel where it can
/// (`copy_file_range`), by reads and writes where it cannot.
fn copy_range(from: &OwnedFd, to: &OwnedFd, len: u64) -> std::io::Result<()> {
    let (mut read_at, mut write_at) = (0u64, 0u64);
    while read_at < len {
        let want = (len - read_at).min(1 << 30) as usize;
        match rustix::fs::copy_file_range(from, Some(&mut read_at), to, Some(&mut write_at), want) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => {}
            Err(
                rustix::io::Errno::XDEV
                | rustix::io::Errno::INVAL
                | rustix::io::Errno::NOSYS
                | rustix::io::Errno::OPNOTSUPP,
            ) => break,
            Err(e) => return Err(e.into()),
        }
    }
    let mut buf = vec![0u8; READ_SIZE];
    while read_at < len {
        let want = ((len - read_at) as usize).min(buf.len());
        let n = rustix::io::pread(from, &mut buf[..want], read_at)?;
        if n == 0 {
            break;
        }
        let mut piece = &buf[..n];
        while !piece.is_empty() {
            let wrote = rustix::io::pwrite(to, piece, write_at)?;
            piece = &piece[wrote..];
            write_at += wrote as u64;
        }
        read_at += n as u64;
    }
    Ok(())
}

/// The read end of `fifo`, opened without waiting for a writer. A blocking open would wait
/// for the main process's open of its end, with SIGUSR1 blocked: a main process that never
/// opens it (a stop's SIGTERM ends it first) would leave the logger waiting in `open` for
/// ever, the init waiting for the logger, and the stop waiting out its whole grace period.
/// Reads wait (the flag is cleared once open) and come only after [`pump`]'s `poll`, which
/// reports nothing for a FIFO no writer has opened yet: no end is read before a writer came.
fn open_fifo(fifo: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let input = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(fifo)?;
    rustix::fs::fcntl_setfl(&input, rustix::fs::OFlags::empty())?;
    Ok(input)
}

/// Reads `input` into records written by `write` until its end, or until `signals` is
/// readable (then drains what is buffered first).
fn pump(stream: Stream, mut input: &File, signals: &SignalFd, write: &mut dyn FnMut(&[u8])) {
    let mut recorder = Recorder::new(stream);
    let mut buf = vec![0u8; READ_SIZE];
    let mut out = Vec::with_capacity(READ_SIZE + 4096);
    let wait = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: i64::from(PARTIAL_WAIT.subsec_nanos()),
    };
    loop {
        let mut fds = [
            PollFd::new(&input, PollFlags::IN),
            PollFd::new(signals, PollFlags::IN),
        ];
        let timeout = recorder.has_pending().then_some(&wait);
        match poll(&mut fds, timeout) {
            Ok(0) => {
                recorder.flush(SystemTime::now(), &mut out);
            }
            Ok(_) => {
                let drain = !fds[1].revents().is_empty();
                let readable = !fds[0].revents().is_empty();
                if drain {
                    drain_input(&mut recorder, input, &mut buf, &mut out);
                    recorder.flush(SystemTime::now(), &mut out);
                    write(&out);
                    return;
                }
                if readable {
                    match input.read(&mut buf) {
                        Ok(0) => {
                            recorder.flush(SystemTime::now(), &mut out);
                            write(&out);
                            return;
                        }
                        Ok(n) => recorder.push(&buf[..n], SystemTime::now(), &mut out),
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => {
                            recorder.flush(SystemTime::now(), &mut out);
                            write(&out);
                            return;
                        }
                    }
                }
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => {
                recorder.flush(SystemTime::now(), &mut out);
                write(&out);
                return;
            }
        }
        if !out.is_empty() {
            write(&out);
            out.clear();
        }
    }
}

/// What the FIFO holds now, read without waiting (at most [`DRAIN_LIMIT`]), into `out`.
fn drain_input(recorder: &mut Recorder, mut input: &File, buf: &mut [u8], out: &mut Vec<u8>) {
    if rustix::fs::fcntl_setfl(input, rustix::fs::OFlags::NONBLOCK).is_err() {
        return;
    }
    let mut drained = 0;
    while drained < DRAIN_LIMIT {
        match input.read(buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                drained += n;
                recorder.push(&buf[..n], SystemTime::now(), out);
            }
        }
    }
}

/// Writes `records` to `fd` whole, each `write()` at most about [`READ_SIZE`] and ending at a
/// record's end; a failed write drops the rest (see the module docs).
fn write_whole(fd: BorrowedFd<'_>, records: &[u8]) {
    let mut rest = records;
    while !rest.is_empty() {
        let cut = batch_end(rest);
        let mut piece = &rest[..cut];
        while !piece.is_empty() {
            match rustix::io::write(fd, piece) {
                Ok(0) | Err(rustix::io::Errno::PIPE) => return,
                Ok(n) => piece = &piece[n..],
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => return,
            }
        }
        rest = &rest[cut..];
    }
}

/// Where the first write of `records` ends: after the last whole record within
/// [`READ_SIZE`], or after the first record when that one is longer.
fn batch_end(records: &[u8]) -> usize {
    if records.len() <= READ_SIZE {
        return records.len();
    }
    let window = &records[..READ_SIZE];
    match window.iter().rposition(|&b| b == b'\n') {
        Some(i) => i + 1,
        None => records
            .iter()
            .position(|&b| b == b'\n')
            .map_or(records.len(), |i| i + 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64, nanos: u32) -> SystemTime {
        UNIX_EPOCH + Duration::new(secs, nanos)
    }

    fn records(stream: Stream, pieces: &[&[u8]]) -> Vec<u8> {
        let mut recorder = Recorder::new(stream);
        let mut out = Vec::new();
        for piece in pieces {
            recorder.push(piece, at(0, 5), &mut out);
        }
        recorder.flush(at(0, 5), &mut out);
        out
    }

    const T0: &str = "1970-01-01T00:00:00.000000005Z";

    #[test]
    fn times_are_rfc3339_utc_with_nine_digits() {
        let cases = [
            (at(0, 0), "1970-01-01T00:00:00.000000000Z"),
            // A leap day of a century's leap year, its last second, and the day after.
            (
                at(951_868_799, 123_456_789),
                "2000-02-29T23:59:59.123456789Z",
            ),
            (at(951_868_800, 0), "2000-03-01T00:00:00.000000000Z"),
            // 2100 is no leap year: Feb 28 is followed by Mar 1.
            (at(4_107_542_400, 1), "2100-03-01T00:00:00.000000001Z"),
            (at(1_767_225_600, 0), "2026-01-01T00:00:00.000000000Z"),
            (
                UNIX_EPOCH - Duration::from_secs(5),
                "1970-01-01T00:00:00.000000000Z",
            ),
        ];
        for (time, want) in cases {
            assert_eq!(rfc3339_nanos(time), want, "{time:?}");
        }
    }

    #[test]
    fn whole_lines_are_full_records_of_their_stream() {
        let out = records(Stream::Stdout, &[b"one\ntwo\n\n"]);
        let want = format!("{T0} stdout F one\n{T0} stdout F two\n{T0} stdout F \n");
        assert_eq!(String::from_utf8(out).unwrap(), want);
        let out = records(Stream::Stderr, &[b"oops\n"]);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("{T0} stderr F oops\n")
        );
    }

    #[test]
    fn a_line_in_pieces_is_one_record_once_it_ends() {
        let out = records(Stream::Stdout, &[b"hel", b"lo\nwor", b"ld\n"]);
        let want = format!("{T0} stdout F hello\n{T0} stdout F world\n");
        assert_eq!(String::from_utf8(out).unwrap(), want);
    }

    #[test]
    fn an_unended_line_is_a_partial_record_when_flushed() {
        let mut recorder = Recorder::new(Stream::Stdout);
        let mut out = Vec::new();
        recorder.push(b"done\nprompt> ", at(0, 5), &mut out);
        assert!(recorder.has_pending());
        assert_eq!(
            String::from_utf8(out.clone()).unwrap(),
            format!("{T0} stdout F done\n")
        );
        recorder.flush(at(0, 5), &mut out);
        assert!(!recorder.has_pending());
        recorder.push(b"yes\n", at(0, 5), &mut out);
        let want = format!("{T0} stdout F done\n{T0} stdout P prompt> \n{T0} stdout F yes\n");
        assert_eq!(String::from_utf8(out).unwrap(), want);
        // Nothing held: a flush writes nothing.
        let mut more = Vec::new();
        recorder.flush(at(0, 5), &mut more);
        assert!(more.is_empty());
    }

    #[test]
    fn a_long_line_is_cut_at_16_kib() {
        let line = vec![b'x'; 2 * MAX_RECORD + 10];
        let mut data = line.clone();
        data.push(b'\n');
        let out = records(Stream::Stdout, &[&data]);
        let lines: Vec<&[u8]> = out.split(|&b| b == b'\n').collect();
        assert_eq!(lines.len(), 4, "three records and the end");
        let prefix = |tag: &str| format!("{T0} stdout {tag} ").into_bytes();
        for (record, (tag, len)) in
            lines
                .iter()
                .zip([("P", MAX_RECORD), ("P", MAX_RECORD), ("F", 10)])
        {
            let (head, body) = record.split_at(prefix(tag).len());
            assert_eq!(head, prefix(tag).as_slice());
            assert_eq!(body.len(), len);
            assert!(body.iter().all(|&b| b == b'x'));
        }
        // Unended and as long: cut as it arrives, without waiting for a flush.
        let mut recorder = Recorder::new(Stream::Stderr);
        let mut out = Vec::new();
        recorder.push(&line[..MAX_RECORD + 3], at(0, 5), &mut out);
        assert_eq!(out.len(), prefix("P").len() + MAX_RECORD + 1);
        assert!(recorder.has_pending());
    }

    #[test]
    fn any_byte_but_a_newline_is_kept_as_it_is() {
        let data: Vec<u8> = (0u8..=255).filter(|&b| b != b'\n').collect();
        let mut input = data.clone();
        input.push(b'\n');
        let out = records(Stream::Stdout, &[&input]);
        let prefix = format!("{T0} stdout F ").into_bytes();
        assert_eq!(&out[..prefix.len()], prefix.as_slice());
        assert_eq!(&out[prefix.len()..out.len() - 1], data.as_slice());
        assert_eq!(out.last(), Some(&b'\n'));
    }

    #[test]
    fn a_console_is_written_as_it_comes() {
        let mut recorder = Recorder::new(Stream::Console);
        let mut out = Vec::new();
        recorder.push(
            b"[ 0.1] kernel\r\nsbx-guest: r ready\npartial",
            at(1, 0),
            &mut out,
        );
        assert!(!recorder.has_pending());
        recorder.flush(at(2, 0), &mut out);
        assert_eq!(out, b"[ 0.1] kernel\r\nsbx-guest: r ready\npartial");
        assert_eq!(Stream::parse("console"), Some(Stream::Console));
    }

    #[test]
    fn writes_end_at_records() {
        let small = b"a\nb\n";
        assert_eq!(batch_end(small), small.len());
        let mut many = Vec::new();
        while many.len() < READ_SIZE + 100 {
            many.extend_from_slice(b"0123456789\n");
        }
        let cut = batch_end(&many);
        assert!(cut <= READ_SIZE && many[cut - 1] == b'\n', "{cut}");
        let mut one = vec![b'x'; READ_SIZE + 5];
        one.push(b'\n');
        one.extend_from_slice(b"y\n");
        assert_eq!(batch_end(&one), READ_SIZE + 6);
    }

    #[test]
    fn the_logger_records_a_fifo_to_its_end_and_drains_on_sigusr1() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("out");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // The writer end is opened read-write, so opening the read end does not wait.
        let writer = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&fifo)
            .unwrap();
        let input = File::open(&fifo).unwrap();
        let mut mask = SigSet::empty();
        mask.add(Signal::SIGUSR1);
        // Blocked in this test's thread only (the harness runs others beside it).
        mask.thread_block().unwrap();
        let signals = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC).unwrap();
        use std::io::Write;
        (&writer).write_all(b"first\nsecond, unended").unwrap();
        let mut written = Vec::new();
        // The writer stays open (as a background process would hold it): only SIGUSR1 ends
        // it. raise() signals this thread, which has it blocked: pending, read by the signalfd.
        nix::sys::signal::raise(Signal::SIGUSR1).unwrap();
        let started = std::time::Instant::now();
        pump(Stream::Stderr, &input, &signals, &mut |r| {
            written.extend_from_slice(r)
        });
        assert!(started.elapsed() < Duration::from_secs(2));
        let text = String::from_utf8(written).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text:?}");
        assert!(lines[0].ends_with(" stderr F first"), "{text:?}");
        assert!(lines[1].ends_with(" stderr P second, unended"), "{text:?}");
        drop(writer);
    }

    #[test]
    fn a_logger_opens_before_its_writer_and_waits_for_it() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("out");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // No writer: a blocking open would not return (and with SIGUSR1 blocked, nothing
        // would end the wait).
        let (opened, rx) = std::sync::mpsc::channel();
        let path = fifo.clone();
        std::thread::spawn(move || {
            let _ = opened.send(open_fifo(&path).map_err(|e| e.to_string()));
        });
        let input = match rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Ok(input)) => input,
            other => panic!("the read end of a FIFO without a writer did not open: {other:?}"),
        };
        let mut mask = SigSet::empty();
        mask.add(Signal::SIGUSR2);
        let signals = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC).unwrap();
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut written = Vec::new();
            pump(Stream::Stdout, &input, &signals, &mut |r| {
                written.extend_from_slice(r)
            });
            let _ = done.send(String::from_utf8_lossy(&written).to_string());
        });
        // A FIFO no writer has opened yet is not at its end: the logger waits…
        assert!(
            finished.recv_timeout(Duration::from_millis(300)).is_err(),
            "the logger took a FIFO without a writer for its end"
        );
        // …records what the writer sends once it comes, and ends when it closes.
        {
            use std::io::Write;
            let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
            w.write_all(b"late\n").unwrap();
        }
        let text = finished.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(text.ends_with(" stdout F late\n"), "{text:?}");
    }

    /// Many writes through the cap: the log and its previous part never hold more than the
    /// cap (and the one write that crossed it), the previous part is a whole earlier piece of
    /// the log, and the two together end with the newest records, none cut.
    #[test]
    fn a_capped_log_keeps_its_newest_records_within_the_cap() {
        let tmp = tempfile::tempdir().unwrap();
        let (log_path, prev_path) = (tmp.path().join("log"), tmp.path().join("log.1"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap();
        let rotation = Rotation {
            max: MIN_CAP,
            read: File::open(&log_path).unwrap().into(),
            previous: std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&prev_path)
                .unwrap()
                .into(),
        };
        let mut recorder = Recorder::new(Stream::Stdout);
        let mut largest = 0;
        for i in 0..40_000u32 {
            let mut out = Vec::new();
            recorder.push(format!("line {i:08}\n").as_bytes(), at(0, 5), &mut out);
            largest = largest.max(out.len() as u64);
            write_capped(log.as_fd(), &rotation, &out);
            let on_disk = std::fs::metadata(&log_path).unwrap().len()
                + std::fs::metadata(&prev_path).unwrap().len();
            assert!(
                on_disk <= MIN_CAP + largest,
                "{on_disk} bytes after line {i}"
            );
        }
        let previous = std::fs::read_to_string(&prev_path).unwrap();
        let current = std::fs::read_to_string(&log_path).unwrap();
        assert!(
            !previous.is_empty(),
            "40,000 lines of ~45 bytes never rotated"
        );
        let numbers: Vec<u32> = previous
            .lines()
            .chain(current.lines())
            .map(|l| {
                let (head, n) = l.rsplit_once(' ').unwrap();
                assert_eq!(head, format!("{T0} stdout F line"), "a cut record: {l:?}");
                n.parse().unwrap()
            })
            .collect();
        assert_eq!(numbers.last(), Some(&39_999));
        assert!(
            numbers.windows(2).all(|w| w[1] == w[0] + 1),
            "the kept records are not one run of the newest"
        );
        assert!(
            numbers.len() as u64 * largest >= MIN_CAP / 2,
            "{} kept",
            numbers.len()
        );
    }

    #[test]
    fn a_cap_below_the_minimum_or_a_bad_descriptor_is_refused() {
        for (max, read, prev) in [("1000", "3", "4"), ("x", "3", "4"), ("2097152", "1", "4")] {
            let err = rotation_from(max, read, prev).unwrap_err();
            assert!(err.starts_with("--rotate"), "{err}");
        }
    }

    #[test]
    fn the_logger_ends_when_every_writer_closed() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("out");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let path = fifo.clone();
        let writer = std::thread::spawn(move || {
            use std::io::Write;
            let mut w = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            w.write_all(b"a\n").unwrap();
            std::thread::sleep(Duration::from_millis(250));
            // Unended for longer than PARTIAL_WAIT: written as a P record before this ends it.
            w.write_all(b"b").unwrap();
            std::thread::sleep(Duration::from_millis(250));
            w.write_all(b"c\n").unwrap();
        });
        let input = File::open(&fifo).unwrap();
        let mut mask = SigSet::empty();
        mask.add(Signal::SIGUSR2);
        let signals = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC).unwrap();
        let mut written = Vec::new();
        pump(Stream::Stdout, &input, &signals, &mut |r| {
            written.extend_from_slice(r)
        });
        writer.join().unwrap();
        let text = String::from_utf8(written).unwrap();
        let tags: Vec<&str> = text.lines().map(|l| l.split_once(' ').unwrap().1).collect();
        assert_eq!(tags, ["stdout F a", "stdout P b", "stdout F c"], "{text:?}");
    }
}

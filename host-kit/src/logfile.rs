//! A sandbox's log file, appended to by its workload's loggers (or its VM's console): the last
//! lines of it, and what was appended since an offset. Shared by the drivers that log to a file.
//!
//! The oci and process sandboxes' loggers (`sbx-agent log`, see the agent's `log` module) write
//! records in the CRI log format, one per line: `<RFC 3339 time> <stdout|stderr> <F|P> <bytes>`,
//! `F` for a full line (the record's newline is the line's), `P` for a part of one. Anything
//! else in the file is a *raw* line: what a sandbox's init says itself (`command not found:
//! NAME`), the whole log of a sandbox started before the loggers, a vm's console. A raw line is
//! stdout with no time; with `since` set it is skipped (it cannot be placed in time). A raw
//! line that happens to read like a record is taken for one. [`Entry`] is either, parsed; the
//! reader hands the workload's bytes on without the record prefix, so a plain `logs` shows
//! what the workload wrote, as it did before the records.
//!
//! The two streams' loggers write to the file independently: lines of stdout and stderr
//! written within a few microseconds of each other may be in the file (and so come out) in
//! the other order; each stream's own order is kept.
//!
//! **The cap.** The loggers keep a log and its previous part (`<log>.1`) within the driver's
//! `log_max` together (the agent's `log` module: the log is copied into the previous part and
//! emptied before it passes half of it). So a reader that finds the log shorter than where it
//! last read reads the rest from the previous part, then the log from its start; the tail of
//! a log starts in the previous part when the log alone is short. A follower keeps the bytes
//! it read just before its offset ([`Place`]) and reads on only from a file that holds them
//! there, in the same read: so it tells a rotation after which the log grew back past where
//! it read (no length can), and one under way, by what the files hold; it never reads a byte
//! twice or out of order, and skips only when the log was rotated twice between two of its
//! reads (then it says so, and reads on from a file's start).

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sbx_proto::Timestamp;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use sbx_driver_api::{DriverError, DriverStream, pb};

/// The most a sandbox's log and its previous part keep on disk, unless the driver is told
/// otherwise (`sbxd serve --log-max`).
pub const DEFAULT_LOG_MAX: u64 = 10 * 1024 * 1024;

/// The largest piece read at once when following a log, and the largest chunk sent.
pub const CHUNK: usize = 64 * 1024;
/// The most of a log `tail` reads back from the end of the file.
const TAIL_WINDOW: u64 = 8 * 1024 * 1024;

/// One record of the log, or one raw line (or the part of one written so far).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// When it was logged; `None` for a raw line.
    pub time: Option<Timestamp>,
    pub stream: pb::LogStream,
    /// The workload's bytes: a full record's line with its newline, a partial one's without.
    pub data: Vec<u8>,
    /// Whether `data` ends a line of the workload (`F`, or a raw line with its newline).
    pub ends_line: bool,
}

impl Entry {
    /// A raw line (or part of one): stdout, no time.
    pub fn raw(data: &[u8]) -> Entry {
        Entry {
            time: None,
            stream: pb::LogStream::Stdout,
            data: data.to_vec(),
            ends_line: data.ends_with(b"\n"),
        }
    }
}

/// What a `Logs` call asks of the log, besides the sandbox.
#[derive(Debug, Clone, Default)]
pub struct LogQuery {
    pub tail_lines: u32,
    pub follow: bool,
    pub timestamps: bool,
    pub since: Option<Timestamp>,
}

impl From<&pb::LogsRequest> for LogQuery {
    fn from(req: &pb::LogsRequest) -> LogQuery {
        LogQuery {
            tail_lines: req.tail_lines,
            follow: req.follow,
            timestamps: req.timestamps,
            since: req.since,
        }
    }
}

impl LogQuery {
    /// Whether `entry` is kept by `since`.
    pub fn admits(&self, entry: &Entry) -> bool {
        match (&self.since, &entry.time) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(since), Some(time)) => (time.seconds, time.nanos) >= (since.seconds, since.nanos),
        }
    }

    /// The chunks `entries` are sent as, after `since`: with `timestamps`, one per entry (a raw
    /// line longer than [`CHUNK`] in pieces); without, consecutive entries of one stream
    /// together, up to [`CHUNK`] bytes, each chunk with its first entry's time.
    pub fn chunks(&self, entries: Vec<Entry>) -> Vec<pb::LogChunk> {
        let mut chunks: Vec<pb::LogChunk> = Vec::new();
        for entry in entries.into_iter().filter(|e| self.admits(e)) {
            let stream = entry.stream as i32;
            if !self.timestamps
                && let Some(last) = chunks.last_mut()
                && last.stream == stream
                && last.data.len() + entry.data.len() <= CHUNK
            {
                last.data.extend_from_slice(&entry.data);
                continue;
            }
            for piece in entry.data.chunks(CHUNK) {
                chunks.push(pb::LogChunk {
                    data: piece.to_vec(),
                    stream,
                    time: entry.time,
                });
            }
        }
        chunks
    }
}

/// One line of the log file (with its newline, or the last one without) as an [`Entry`].
pub fn parse_line(line: &[u8]) -> Entry {
    parse_record(line).unwrap_or_else(|| Entry::raw(line))
}

/// A record `<time> <stdout|stderr> <F|P> <bytes>`, or `None` when `line` is not one.
fn parse_record(line: &[u8]) -> Option<Entry> {
    let body = line.strip_suffix(b"\n").unwrap_or(line);
    let mut fields = body.splitn(4, |&b| b == b' ');
    let time = fields.next()?;
    // An RFC 3339 time with its clock: `2026-03-01T10:22:22Z` at the shortest.
    if time.len() < 20 || !time[0].is_ascii_digit() || time.get(10) != Some(&b'T') {
        return None;
    }
    let time: Timestamp = std::str::from_utf8(time).ok()?.parse().ok()?;
    let stream = match fields.next()? {
        b"stdout" => pb::LogStream::Stdout,
        b"stderr" => pb::LogStream::Stderr,
        _ => return None,
    };
    let full = match fields.next()? {
        b"F" => true,
        b"P" => false,
        _ => return None,
    };
    let mut data = fields.next().unwrap_or_default().to_vec();
    if full {
        data.push(b'\n');
    }
    Some(Entry {
        time: Some(time),
        stream,
        data,
        ends_line: full,
    })
}

/// Whether `start`, a line not ended yet, may be the start of a record being written (a
/// record is written whole, so its end follows at once): then it is held for its newline.
fn may_be_record(start: &[u8]) -> bool {
    const SHAPE: &[u8] = b"0000-00-00T00:00:00";
    start.iter().zip(SHAPE).all(|(&b, &s)| {
        if s == b'0' {
            b.is_ascii_digit()
        } else {
            b == s
        }
    })
}

/// Parses a log as it is appended: whole lines at once, an unended raw line when asked.
#[derive(Debug, Default)]
pub struct LogParser {
    /// The unended line so far.
    pending: Vec<u8>,
    /// A raw line was begun (its start handed out unended): its rest is raw too.
    raw_open: bool,
}

impl LogParser {
    /// The entries the lines `data` completes; an unended rest is kept.
    pub fn push(&mut self, data: &[u8]) -> Vec<Entry> {
        let mut entries = Vec::new();
        let mut rest = data;
        while let Some(newline) = rest.iter().position(|&b| b == b'\n') {
            let (line, after) = rest.split_at(newline + 1);
            self.pending.extend_from_slice(line);
            let whole = std::mem::take(&mut self.pending);
            entries.push(if std::mem::take(&mut self.raw_open) {
                Entry::raw(&whole)
            } else {
                parse_line(&whole)
            });
            rest = after;
        }
        self.pending.extend_from_slice(rest);
        entries
    }

    /// The unended line, when nothing more came for it: a raw line's start is handed out (a
    /// console prompt must be seen); a record's start is kept for its end unless `last`.
    pub fn flush(&mut self, last: bool) -> Option<Entry> {
        if self.pending.is_empty() || (!last && !self.raw_open && may_be_record(&self.pending)) {
            return None;
        }
        let rest = std::mem::take(&mut self.pending);
        if self.raw_open {
            return Some(Entry::raw(&rest));
        }
        self.raw_open = !last;
        Some(if last {
            parse_line(&rest)
        } else {
            Entry::raw(&rest)
        })
    }
}

/// The part of `data` from its second line on: the first is cut when `data` starts inside
/// the file.
fn after_first_line(data: &[u8]) -> &[u8] {
    data.iter()
        .position(|&b| b == b'\n')
        .map_or(&data[data.len()..], |i| &data[i + 1..])
}

/// Every entry of `data`, a whole log or the end of one.
fn parse_all(data: &[u8]) -> Vec<Entry> {
    let mut parser = LogParser::default();
    let mut entries = parser.push(data);
    entries.extend(parser.flush(true));
    entries
}

/// Where the part of `log` before its last rotation is kept: `<log>.1`.
pub fn previous_path(log: &Path) -> PathBuf {
    let mut name = log.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// What the loggers rotate `log` with: the log opened for reading only and its previous part
/// opened for writing (never truncated here), both made if missing, host root's (0600). The
/// directory is host root's, and a link there is never followed (`O_NOFOLLOW`).
pub fn rotation_files(log: &Path) -> std::io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use std::os::unix::fs::OpenOptionsExt;
    let nofollow = rustix::fs::OFlags::NOFOLLOW.bits() as i32;
    let writable = |path: &Path| {
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(nofollow)
            .open(path)
    };
    writable(log)?;
    let read = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nofollow)
        .open(log)?;
    Ok((read.into(), writable(&previous_path(log))?.into()))
}

/// The last `window` bytes of the log and its previous part together, as one piece (the part
/// first), and where a follower goes on (the log's end, and what it read of it). The log is read last; a rotation
/// between the two reads (the log then shorter than it was) is read again once.
fn read_window(log: &Path, window: u64) -> std::io::Result<(Vec<u8>, Place)> {
    let read_end = |path: &Path, most: u64| -> std::io::Result<(Vec<u8>, u64)> {
        let mut file = match std::fs::File::open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
            Err(e) => return Err(e),
        };
        let len = file.metadata()?.len();
        let start = len.saturating_sub(most);
        file.seek(SeekFrom::Start(start))?;
        let mut data = Vec::new();
        file.by_ref().take(len - start).read_to_end(&mut data)?;
        Ok((data, start))
    };
    let mut attempt = 0;
    loop {
        let before = std::fs::metadata(log).map(|m| m.len()).unwrap_or(0);
        let (previous, previous_start) = if before < window {
            read_end(&previous_path(log), window - before)?
        } else {
            (Vec::new(), 0)
        };
        let (current, start) = read_end(log, window)?;
        let end = start + current.len() as u64;
        attempt += 1;
        if end < before && attempt < 2 {
            continue;
        }
        // The part counts only when the log was read from its start.
        let (mut data, starts_inside) = if start == 0 && !previous.is_empty() {
            (previous, previous_start > 0)
        } else {
            (Vec::new(), start > 0)
        };
        data.extend_from_slice(&current);
        // Where the window starts inside a file, its first line is not whole.
        if starts_inside {
            data = after_first_line(&data).to_vec();
        }
        return Ok((data, Place::in_log(end, &current)));
    }
}

/// The entries of the log's last [`TAIL_WINDOW`] bytes (the window's first, cut line left
/// out), the parser that goes on from there, and the place it goes on from. When `follow`,
/// an unended last line that may be a record being written is left in the parser for its end.
fn read_past(log: &Path, follow: bool) -> std::io::Result<(Vec<Entry>, LogParser, Place)> {
    let mut parser = LogParser::default();
    let (window, place) = read_window(log, TAIL_WINDOW)?;
    let mut entries = parser.push(&window);
    entries.extend(parser.flush(!follow));
    Ok((entries, parser, place))
}

/// The last `lines` lines of the workload in `entries` (all when 0). A final line not ended
/// yet counts; a line in `P` parts is one.
pub fn tail_entries(entries: &[Entry], lines: u32) -> &[Entry] {
    if lines == 0 {
        return entries;
    }
    let mut starts = 0;
    for i in (1..entries.len()).rev() {
        if entries[i - 1].ends_line {
            starts += 1;
            if starts == lines {
                return &entries[i..];
            }
        }
    }
    entries
}

/// What was appended to the log since `offset`, the workload's bytes without the records'
/// prefixes, trimmed ("no output" when nothing was): what a failed launch said.
pub fn log_since(log: &Path, offset: u64) -> String {
    // At most the last 16 KiB of it: a launch that failed after a flood of output is told by
    // its end.
    const MAX: u64 = 16 * 1024;
    let text = std::fs::File::open(log)
        .and_then(|mut file| {
            let len = file.metadata()?.len();
            // A log rotated since `offset` was taken is read from its start.
            let from = if offset > len { 0 } else { offset };
            file.seek(SeekFrom::Start(from.max(len.saturating_sub(MAX))))?;
            let mut data = Vec::new();
            file.take(MAX).read_to_end(&mut data)?;
            Ok(data)
        })
        .unwrap_or_default();
    let said: Vec<u8> = parse_all(&text).into_iter().flat_map(|e| e.data).collect();
    let tail = String::from_utf8_lossy(&said).trim().to_string();
    if tail.is_empty() {
        "no output".to_string()
    } else {
        tail
    }
}

/// The most of the bytes before a follower's offset it keeps ([`Place`]): a whole record of
/// the longest line the loggers write (16 KiB, cut there) with its time stamp, so the bytes
/// are of one record stream and no other (each record's stamp is later than the last).
const TAIL_KEEP: usize = 16 * 1024 + 512;

/// Where a follower is in a log: the offset it has read to in the file it reads (the log, or
/// its previous part while it reads the rest of a log rotated under it) and the bytes it read
/// just before that offset. A file holds those bytes there only while it is still the file
/// that was read: the loggers' rotation (the log copied to the previous part, then emptied;
/// the agent's `log` module) is told by them, whatever the files' lengths say, and the
/// follower never reads a byte twice or out of order.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Place {
    offset: u64,
    tail: Vec<u8>,
    in_previous: bool,
}

impl Place {
    /// At `offset` of the log, `read` being what the log held just before it (its end counts).
    pub fn in_log(offset: u64, read: &[u8]) -> Place {
        let mut place = Place {
            offset: offset - (read.len() as u64).min(offset),
            ..Place::default()
        };
        place.advance(&read[read.len() - (read.len() as u64).min(offset) as usize..]);
        place
    }

    fn advance(&mut self, data: &[u8]) {
        self.offset += data.len() as u64;
        if data.len() >= TAIL_KEEP {
            self.tail = data[data.len() - TAIL_KEEP..].to_vec();
        } else {
            let keep = TAIL_KEEP - data.len();
            let drop = self.tail.len().saturating_sub(keep);
            self.tail.drain(..drop);
            self.tail.extend_from_slice(data);
        }
    }
}

/// What a follower at `place` reads next of `log` (at most `4 * CHUNK`), its place moved on,
/// and whether it skipped: the log was rotated more than once since its last read, and what
/// lay between is gone (its next bytes start a file). A log rotated once since is read on
/// from its previous part, then from its start.
pub fn follow_read(log: &Path, place: &mut Place) -> std::io::Result<(Vec<u8>, bool)> {
    let previous = previous_path(log);
    let from_start = |place: &mut Place, skipped: bool| -> std::io::Result<(Vec<u8>, bool)> {
        *place = Place::default();
        let data = read_verified(log, place)?.unwrap_or_default();
        place.advance(&data);
        Ok((data, skipped))
    };
    if place.in_previous {
        return match read_verified(&previous, place)? {
            Some(data) if !data.is_empty() => {
                place.advance(&data);
                Ok((data, false))
            }
            // Its end: the log from its start. Rotated once more: what the part held is gone.
            Some(_) => from_start(place, false),
            None => from_start(place, true),
        };
    }
    match read_verified(log, place)? {
        Some(data) => {
            place.advance(&data);
            Ok((data, false))
        }
        // The log is not the file that was read: its rest is in the previous part.
        None => match read_verified(&previous, place)? {
            Some(data) if !data.is_empty() => {
                place.in_previous = true;
                place.advance(&data);
                Ok((data, false))
            }
            Some(_) => from_start(place, false),
            None => from_start(place, true),
        },
    }
}

/// What `path` holds after `place` (at most `4 * CHUNK`), when it holds `place`'s tail just
/// before its offset (one read, so a rotation cannot come between the check and the bytes);
/// `None` when it does not (or is missing, or shorter).
fn read_verified(path: &Path, place: &Place) -> std::io::Result<Option<Vec<u8>>> {
    use std::os::unix::fs::FileExt;
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok((place.offset == 0).then(Vec::new));
        }
        Err(e) => return Err(e),
    };
    let kept = place.tail.len();
    let mut buf = vec![0u8; kept + 4 * CHUNK];
    let n = loop {
        match file.read_at(&mut buf, place.offset - kept as u64) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            other => break other?,
        }
    };
    if n < kept || buf[..kept] != place.tail[..] {
        return Ok(None);
    }
    buf.truncate(n);
    Ok(Some(buf.split_off(kept)))
}

/// The log as a stream, as `query` asks: its last `tail_lines` lines (all when 0) from
/// `since`, then, when `follow`, what is appended, polled every `interval`, until the receiver
/// goes away or `exists` says the sandbox is gone (after a last read).
pub fn log_stream(
    log: PathBuf,
    query: LogQuery,
    interval: Duration,
    exists: impl Fn() -> bool + Send + 'static,
) -> Result<DriverStream<pb::LogChunk>, DriverError> {
    use futures::StreamExt;
    let (entries, mut parser, mut place) = read_past(&log, query.follow)
        .map_err(|e| DriverError::Internal(format!("reading the log: {e}")))?;
    let admitted: Vec<Entry> = entries.into_iter().filter(|e| query.admits(e)).collect();
    let past = tail_entries(&admitted, query.tail_lines).to_vec();
    let chunks: Vec<Result<pb::LogChunk, DriverError>> =
        query.chunks(past).into_iter().map(Ok).collect();
    let past = futures::stream::iter(chunks);
    if !query.follow {
        return Ok(Box::pin(past));
    }
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let gone = !exists();
            let (entries, read) = match follow_read(&log, &mut place) {
                Ok((data, skipped)) if !data.is_empty() => {
                    // After a skip the next bytes start a file: the start of a line the
                    // parser holds lost its end with what was skipped, and goes with it.
                    if skipped {
                        parser = LogParser::default();
                    }
                    (parser.push(&data), true)
                }
                // Nothing more came: an unended line is told now (all of it when gone).
                Ok(_) => (parser.flush(gone).into_iter().collect(), false),
                Err(e) => {
                    let error = DriverError::Internal(format!("following the log: {e}"));
                    let _ = tx.send(Err(error)).await;
                    return;
                }
            };
            let told = !entries.is_empty();
            for chunk in query.chunks(entries) {
                if tx.send(Ok(chunk)).await.is_err() {
                    return;
                }
            }
            if read || told {
                continue;
            }
            if gone || tx.is_closed() {
                return;
            }
            tokio::time::sleep(interval).await;
        }
    });
    Ok(Box::pin(past.chain(ReceiverStream::new(rx))))
}

#[cfg(test)]
mod tests {
    use super::*;

    const T1: &str = "2026-03-01T10:00:01.000000001Z";
    const T2: &str = "2026-03-01T10:00:02.5Z";

    fn at(seconds: i64, nanos: i32) -> Option<Timestamp> {
        Some(Timestamp { seconds, nanos })
    }

    /// 2026-03-01T10:00:00Z
    const BASE: i64 = 1_772_359_200;

    fn text(entries: &[Entry]) -> String {
        let bytes: Vec<u8> = entries.iter().flat_map(|e| e.data.clone()).collect();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn records_and_raw_lines_are_told_apart() {
        let log = format!(
            "{T1} stdout F out1\n{T1} stderr F err1\ncommand not found: x\n{T2} stdout P half \n\
             {T2} stdout F \n{T2} stdout F rest\n2026-03-01 not a record\n{T2} stdin F no\n\
             {T2} stdout X no\n{T2} stdout F\n"
        );
        let entries = parse_all(log.as_bytes());
        let want = [
            (at(BASE + 1, 1), pb::LogStream::Stdout, "out1\n", true),
            (at(BASE + 1, 1), pb::LogStream::Stderr, "err1\n", true),
            (None, pb::LogStream::Stdout, "command not found: x\n", true),
            (
                at(BASE + 2, 500_000_000),
                pb::LogStream::Stdout,
                "half ",
                false,
            ),
            // A full record's bytes may be empty: the line's end.
            (at(BASE + 2, 500_000_000), pb::LogStream::Stdout, "\n", true),
            (
                at(BASE + 2, 500_000_000),
                pb::LogStream::Stdout,
                "rest\n",
                true,
            ),
        ];
        assert_eq!(entries.len(), 10, "{entries:?}");
        for (entry, (time, stream, data, ends)) in entries.iter().zip(want) {
            assert_eq!(entry.time, time, "{entry:?}");
            assert_eq!(entry.stream, stream, "{entry:?}");
            assert_eq!(String::from_utf8_lossy(&entry.data), data, "{entry:?}");
            assert_eq!(entry.ends_line, ends, "{entry:?}");
        }
        // Not records (no time, an unknown stream, an unknown tag): raw lines, kept whole.
        for (entry, raw) in entries[6..9].iter().zip([
            "2026-03-01 not a record\n".to_string(),
            format!("{T2} stdin F no\n"),
            format!("{T2} stdout X no\n"),
        ]) {
            assert_eq!(*entry, Entry::raw(raw.as_bytes()));
        }
        // The tag with nothing after it: an empty full line, like `F ` with its space.
        assert_eq!(entries[9].data, b"\n");
        assert!(entries[9].time.is_some());
    }

    #[test]
    fn binary_bytes_in_a_record_come_back_as_they_were() {
        let bytes: Vec<u8> = (0u8..=255).filter(|&b| b != b'\n').collect();
        let mut line = format!("{T1} stderr F ").into_bytes();
        line.extend_from_slice(&bytes);
        line.push(b'\n');
        let entry = parse_line(&line);
        assert_eq!(entry.stream, pb::LogStream::Stderr);
        assert_eq!(&entry.data[..bytes.len()], bytes.as_slice());
        assert_eq!(entry.data.len(), bytes.len() + 1);
    }

    #[test]
    fn tails_count_the_workloads_lines() {
        let check = |log: &str, n: u32, want: &str| {
            let entries = parse_all(log.as_bytes());
            assert_eq!(text(tail_entries(&entries, n)), want, "{log:?} {n}");
        };
        check("a\nb\nc\n", 0, "a\nb\nc\n");
        check("a\nb\nc\n", 1, "c\n");
        check("a\nb\nc\n", 2, "b\nc\n");
        check("a\nb\nc\n", 3, "a\nb\nc\n");
        check("a\nb\nc\n", 9, "a\nb\nc\n");
        check("a\nb\nc", 1, "c");
        check("a\nb\nc", 2, "b\nc");
        check("", 2, "");
        check("\n\n", 1, "\n");
        // Records: a line in parts is one line; raw lines count as well.
        let log =
            format!("raw\n{T1} stdout P a\n{T1} stdout P b\n{T1} stdout F c\n{T2} stderr F e\n");
        check(&log, 1, "e\n");
        check(&log, 2, "abc\ne\n");
        check(&log, 3, "raw\nabc\ne\n");
    }

    #[test]
    fn since_skips_older_records_and_every_raw_line() {
        let log = format!("old raw\n{T1} stdout F one\n{T2} stderr F two\n");
        let entries = parse_all(log.as_bytes());
        let query = |since| LogQuery {
            since,
            timestamps: true,
            ..LogQuery::default()
        };
        let kept = |since| -> Vec<String> {
            query(since)
                .chunks(entries.clone())
                .into_iter()
                .map(|c| String::from_utf8(c.data).unwrap())
                .collect()
        };
        assert_eq!(kept(None), ["old raw\n", "one\n", "two\n"]);
        assert_eq!(kept(at(BASE + 1, 1)), ["one\n", "two\n"]);
        assert_eq!(kept(at(BASE + 1, 2)), ["two\n"]);
        assert_eq!(kept(at(BASE + 3, 0)), Vec::<String>::new());
    }

    #[test]
    fn chunks_keep_streams_and_times_apart() {
        let log = format!("{T1} stdout F a\n{T1} stdout F b\n{T2} stderr F c\nraw\n");
        let entries = parse_all(log.as_bytes());
        let timed = LogQuery {
            timestamps: true,
            ..LogQuery::default()
        }
        .chunks(entries.clone());
        let seen: Vec<_> = timed
            .iter()
            .map(|c| (c.stream, c.time, String::from_utf8(c.data.clone()).unwrap()))
            .collect();
        let (out, err) = (pb::LogStream::Stdout as i32, pb::LogStream::Stderr as i32);
        assert_eq!(
            seen,
            [
                (out, at(BASE + 1, 1), "a\n".to_string()),
                (out, at(BASE + 1, 1), "b\n".to_string()),
                (err, at(BASE + 2, 500_000_000), "c\n".to_string()),
                (out, None, "raw\n".to_string()),
            ]
        );
        // Without timestamps a stream's consecutive lines come together.
        let plain = LogQuery::default().chunks(entries);
        let seen: Vec<_> = plain
            .iter()
            .map(|c| (c.stream, String::from_utf8(c.data.clone()).unwrap()))
            .collect();
        assert_eq!(
            seen,
            [
                (out, "a\nb\n".to_string()),
                (err, "c\n".to_string()),
                (out, "raw\n".to_string()),
            ]
        );
    }

    #[test]
    fn an_unended_line_is_held_only_while_it_may_be_a_record() {
        let mut parser = LogParser::default();
        // A record being written: held, and whole once it ends.
        assert!(parser.push(b"2026-03-01T10:00:01.0Z std").is_empty());
        assert_eq!(parser.flush(false), None);
        let done = parser.push(b"out F x\n");
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].data, b"x\n");
        assert!(done[0].time.is_some());
        // A console prompt: told at once, and its rest raw too, whatever it looks like.
        assert!(parser.push(b"login: ").is_empty());
        assert_eq!(parser.flush(false), Some(Entry::raw(b"login: ")));
        assert_eq!(parser.flush(false), None);
        let rest = parser.push(format!("{T1} stdout F y\nz\n").as_bytes());
        assert_eq!(
            rest,
            [
                Entry::raw(format!("{T1} stdout F y\n").as_bytes()),
                Entry::raw(b"z\n")
            ]
        );
        // The last read of a log takes what is left either way.
        assert!(parser.push(b"2026-03-01T10:0").is_empty());
        assert_eq!(parser.flush(true), Some(Entry::raw(b"2026-03-01T10:0")));
    }

    #[test]
    fn what_a_log_said_since_an_offset() {
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("workload.log");
        assert_eq!(log_since(&log, 0), "no output");
        std::fs::write(&log, "old\n  boom: no such file \n").unwrap();
        assert_eq!(log_since(&log, 4), "boom: no such file");
        // An offset past the end: the log was rotated since; what it holds now was said since.
        assert_eq!(log_since(&log, 4000), "old\n  boom: no such file");
        // Records say their bytes, without their prefixes.
        let records = format!("old\n{T1} stderr F sh: boom\n{T2} stdout F after\n");
        std::fs::write(&log, records).unwrap();
        assert_eq!(log_since(&log, 4), "sh: boom\nafter");
    }

    /// `lines(from, to)`: records `line N` with stamps that differ (as the loggers' do).
    fn lines(from: u32, to: u32) -> String {
        (from..to)
            .map(|i| format!("2026-03-01T10:00:00.{i:09}Z stdout F line {i}\n"))
            .collect()
    }

    fn said(from: u32, to: u32) -> String {
        (from..to).map(|i| format!("line {i}\n")).collect()
    }

    /// A follower that read part of a log the loggers then rotated (its older part in
    /// `<log>.1`) reads the rest from the part, then the new log from its start — also when
    /// the log grew back past where it read, which its length cannot tell.
    #[test]
    fn a_follower_reads_across_a_rotation_even_when_the_log_grew_back() {
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("workload.log");
        std::fs::write(&log, lines(0, 4)).unwrap();
        let mut place = Place::default();
        let (data, skipped) = follow_read(&log, &mut place).unwrap();
        assert_eq!((text(&parse_all(&data)), skipped), (said(0, 4), false));
        // Rotated (lines 0-9 went to the part) and grown back past the follower's offset.
        std::fs::write(&log, lines(0, 10)).unwrap();
        std::fs::write(previous_path(&log), lines(0, 10)).unwrap();
        std::fs::write(&log, lines(10, 30)).unwrap();
        assert!(lines(10, 30).len() > lines(0, 4).len());
        let mut told = String::new();
        for _ in 0..4 {
            let (data, skipped) = follow_read(&log, &mut place).unwrap();
            assert!(!skipped);
            told.push_str(&text(&parse_all(&data)));
        }
        assert_eq!(told, said(4, 30));
        // At the end: nothing more, and it stays there.
        assert_eq!(follow_read(&log, &mut place).unwrap(), (Vec::new(), false));
        std::fs::write(&log, lines(10, 31)).unwrap();
        let (data, _) = follow_read(&log, &mut place).unwrap();
        assert_eq!(text(&parse_all(&data)), said(30, 31));
    }

    /// A log rotated twice between two reads: what lay between is gone; the follower says it
    /// skipped and reads on from the newest part, never a line again or out of order.
    #[test]
    fn a_follower_that_missed_two_rotations_skips_forward_only() {
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("workload.log");
        std::fs::write(&log, lines(0, 4)).unwrap();
        let mut place = Place::default();
        follow_read(&log, &mut place).unwrap();
        // Rotated twice: the part holds 10-19, the log 20-25; 4-9 are gone.
        std::fs::write(previous_path(&log), lines(10, 20)).unwrap();
        std::fs::write(&log, lines(20, 26)).unwrap();
        let (data, skipped) = follow_read(&log, &mut place).unwrap();
        assert!(skipped);
        assert_eq!(text(&parse_all(&data)), said(20, 26));
        // A follower reading the rest of a rotated log from the part, rotated again meanwhile.
        let mut place = Place::in_log(lines(0, 2).len() as u64, lines(0, 2).as_bytes());
        std::fs::write(previous_path(&log), lines(0, 4)).unwrap();
        std::fs::write(&log, lines(4, 6)).unwrap();
        let (data, skipped) = follow_read(&log, &mut place).unwrap();
        assert_eq!((text(&parse_all(&data)), skipped), (said(2, 4), false));
        std::fs::write(previous_path(&log), lines(4, 8)).unwrap();
        std::fs::write(&log, lines(8, 9)).unwrap();
        // The part it was reading was rotated away under it (4-7 are gone): on from the log.
        let (data, skipped) = follow_read(&log, &mut place).unwrap();
        assert_eq!((text(&parse_all(&data)), skipped), (said(8, 9), true));
    }

    #[test]
    fn tail_and_follow_read_across_a_rotation() {
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("workload.log");
        std::fs::write(previous_path(&log), lines(0, 10)).unwrap();
        std::fs::write(&log, lines(10, 12)).unwrap();
        let (entries, _, mut place) = read_past(&log, false).unwrap();
        assert_eq!(text(&entries), said(0, 12));
        assert_eq!(
            place,
            Place::in_log(lines(10, 12).len() as u64, lines(10, 12).as_bytes())
        );
        // Read to its end: nothing more, where it is.
        assert_eq!(follow_read(&log, &mut place).unwrap(), (Vec::new(), false));
        // A tail window that starts inside the part leaves out its first, cut line.
        let (window, _) = read_window(&log, 50 + lines(10, 12).len() as u64).unwrap();
        let told = text(&parse_all(&window));
        assert!(told.ends_with("line 9\nline 10\nline 11\n"), "{told:?}");
        assert!(
            told.lines().all(|l| l.starts_with("line ")),
            "a cut line: {told:?}"
        );
    }

    async fn next(
        stream: &mut DriverStream<pb::LogChunk>,
    ) -> Option<Result<pb::LogChunk, DriverError>> {
        use futures::StreamExt;
        tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .expect("a chunk within 5 s")
    }

    #[tokio::test]
    async fn a_stream_tails_then_follows_and_ends_with_the_sandbox() {
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("workload.log");
        std::fs::write(&log, format!("{T1} stdout F one\n{T1} stderr F two\n")).unwrap();
        let alive = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let exists = {
            let alive = alive.clone();
            move || alive.load(std::sync::atomic::Ordering::SeqCst)
        };
        let query = LogQuery {
            tail_lines: 1,
            follow: true,
            timestamps: true,
            since: None,
        };
        let mut stream = log_stream(log.clone(), query, Duration::from_millis(10), exists).unwrap();
        let first = next(&mut stream).await.unwrap().unwrap();
        assert_eq!((first.stream, first.data.as_slice()), (1, &b"two\n"[..]));
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        // A record written in two pieces comes as one; a raw unended line comes as it is.
        file.write_all(format!("{T2} stdout F thr").as_bytes())
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        file.write_all(b"ee\nprompt> ").unwrap();
        let third = next(&mut stream).await.unwrap().unwrap();
        assert_eq!(third.data, b"three\n");
        assert_eq!(third.time, at(BASE + 2, 500_000_000));
        let prompt = next(&mut stream).await.unwrap().unwrap();
        assert_eq!(
            (prompt.data.as_slice(), prompt.time),
            (&b"prompt> "[..], None)
        );
        alive.store(false, std::sync::atomic::Ordering::SeqCst);
        assert!(
            next(&mut stream).await.is_none(),
            "the stream ends with the sandbox"
        );
    }
}

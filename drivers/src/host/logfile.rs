//! A sandbox's log file, appended to by its workload (or its VM's console): the last lines of
//! it, and what was appended since an offset. Shared by the drivers that log to a file.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::{DriverError, DriverStream, pb};

/// The largest piece read at once when following a log.
pub(crate) const CHUNK: usize = 64 * 1024;
/// The most of a log `tail` reads back from the end of the file.
const TAIL_WINDOW: u64 = 8 * 1024 * 1024;

/// The last `lines` lines of the log (all of it when 0, at most [`TAIL_WINDOW`] bytes), and
/// the offset where following continues.
pub(crate) fn read_tail(log: &Path, lines: u32) -> std::io::Result<(Vec<u8>, u64)> {
    let mut file = match std::fs::File::open(log) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(e),
    };
    let len = file.metadata()?.len();
    let start = len.saturating_sub(TAIL_WINDOW);
    file.seek(SeekFrom::Start(start))?;
    let mut data = Vec::new();
    file.by_ref().take(len - start).read_to_end(&mut data)?;
    let end = start + data.len() as u64;
    Ok((tail_lines(&data, lines).to_vec(), end))
}

/// The last `lines` lines of `data` (all of it when 0). A final line without a newline counts.
fn tail_lines(data: &[u8], lines: u32) -> &[u8] {
    if lines == 0 {
        return data;
    }
    let body = data.strip_suffix(b"\n").unwrap_or(data);
    let mut seen = 0;
    for (i, byte) in body.iter().enumerate().rev() {
        if *byte == b'\n' {
            seen += 1;
            if seen == lines {
                return &data[i + 1..];
            }
        }
    }
    data
}

/// What was appended to the log since `offset`, trimmed ("no output" when nothing was): what
/// a failed launch said.
pub(crate) fn log_since(log: &Path, offset: u64) -> String {
    let text = std::fs::read(log).unwrap_or_default();
    let start = usize::try_from(offset).unwrap_or(0).min(text.len());
    let tail = String::from_utf8_lossy(&text[start..]).trim().to_string();
    if tail.is_empty() {
        "no output".to_string()
    } else {
        tail
    }
}

pub(crate) fn read_from(log: &Path, offset: u64) -> std::io::Result<Vec<u8>> {
    let mut file = match std::fs::File::open(log) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    file.seek(SeekFrom::Start(offset))?;
    let mut data = Vec::new();
    file.take(4 * CHUNK as u64).read_to_end(&mut data)?;
    Ok(data)
}

/// The log as a stream: its last `tail_lines` lines (all when 0), then, when `follow`, what
/// is appended, polled every `interval`, until the receiver goes away or `exists` says the
/// sandbox is gone (after a last read).
pub(crate) fn log_stream(
    log: PathBuf,
    tail_lines: u32,
    follow: bool,
    interval: Duration,
    exists: impl Fn() -> bool + Send + 'static,
) -> Result<DriverStream<pb::LogChunk>, DriverError> {
    use futures::StreamExt;
    let (past, mut offset) = read_tail(&log, tail_lines)
        .map_err(|e| DriverError::Internal(format!("reading the log: {e}")))?;
    let chunks: Vec<Result<pb::LogChunk, DriverError>> = past
        .chunks(CHUNK)
        .map(|c| Ok(pb::LogChunk { data: c.to_vec() }))
        .collect();
    let past = futures::stream::iter(chunks);
    if !follow {
        return Ok(Box::pin(past));
    }
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let gone = !exists();
            match read_from(&log, offset) {
                Ok(data) if !data.is_empty() => {
                    offset += data.len() as u64;
                    for piece in data.chunks(CHUNK) {
                        let chunk = pb::LogChunk {
                            data: piece.to_vec(),
                        };
                        if tx.send(Ok(chunk)).await.is_err() {
                            return;
                        }
                    }
                    continue;
                }
                _ if gone => return,
                Ok(_) => {}
                Err(e) => {
                    let error = DriverError::Internal(format!("following the log: {e}"));
                    let _ = tx.send(Err(error)).await;
                    return;
                }
            }
            if tx.is_closed() {
                return;
            }
            tokio::time::sleep(interval).await;
        }
    });
    Ok(Box::pin(past.chain(ReceiverStream::new(rx))))
}

#[cfg(test)]
mod tests {
    use super::{log_since, tail_lines};

    #[test]
    fn what_a_log_said_since_an_offset() {
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("workload.log");
        assert_eq!(log_since(&log, 0), "no output");
        std::fs::write(&log, "old\n  boom: no such file \n").unwrap();
        assert_eq!(log_since(&log, 4), "boom: no such file");
        assert_eq!(log_since(&log, 4000), "no output");
    }

    #[test]
    fn tails() {
        let check = |data: &str, n: u32, want: &str| {
            assert_eq!(
                std::str::from_utf8(tail_lines(data.as_bytes(), n)).unwrap(),
                want,
                "{data:?} {n}"
            );
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
    }
}

//! The host's side of the guest init's conventions: the per-run files it reads
//! (`/etc/sbx/run.env`, `/etc/sbx/command`), the lines it writes on the console
//! (`sbx-guest: <run id> ready | exit <code> | fatal <why>`), and the exec agent's line protocol
//! on the `sbx.agent` virtio port (see `guest/init.sh`).

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::DriverError;

/// Quotes `s` for a POSIX shell: in single quotes, each `'` as `'\''`.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A script that exports `env` and then `exec`s `command` (the argv, each word quoted).
pub fn command_script<'a>(
    env: impl IntoIterator<Item = (&'a String, &'a String)>,
    command: &[String],
) -> String {
    let mut script = String::new();
    for (key, value) in env {
        script.push_str(&format!("export {key}={}\n", shell_quote(value)));
    }
    let argv: Vec<String> = command.iter().map(|a| shell_quote(a)).collect();
    script.push_str(&format!("exec {}\n", argv.join(" ")));
    script
}

/// `/etc/sbx/run.env`: what this run of the guest is.
pub fn run_env(run_id: &str, generation: u64, hostname: &str, grace: Duration) -> String {
    format!(
        "SBX_RUN_ID={}\nSBX_GENERATION={generation}\nSBX_HOSTNAME={}\nSBX_GRACE={}\n",
        shell_quote(run_id),
        shell_quote(hostname),
        grace.as_secs().max(1)
    )
}

/// What the guest said about one run on the console.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RunReport {
    pub ready: bool,
    /// The command's exit status as its shell saw it (128 + n after signal n).
    pub exit: Option<i32>,
    /// The init could not go on (no disk, for example).
    pub fatal: Option<String>,
}

/// Reads the console log from `offset` (where this run began) for the guest's lines about
/// `run_id`. Lines of other runs, and the workload's own output, are ignored.
pub fn read_report(console_log: &Path, offset: u64, run_id: &str) -> RunReport {
    let mut report = RunReport::default();
    let Ok(mut file) = std::fs::File::open(console_log) else {
        return report;
    };
    if file.seek(SeekFrom::Start(offset)).is_err() {
        return report;
    }
    let mut text = Vec::new();
    if file.read_to_end(&mut text).is_err() {
        return report;
    }
    let prefix = format!("sbx-guest: {run_id} ");
    for line in String::from_utf8_lossy(&text).lines() {
        let Some(rest) = line.trim_end_matches('\r').strip_prefix(&prefix) else {
            continue;
        };
        if rest == "ready" {
            report.ready = true;
        } else if let Some(code) = rest.strip_prefix("exit ") {
            report.exit = code.trim().parse().ok();
        } else if let Some(why) = rest.strip_prefix("fatal ") {
            report.fatal = Some(why.to_string());
        }
    }
    report
}

/// The end of the console log: the last `max` bytes, for error messages.
pub fn console_tail(console_log: &Path, max: u64) -> String {
    let Ok(mut file) = std::fs::File::open(console_log) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut text = Vec::new();
    let _ = file.read_to_end(&mut text);
    String::from_utf8_lossy(&text).trim().to_string()
}

/// The outcome of one exec through the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecResult {
    /// The exit status as the guest's shell saw it (137 after the timeout's SIGKILL).
    pub code: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Runs `command` (with `env`) in the guest through the agent's FIFOs, in `/sandbox`, killed
/// after `timeout`. Output is collected in the guest and returned at the end (at most 1 MiB
/// per stream). The caller serialises execs of one VM (they share one channel).
pub async fn exec(
    agent: &Path,
    request_id: u64,
    env: &BTreeMap<String, String>,
    command: &[String],
    timeout: Duration,
) -> Result<ExecResult, DriverError> {
    let script = command_script(env, command);
    let line = format!(
        "exec {request_id} {} {}\n",
        timeout.as_secs().max(1),
        STANDARD.encode(script)
    );
    let unavailable = |e: String| DriverError::Unavailable(format!("the vm's exec agent: {e}"));
    // The guest's own timeout kills the command; this bound covers a guest that never answers.
    let bound = timeout + Duration::from_secs(15);
    let answer = tokio::time::timeout(bound, async {
        use tokio::net::unix::pipe;
        // Open the reading end first: the answer must find a reader. Opening the writing end
        // fails (ENXIO) when no QEMU holds the channel, instead of waiting for one.
        let read = pipe::OpenOptions::new()
            .open_receiver(super::qemu::fifo(agent, "out"))
            .map_err(|e| format!("open: {e}"))?;
        let mut write = pipe::OpenOptions::new()
            .open_sender(super::qemu::fifo(agent, "in"))
            .map_err(|e| format!("open: {e}"))?;
        write
            .write_all(line.as_bytes())
            .await
            .map_err(|e| format!("send: {e}"))?;
        let mut lines = BufReader::new(read).lines();
        let want = format!("result {request_id} ");
        loop {
            match lines.next_line().await {
                Ok(Some(l)) if l.starts_with(&want) => return Ok(l),
                // An answer to an earlier, abandoned request: not ours.
                Ok(Some(_)) => continue,
                Ok(None) => return Err("the agent closed the connection".to_string()),
                Err(e) => return Err(format!("read: {e}")),
            }
        }
    })
    .await
    .map_err(|_| unavailable(format!("no answer within {bound:?}")))?
    .map_err(unavailable)?;
    parse_result(&answer).ok_or_else(|| unavailable(format!("malformed answer {answer:?}")))
}

/// `result <id> <code> <base64 stdout> <base64 stderr>` (empty outputs may leave the fields
/// empty or out).
fn parse_result(line: &str) -> Option<ExecResult> {
    let mut fields = line.split(' ');
    if fields.next()? != "result" {
        return None;
    }
    let _id = fields.next()?;
    let code = fields.next()?.parse().ok()?;
    let stdout = STANDARD.decode(fields.next().unwrap_or_default()).ok()?;
    let stderr = STANDARD.decode(fields.next().unwrap_or_default()).ok()?;
    Some(ExecResult {
        code,
        stdout,
        stderr,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_a_shell() {
        let env: BTreeMap<String, String> =
            [("GREETING".to_string(), "it's $HOME `x`".to_string())]
                .into_iter()
                .collect();
        let argv = vec![
            "sh".to_string(),
            "-c".to_string(),
            "printf '%s|' \"$GREETING\" \"$0\"".to_string(),
            "a b'c".to_string(),
        ];
        let script = command_script(&env, &argv);
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(&script)
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "it's $HOME `x`|a b'c|"
        );
    }

    #[test]
    fn reports_are_read_for_their_run_only() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("console.log");
        let earlier = "\nsbx-guest: r1 ready\nhello\nsbx-guest: r1 exit 0\n";
        let now = "[ 1.0] kernel\r\n\nsbx-guest: r2 ready\nsbx-guest: r1 exit 9\nworkload says sbx-guest: r2 exit 5\n";
        std::fs::write(&log, format!("{earlier}{now}")).unwrap();
        let offset = earlier.len() as u64;
        let report = read_report(&log, offset, "r2");
        assert_eq!(
            report,
            RunReport {
                ready: true,
                exit: None,
                fatal: None
            }
        );
        std::fs::write(&log, format!("{earlier}{now}\nsbx-guest: r2 exit 137\r\n")).unwrap();
        assert_eq!(read_report(&log, offset, "r2").exit, Some(137));
        assert_eq!(read_report(&log, 0, "r1").exit, Some(9));
        assert_eq!(
            read_report(&dir.path().join("none"), 0, "r2"),
            RunReport::default()
        );
    }

    #[test]
    fn results_parse() {
        let line = format!(
            "result 7 3 {} {}",
            STANDARD.encode("out\n"),
            STANDARD.encode("err\n")
        );
        assert_eq!(
            parse_result(&line),
            Some(ExecResult {
                code: 3,
                stdout: b"out\n".to_vec(),
                stderr: b"err\n".to_vec()
            })
        );
        assert_eq!(
            parse_result("result 7 0  ").map(|r| (r.code, r.stdout.len())),
            Some((0, 0))
        );
        assert_eq!(parse_result("result 7 x"), None);
        assert_eq!(parse_result("pong 7 r1"), None);
    }
}

//! The host's side of the guest init's conventions: the per-run files it reads
//! (`/etc/sbx/run.env`, `/etc/sbx/command`), the lines it writes on the console
//! (`sbx-guest: <run id> ready | exit <code> | fatal <why>`). (Exec is the guest's
//! `sbx-agent`, on its own virtio port: `streams.rs`.)

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::time::Duration;

/// Quotes `s` for a POSIX shell: in single quotes, each `'` as `'\''`.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A script that exports `env` and then `exec`s `command` (the argv, each word quoted). Run
/// with `--sbx-check` it only looks the command up, as the `exec` will (after the exports),
/// and says on stderr when it is not found (status 127).
pub fn command_script<'a>(
    env: impl IntoIterator<Item = (&'a String, &'a String)>,
    command: &[String],
) -> String {
    let mut script = String::new();
    for (key, value) in env {
        script.push_str(&format!("export {key}={}\n", shell_quote(value)));
    }
    let argv: Vec<String> = command.iter().map(|a| shell_quote(a)).collect();
    if let Some(first) = argv.first() {
        script.push_str(&format!(
            "if [ \"${{1-}}\" = --sbx-check ]; then command -v {first} >/dev/null 2>&1 && exit 0; \
             echo \"sbx: command not found: \"{first} >&2; exit 127; fi\n"
        ));
    }
    script.push_str(&format!("exec {}\n", argv.join(" ")));
    script
}

/// Where the guest's init mounts an image's root disk, and where the agent is inside it
/// (`/dev` in the guest is its own devtmpfs, in memory: nothing is written to the image).
pub const GUEST_ROOT: &str = "/sbx/root";
pub const AGENT_IN_ROOT: &str = "/dev/.sbx/sbx-agent";

/// `/etc/sbx/process.env` of a sandbox of an image: its process's environment as exports,
/// which the init gives the exec agents too (an exec sees the image's Env, as on oci).
pub fn process_env(process: &super::record::GuestProcess) -> String {
    let mut script = String::new();
    for kv in &process.env {
        let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
        script.push_str(&format!("export {key}={}\n", shell_quote(value)));
    }
    script
}

/// The command script of a sandbox of an image: the process's environment
/// ([`process_env`]'s file, sourced) and `run_env`'s variables (which win) exported, then the
/// agent, in the image's root ([`GUEST_ROOT`], by `chroot`), becoming the process as the
/// image's User in its WorkingDir. `--sbx-check` looks the command up there the same way.
pub fn image_script<'a>(
    process: &super::record::GuestProcess,
    run_env: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> String {
    let mut script = String::from(". /etc/sbx/process.env\n");
    for (key, value) in run_env {
        script.push_str(&format!("export {key}={}\n", shell_quote(value)));
    }
    let argv: Vec<String> = process.args.iter().map(|a| shell_quote(a)).collect();
    let chrooted = format!("/bin/chroot {GUEST_ROOT} {AGENT_IN_ROOT}");
    // A command not found is said as a stderr record of the log (`which --record`).
    if let Some(first) = argv.first() {
        script.push_str(&format!(
            "if [ \"${{1-}}\" = --sbx-check ]; then {chrooted} which --record {first} && exit 0; \
             exit 127; fi\n"
        ));
    }
    script.push_str(&format!(
        "exec {chrooted} run --user {} --workdir {} -- {}\n",
        shell_quote(&process.user),
        shell_quote(&process.cwd),
        argv.join(" ")
    ));
    script
}

/// `/etc/sbx/run.env`: what this run of the guest is.
/// With `network` (address, gateway) the guest sets up its NIC and names the gateway's
/// resolver in `/etc/resolv.conf`. With `image` (WorkingDir and User: a sandbox of an image: its WorkingDir), the guest mounts the image's root
/// disk and runs everything in it, execs starting there.
pub fn run_env(
    run_id: &str,
    generation: u64,
    hostname: &str,
    grace: Duration,
    image: Option<(&str, &str)>,
    network: Option<(std::net::Ipv4Addr, std::net::Ipv4Addr)>,
) -> String {
    let mut text = format!(
        "SBX_RUN_ID={}\nSBX_GENERATION={generation}\nSBX_HOSTNAME={}\nSBX_GRACE={}\n\
         SBX_EXEC_CHANNELS={}\n",
        shell_quote(run_id),
        shell_quote(hostname),
        grace.as_secs().max(1),
        super::qemu::EXEC_CHANNELS
    );
    if let Some((address, gateway)) = network {
        text.push_str(&format!("SBX_NET_ADDR={address}\nSBX_NET_GW={gateway}\n"));
    }
    if let Some((dir, user)) = image {
        text.push_str(&format!(
            "SBX_ROOT_SERIAL={}\nSBX_WORKDIR={}\nSBX_USER={}\n",
            super::qemu::ROOT_SERIAL,
            shell_quote(dir),
            shell_quote(user)
        ));
    }
    text
}

/// What the guest said about one run on the console.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RunReport {
    pub ready: bool,
    /// The command's exit status as its shell saw it (128 + n after signal n).
    pub exit: Option<i32>,
    /// The init could not go on (no disk, for example).
    pub fatal: Option<String>,
    /// The init did not find the command (it then ends the run with 127, never `ready`).
    pub not_found: bool,
    /// The guest's kernel killed a process for want of memory during the run (its
    /// `/proc/vmstat` `oom_kill` grew), and the command ended by SIGKILL: the init says `oom`.
    pub oom: bool,
}

/// How much of the console log's start and end a report reads.
const REPORT_WINDOW: u64 = 1 << 20;

/// Reads the console log from `offset` (where this run began) for the guest's lines about
/// `run_id`. Lines of other runs, and the workload's own output, are ignored. The console's
/// logger keeps it within the driver's `log_max` by rotation (`<console>.1`, the part before):
/// the end of that part is read too, and a log shorter than `offset` (rotated since the run
/// began) is read from its start.
pub fn read_report(console_log: &Path, offset: u64, run_id: &str) -> RunReport {
    let report = RunReport::default();
    let mut text = Vec::new();
    if let Ok(mut previous) = std::fs::File::open(sbx_host_kit::logfile::previous_path(console_log))
    {
        let len = previous.metadata().map(|m| m.len()).unwrap_or(0);
        if previous
            .seek(SeekFrom::Start(len.saturating_sub(REPORT_WINDOW)))
            .is_ok()
        {
            let _ = (&mut previous).take(REPORT_WINDOW).read_to_end(&mut text);
            text.push(b'\n');
        }
    }
    let Ok(mut file) = std::fs::File::open(console_log) else {
        return parse_report(&text, run_id, report);
    };
    // The guest writes the console: at most the first and the last [`REPORT_WINDOW`] bytes of
    // this run are read (`ready` comes early, `exit` last), however much it printed.
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let offset = if offset > len { 0 } else { offset };
    let late = len.saturating_sub(REPORT_WINDOW).max(offset);
    for (from, upto) in [(offset, late.min(offset + REPORT_WINDOW)), (late, len)] {
        if upto <= from || file.seek(SeekFrom::Start(from)).is_err() {
            continue;
        }
        if (&mut file)
            .take(upto - from)
            .read_to_end(&mut text)
            .is_err()
        {
            return report;
        }
        text.push(b'\n');
    }
    parse_report(&text, run_id, report)
}

/// The guest's lines about `run_id` in `text`, added to `report`.
fn parse_report(text: &[u8], run_id: &str, mut report: RunReport) -> RunReport {
    let prefix = format!("sbx-guest: {run_id} ");
    for line in String::from_utf8_lossy(text).lines() {
        let Some(rest) = line.trim_end_matches('\r').strip_prefix(&prefix) else {
            continue;
        };
        if rest == "ready" {
            report.ready = true;
        } else if rest == "notfound" {
            report.not_found = true;
        } else if rest == "oom" {
            report.oom = true;
        } else if let Some(code) = rest.strip_prefix("exit ") {
            report.exit = code.trim().parse().ok();
        } else if let Some(why) = rest.strip_prefix("fatal ") {
            report.fatal = Some(why.to_string());
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

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
        // --sbx-check looks the command up, after the exports, and runs nothing.
        let check = |argv: &[&str], env: &BTreeMap<String, String>| {
            let argv: Vec<String> = argv.iter().map(|a| a.to_string()).collect();
            let script = command_script(env, &argv);
            std::process::Command::new("sh")
                .args(["-c", &script, "sh", "--sbx-check"])
                .output()
                .unwrap()
        };
        let found = check(&["sh", "-c", "echo ran"], &env);
        assert_eq!((found.status.code(), found.stdout.len()), (Some(0), 0));
        let missing = check(&["no-such-command-here"], &env);
        assert_eq!(missing.status.code(), Some(127));
        assert_eq!(
            String::from_utf8_lossy(&missing.stderr),
            "sbx: command not found: no-such-command-here\n"
        );
        // Found through the PATH the spec exports.
        let path: BTreeMap<String, String> = [("PATH".to_string(), "/nowhere".to_string())]
            .into_iter()
            .collect();
        assert_eq!(check(&["sh"], &path).status.code(), Some(127));
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
                fatal: None,
                not_found: false,
                oom: false,
            }
        );
        std::fs::write(&log, format!("{earlier}{now}\nsbx-guest: r2 exit 137\r\n")).unwrap();
        assert_eq!(read_report(&log, offset, "r2").exit, Some(137));
        assert!(!read_report(&log, offset, "r2").oom);
        std::fs::write(
            &log,
            format!("{earlier}{now}\nsbx-guest: r2 oom\nsbx-guest: r2 exit 137\n"),
        )
        .unwrap();
        assert!(read_report(&log, offset, "r2").oom);
        assert!(!read_report(&log, 0, "r1").oom, "another run's line");
        assert_eq!(read_report(&log, 0, "r1").exit, Some(9));
        assert_eq!(
            read_report(&dir.path().join("none"), 0, "r2"),
            RunReport::default()
        );
        // Rotated since the run began: its `ready` in the part before, its exit in a log now
        // shorter than where the run began.
        std::fs::write(
            dir.path().join("console.log.1"),
            "sbx-guest: r3 ready\nflood\n",
        )
        .unwrap();
        std::fs::write(&log, "more flood\nsbx-guest: r3 exit 7\n").unwrap();
        let report = read_report(&log, 1 << 20, "r3");
        assert_eq!((report.ready, report.exit), (true, Some(7)));
    }
}

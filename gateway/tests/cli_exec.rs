//! `sbx sandbox exec` as docker and kubectl users expect it, end to end through the real sbxd
//! (default driver: oci, busybox image; needs root and runc) and the real `sbx` binary: stdin
//! only with -i and byte-exact (20 MB), -t on a pseudo-terminal the test makes (the size, a
//! resize, the local terminal restored), signals forwarded, --timeout, --workdir, exit codes.
//! Each test ends its sbxd by pid and checks that no container or mount is left.

mod common;

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{CliRun, DataDir, SBX, Sbxd, mounts_under, oci_containers, sbx, unique};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rustix::termios::{LocalModes, Winsize, tcgetattr, tcsetwinsize};
use sbx_drivers::oci::OciDriver;
use sha2::{Digest, Sha256};

/// How long a command that should end at once may take.
const QUICK: Duration = Duration::from_secs(20);

/// One test's sbxd (default driver) with sandbox "box" running `sleep 3600`.
struct World {
    sbxd: Sbxd,
    data: DataDir,
    cgroup_parent: String,
}

impl World {
    fn new() -> World {
        let data = DataDir::new();
        let cgroup_parent = format!("sbx-gateway-tests-exec-{}", unique());
        let sbxd = Sbxd::start(data.path(), "", &["--oci-cgroup-parent", &cgroup_parent]);
        let w = World {
            sbxd,
            data,
            cgroup_parent,
        };
        let created = w.sbx(&["sandbox", "create", "-n", "box", "--", "sleep", "3600"]);
        assert_eq!(created.code, 0, "{created:?}");
        w
    }

    fn endpoint(&self) -> String {
        self.sbxd.endpoint()
    }

    fn sbx(&self, args: &[&str]) -> CliRun {
        sbx(&self.endpoint(), args)
    }

    /// `sbx sandbox exec box -- ARGS…` with stdin from /dev/null.
    fn exec(&self, args: &[&str]) -> CliRun {
        let mut argv = vec!["sandbox", "exec", "box", "--"];
        argv.extend_from_slice(args);
        self.sbx(&argv)
    }

    /// Spawns `sbx ARGS…` with piped stdin and stdout (stderr collected).
    fn spawn(&self, args: &[&str]) -> Child {
        Command::new(SBX)
            .args(args)
            .env("SBX_ENDPOINT", self.endpoint())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn sbx")
    }

    /// The processes in the sandbox, one `ps -o args` line each.
    fn processes(&self) -> String {
        self.exec(&["ps", "-o", "args"]).ok().to_string()
    }

    /// Deletes the sandbox, ends sbxd by pid, and checks that nothing of them is left.
    fn finish(mut self) {
        self.sbx(&["sandbox", "delete", "box"]).ok();
        self.sbxd.sigterm(Duration::from_secs(30));
        let data = self.data.path();
        assert!(
            oci_containers(data).is_empty(),
            "{:?}",
            oci_containers(data)
        );
        assert!(mounts_under(data).is_empty(), "{:?}", mounts_under(data));
        let cgroups = OciDriver::cgroup_leftovers(&self.cgroup_parent);
        assert!(cgroups.is_empty(), "cgroups left: {cgroups:?}");
        // The (empty) parent itself, in every hierarchy it was made in.
        for entry in std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = std::fs::remove_dir(entry.path().join(&self.cgroup_parent));
        }
        let _ = std::fs::remove_dir(Path::new("/sys/fs/cgroup").join(&self.cgroup_parent));
    }
}

/// Waits at most `limit` for `child` to exit; kills it (by pid) and panics after.
fn wait_bounded(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    let began = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if began.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn read_all_on_a_thread(mut from: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut all = Vec::new();
        let _ = from.read_to_end(&mut all);
        all
    })
}

#[test]
fn stdin_is_sent_only_with_i_byte_exact_and_in_constant_memory() {
    let w = World::new();
    // 20 MB of random bytes through `cat` and back.
    let mut data = vec![0u8; 20 * 1024 * 1024];
    rand::fill(&mut data[..]);
    let sent = hex::encode(Sha256::digest(&data));
    let began = Instant::now();
    let mut child = w.spawn(&["sandbox", "exec", "-i", "box", "--", "cat"]);
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(&data));
    let stdout = read_all_on_a_thread(child.stdout.take().unwrap());
    let stderr = read_all_on_a_thread(child.stderr.take().unwrap());
    let status = wait_bounded(&mut child, Duration::from_secs(120), "exec -i cat");
    let took = began.elapsed();
    writer.join().unwrap().expect("write stdin");
    let got = stdout.join().unwrap();
    let err = String::from_utf8_lossy(&stderr.join().unwrap()).to_string();
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(got.len(), 20 * 1024 * 1024, "{err}");
    assert_eq!(hex::encode(Sha256::digest(&got)), sent);
    eprintln!("20 MiB through exec -i cat and back in {took:?}");

    // Without -i, nothing of sbx's stdin is read or sent: the remote cat sees an empty stdin
    // and ends at once though sbx's stdin stays open with data in it.
    let mut child = w.spawn(&["sandbox", "exec", "box", "--", "cat"]);
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"hi\n").unwrap();
    let stdout = read_all_on_a_thread(child.stdout.take().unwrap());
    let status = wait_bounded(&mut child, QUICK, "exec cat without -i");
    assert_eq!(status.code(), Some(0));
    assert_eq!(stdout.join().unwrap(), b"", "stdin was sent without -i");

    // The command ending first: sbx exits with its status at once, though its stdin is still
    // open (a read of it is pending) and never ends.
    let mut child = w.spawn(&["sandbox", "exec", "-i", "box", "--", "head", "-c", "5"]);
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"hello, and more\n").unwrap();
    let stdout = read_all_on_a_thread(child.stdout.take().unwrap());
    let status = wait_bounded(&mut child, QUICK, "exec -i head with stdin open");
    assert_eq!(status.code(), Some(0));
    assert_eq!(stdout.join().unwrap(), b"hello");
    drop(stdin);

    // The end of sbx's stdin is the end of the command's: `wc -c` counts and exits.
    let mut child = w.spawn(&["sandbox", "exec", "-i", "box", "--", "wc", "-c"]);
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"12345678").unwrap();
    drop(stdin);
    let stdout = read_all_on_a_thread(child.stdout.take().unwrap());
    let status = wait_bounded(&mut child, QUICK, "exec -i wc -c");
    assert_eq!(status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&stdout.join().unwrap()).trim(), "8");
    w.finish();
}

/// A pseudo-terminal the test holds: sbx gets the slave as stdin, stdout and stderr; what it
/// writes is read from the master on a thread.
struct Pty {
    master: std::fs::File,
    slave: std::fs::File,
    output: mpsc::Receiver<Vec<u8>>,
    seen: Vec<u8>,
}

impl Pty {
    fn open(rows: u16, cols: u16) -> Pty {
        use rustix::pty::{OpenptFlags, grantpt, openpt, ptsname, unlockpt};
        let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY).expect("openpt");
        grantpt(&master).expect("grantpt");
        unlockpt(&master).expect("unlockpt");
        let name = ptsname(&master, Vec::new()).expect("ptsname");
        let slave = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(name.to_str().unwrap())
            .expect("open the pty's slave");
        let master = std::fs::File::from(master);
        let pty_reader = master.try_clone().unwrap();
        let (tx, output) = mpsc::channel();
        std::thread::spawn(move || {
            let mut pty_reader = pty_reader;
            let mut buf = [0u8; 4096];
            // Ends with EIO once every slave descriptor is closed.
            while let Ok(n) = pty_reader.read(&mut buf) {
                if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                    return;
                }
            }
        });
        let pty = Pty {
            master,
            slave,
            output,
            seen: Vec::new(),
        };
        pty.resize(rows, cols);
        pty
    }

    fn resize(&self, rows: u16, cols: u16) {
        let size = Winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        tcsetwinsize(self.master.as_fd(), size).expect("set the pty's size");
    }

    /// Spawns `sbx ARGS…` on the slave.
    fn spawn(&self, endpoint: &str, args: &[&str]) -> Child {
        let end = || Stdio::from(self.slave.try_clone().unwrap());
        Command::new(SBX)
            .args(args)
            .env("SBX_ENDPOINT", endpoint)
            .env("TERM", "vt100")
            .stdin(end())
            .stdout(end())
            .stderr(end())
            .spawn()
            .expect("spawn sbx on the pty")
    }

    fn type_in(&mut self, text: &str) {
        self.master
            .write_all(text.as_bytes())
            .expect("write to the pty");
    }

    /// Reads until the output seen since the last match contains `needle` (at most `limit`);
    /// answers that output.
    fn expect(&mut self, needle: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let text = String::from_utf8_lossy(&self.seen).to_string();
            if let Some(at) = text.find(needle) {
                self.seen.drain(..at + needle.len());
                return text[..at + needle.len()].to_string();
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                panic!("no {needle:?} on the terminal within {limit:?}; saw {text:?}");
            };
            if let Ok(bytes) = self.output.recv_timeout(left) {
                self.seen.extend_from_slice(&bytes);
            }
        }
    }

    /// Whether the slave is in the canonical, echoing mode a shell leaves it in (not raw).
    fn is_cooked(&self) -> bool {
        let modes = tcgetattr(self.slave.as_fd()).unwrap().local_modes;
        modes.contains(LocalModes::ICANON | LocalModes::ECHO | LocalModes::ISIG)
    }
}

#[test]
fn a_tty_exec_has_the_local_size_follows_resizes_and_restores_the_terminal() {
    let w = World::new();
    let ep = w.endpoint();

    // -t with a stdin that is not a terminal: refused before anything is sent, exit 2.
    let refused = w.sbx(&["sandbox", "exec", "-it", "box", "--", "tty"]);
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(
        refused.stderr.contains("not a TTY") && refused.stderr.contains("drop -t"),
        "{refused:?}"
    );

    let mut pty = Pty::open(33, 77);
    assert!(pty.is_cooked());
    let mut child = pty.spawn(&ep, &["sandbox", "exec", "-it", "box", "--", "sh"]);
    let pid = Pid::from_raw(child.id() as i32);
    // The quotes keep the typed line (echoed back) from matching what the command prints.
    pty.type_in("tty; stty size; echo \"$TERM\" \"EN\"\"D1\"\n");
    let first = pty.expect("vt100 END1", QUICK);
    // The exec's terminal is of the driver's exec devpts instance (host root's ptys).
    assert!(first.contains("/dev/.sbx-pts/"), "{first:?}");
    assert!(first.contains("33 77"), "{first:?}");
    // The local terminal is raw while the exec runs: the remote pty echoes, not the local one.
    assert!(
        !pty.is_cooked(),
        "the local terminal is not raw during exec -it"
    );

    // A resize of the local terminal, and SIGWINCH (the kernel sends it only to a terminal's
    // foreground group; sbx is not in one here): the same session sees the new size.
    pty.resize(40, 100);
    kill(pid, Signal::SIGWINCH).unwrap();
    let mut resized = false;
    for attempt in 0..20 {
        pty.type_in(&format!("stty size; echo \"S\"\"Z{attempt}\"\n"));
        let seen = pty.expect(&format!("SZ{attempt}"), QUICK);
        if seen.contains("40 100") {
            resized = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(resized, "the remote terminal did not follow the resize");

    pty.type_in("exit 3\n");
    let status = wait_bounded(&mut child, QUICK, "exec -it sh after exit 3");
    assert_eq!(status.code(), Some(3));
    assert!(pty.is_cooked(), "the terminal was left raw after exec -it");

    // An error after raw mode was entered (no such sandbox): restored too, and the error is
    // printed on a sane terminal.
    let mut child = pty.spawn(&ep, &["sandbox", "exec", "-it", "nobox", "--", "sh"]);
    let status = wait_bounded(&mut child, QUICK, "exec -it into a missing sandbox");
    assert_eq!(status.code(), Some(1));
    pty.expect("SANDBOX_NOT_FOUND", QUICK);
    assert!(pty.is_cooked(), "the terminal was left raw after an error");
    w.finish();
}

/// Starts `sbx sandbox exec box -- ARGS…`, waits until ARGS runs in the sandbox (`marker` in
/// its process list), and answers the child.
fn start_running(w: &World, args: &[&str], marker: &str) -> Child {
    let mut argv = vec!["sandbox", "exec", "box", "--"];
    argv.extend_from_slice(args);
    let child = w.spawn(&argv);
    wait_running(w, marker);
    child
}

/// Waits (at most [`QUICK`]) until a process whose whole command line is `marker` shows in
/// the sandbox's process list (a line that merely holds it — the shell that will start it —
/// does not count: a signal sent then could reach the shell before its trap is set).
fn wait_running(w: &World, marker: &str) {
    let began = Instant::now();
    while !w.processes().lines().any(|l| l.trim() == marker) {
        assert!(began.elapsed() < QUICK, "{marker:?} never ran");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sends `signal` to sbx (by pid) and asserts that it exits with `code` within 5 s and that
/// `marker` is gone from the sandbox.
fn signal_ends(w: &World, child: &mut Child, signal: Signal, code: i32, marker: &str) {
    kill(Pid::from_raw(child.id() as i32), signal).unwrap();
    let status = wait_bounded(
        child,
        Duration::from_secs(5),
        &format!("exec after {signal}"),
    );
    assert_eq!(status.code(), Some(code), "after {signal}");
    assert!(!w.processes().contains(marker), "{}", w.processes());
}

#[test]
fn sigterm_is_forwarded_and_a_second_interrupt_kills() {
    let w = World::new();
    // SIGTERM to sbx reaches the command: it dies of it, sbx exits 128+15.
    let mut child = start_running(&w, &["sleep", "101"], "sleep 101");
    signal_ends(&w, &mut child, Signal::SIGTERM, 143, "sleep 101");

    // A command that ignores SIGINT: the first Ctrl-C does nothing to it, the second sends
    // SIGKILL (128+9), and nothing of it is left.
    let mut child = start_running(
        &w,
        &["sh", "-c", "trap '' INT; sleep 102; echo survived"],
        "sleep 102",
    );
    let pid = Pid::from_raw(child.id() as i32);
    kill(pid, Signal::SIGINT).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(child.try_wait().unwrap(), None, "one SIGINT ended sbx");
    signal_ends(&w, &mut child, Signal::SIGINT, 137, "sleep 102");
    w.finish();
}

#[test]
fn ctrl_c_ends_the_remote_command() {
    let w = World::new();
    // Without -t: sbx catches SIGINT and sends it on; the command dies of it (128+2).
    let mut child = start_running(&w, &["sleep", "100"], "sleep 100");
    signal_ends(&w, &mut child, Signal::SIGINT, 130, "sleep 100");

    // With -it, Ctrl-C is the byte 0x03 on the remote terminal: the shell's foreground sleep
    // ends, the shell (and sbx) stay.
    let mut pty = Pty::open(24, 80);
    let mut child = pty.spawn(
        &w.endpoint(),
        &["sandbox", "exec", "-it", "box", "--", "sh"],
    );
    pty.type_in("sleep 103\n");
    wait_running(&w, "sleep 103");
    pty.type_in("\x03");
    pty.type_in("echo \"AF\"\"TER\"\n");
    pty.expect("AFTER", QUICK);
    assert_eq!(child.try_wait().unwrap(), None, "Ctrl-C ended sbx itself");
    assert!(!w.processes().contains("sleep 103"), "{}", w.processes());
    pty.type_in("exit\n");
    assert_eq!(
        wait_bounded(&mut child, QUICK, "exec -it sh").code(),
        Some(0)
    );
    w.finish();
}

#[test]
fn workdir_timeout_and_a_missing_command_exit_as_documented() {
    let w = World::new();
    let pwd = w.sbx(&["sandbox", "exec", "--workdir", "/tmp", "box", "--", "pwd"]);
    assert_eq!(pwd.ok().trim(), "/tmp");
    let missing = w.sbx(&[
        "sandbox",
        "exec",
        "--workdir",
        "/nowhere",
        "box",
        "--",
        "pwd",
    ]);
    assert_ne!(missing.code, 0, "{missing:?}");
    assert!(missing.stderr.contains("/nowhere"), "{missing:?}");

    let began = Instant::now();
    let slow = w.sbx(&[
        "sandbox",
        "exec",
        "--timeout",
        "1",
        "box",
        "--",
        "sleep",
        "30",
    ]);
    assert_eq!(slow.code, 124, "{slow:?}");
    assert_eq!(
        slow.stderr.trim(),
        "error: the command timed out after 1 s",
        "{slow:?}"
    );
    assert!(
        began.elapsed() < Duration::from_secs(15),
        "{:?}",
        began.elapsed()
    );
    assert!(!w.processes().contains("sleep 30"), "{}", w.processes());

    let unknown = w.exec(&["no-such-command"]);
    assert_eq!(unknown.code, 127, "{unknown:?}");
    assert!(
        unknown
            .stderr
            .contains("command not found: no-such-command"),
        "{unknown:?}"
    );
    // Killed by a signal: 128+N.
    assert_eq!(w.exec(&["sh", "-c", "kill -9 $$"]).code, 137);
    assert_eq!(w.exec(&["sh", "-c", "exit 7"]).code, 7);
    w.finish();
}

//! Checks of copying files and forwarding ports: a tree copied in and out again comes back
//! byte-exact with its modes, times and symlinks; an archive entry that leaves the
//! destination, a missing path and a stopped sandbox are refused; a forwarded connection
//! carries 100 KiB both ways and half-closes each direction on its own; a port nobody listens
//! on is `FailedPrecondition`.
//!
//! Sizes: the 300 KiB file of the tree and the 100 KiB sent through a forward cross the
//! agent's 64 KiB frames (the file five times, the forward once), and the tar goes to the
//! driver in chunks of 100 KiB, which split neither at a frame's edge nor at an entry's.
//!
//! Each check looks at the capabilities first and prints why it skips when `copy` or
//! `port_forward` is absent (sim, vm), or when the harness has no way to run an echo server
//! ([`DriverHarness::echo_server`] `None`). Paths are made under [`SCRATCH`], named by a fresh
//! uuid; where the driver's exec runs real processes they are removed again, also after a
//! failure (the process driver's `/tmp` is the host's).

use std::collections::BTreeMap;
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::panic::{AssertUnwindSafe, resume_unwind};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use futures::channel::mpsc;
use futures::{FutureExt, StreamExt};
use tokio::time::{Instant, sleep, timeout};
use uuid::Uuid;

use super::DriverHarness;
use super::exec::{first_difference, noise};
use super::session::{Session, run_check};
use crate::{DriverError, DriverStream, no_exec_input, pb};

use pb::port_forward_input::Input;
use pb::port_forward_output::Output;

/// Where the checks make their paths in a sandbox: writable in the process driver (the
/// host's `/tmp`) and in the oci driver's busybox image alike.
const SCRATCH: &str = "/tmp";

/// The big file of the tree: five of the agent's 64 KiB frames and a part.
const BIG_FILE: usize = 300 * 1024;

/// How the tar goes to the driver.
const UPLOAD_CHUNK: usize = 100 * 1024;

/// What goes through a forwarded connection: more than one 64 KiB frame.
const FORWARDED: usize = 100 * 1024;

/// The port of the echo server, and one nobody listens on (each sandbox has its own
/// loopback, so a fixed port is free in a fresh one).
const ECHO_PORT: u16 = 7777;
const CLOSED_PORT: u16 = 7778;

/// How long the echo server may take to listen, and the stream to end once both sides closed.
const PROMPTLY: Duration = Duration::from_secs(5);

/// The modification time the tree's big file gets (2001-09-09), to see it kept.
const MTIME_SECS: u64 = 1_000_000_000;

/// What a check needs of the driver besides a running sandbox.
#[derive(Clone, Copy)]
enum Needs {
    Copy,
    PortForward,
    /// Forwarding, and an exec to start the echo server with.
    PortForwardAndExec,
}

/// Skips (printing why) unless the driver reports what `needs` names; answers the
/// capabilities otherwise.
async fn needs(s: &Session<'_>, needs: Needs) -> Option<pb::CapabilitiesResponse> {
    let caps = s.capabilities().await;
    let lacks = match needs {
        Needs::Copy if !caps.copy => Some("copy"),
        Needs::PortForward | Needs::PortForwardAndExec if !caps.port_forward => {
            Some("port_forward")
        }
        Needs::PortForwardAndExec if !caps.exec => Some("exec (to start the echo server)"),
        _ => None,
    };
    if let Some(name) = lacks {
        eprintln!(
            "conformance: {} skipped: the driver does not report {name}",
            s.check()
        );
        return None;
    }
    Some(caps)
}

/// A fresh path under [`SCRATCH`].
fn scratch_path() -> String {
    format!("{SCRATCH}/sbx-conf-{}", Uuid::new_v4())
}

/// Copies the tar `tar` to `path` of sandbox `id`, in chunks of [`UPLOAD_CHUNK`].
async fn try_copy_to(
    s: &Session<'_>,
    id: &str,
    path: &str,
    tar: &[u8],
) -> Result<pb::CopyToResponse, DriverError> {
    let chunks: Vec<Vec<u8>> = tar.chunks(UPLOAD_CHUNK).map(<[u8]>::to_vec).collect();
    let req = pb::CopyToStart {
        sandbox_id: id.to_string(),
        path: path.to_string(),
    };
    let what = format!("copy_to {path} in {id}");
    s.call(
        &what,
        s.driver()
            .copy_to(req, Box::pin(futures::stream::iter(chunks))),
    )
    .await
}

/// The tar of `path` of sandbox `id`; an error of the call or of the stream is returned.
async fn try_copy_from(s: &Session<'_>, id: &str, path: &str) -> Result<Vec<u8>, DriverError> {
    let what = format!("copy_from {path} in {id}");
    let req = pb::CopyFromRequest {
        sandbox_id: id.to_string(),
        path: path.to_string(),
        changes: false,
    };
    let mut stream = s.call(&what, s.driver().copy_from(req)).await?;
    let read = async {
        let mut tar = Vec::new();
        while let Some(chunk) = stream.next().await {
            tar.extend_from_slice(&chunk?.data);
        }
        Ok(tar)
    };
    s.call(&format!("{what} (stream)"), read).await
}

/// Packs `path` (on this machine) with the agent's own packer.
fn pack(check: &str, path: &Path) -> Vec<u8> {
    let mut tar = Vec::new();
    sbx_agent::archive::pack(path, &mut tar)
        .unwrap_or_else(|e| panic!("[{check}] packing {}: {e}", path.display()));
    tar
}

/// A tar of regular files named as given, the name bytes written raw into the header: the
/// tar builder itself refuses `..` and absolute names, a hostile archive does not.
fn hostile(entries: &[(&str, &str)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        let name = &mut h.as_old_mut().name;
        name[..path.len()].copy_from_slice(path.as_bytes());
        h.set_cksum();
        b.append(&h, data.as_bytes())
            .expect("appending to a tar in memory");
    }
    b.into_inner().expect("finishing a tar in memory")
}

/// Runs `body`, then removes `paths` in sandbox `id` (with `rm -rf`, where the driver runs
/// real processes), whether `body` passed or failed; a failure is re-raised after that.
async fn removing(s: &Session<'_>, id: &str, paths: &[&str], body: impl Future<Output = ()>) {
    let outcome = AssertUnwindSafe(body).catch_unwind().await;
    let removed = remove(s, id, paths).await;
    match outcome {
        Err(panic) => {
            if let Err(why) = removed {
                eprintln!("conformance: {}: {why}", s.check());
            }
            resume_unwind(panic);
        }
        Ok(()) => {
            if let Err(why) = removed {
                panic!("[{}] {why}", s.check());
            }
        }
    }
}

async fn remove(s: &Session<'_>, id: &str, paths: &[&str]) -> Result<(), String> {
    if !s.h.runs_processes() || !s.capabilities().await.exec {
        return Ok(());
    }
    let mut command = vec!["rm".to_string(), "-rf".to_string()];
    command.extend(paths.iter().map(|p| p.to_string()));
    let what = format!("removing {paths:?} in {id}");
    let run = async {
        let mut stream = s.try_exec(id, command).await.map_err(|e| e.to_string())?;
        let mut exit = None;
        while let Some(item) = stream.next().await {
            if let Some(pb::exec_output::Chunk::Exit(e)) = item.map_err(|e| e.to_string())?.chunk {
                exit = Some(e.code);
            }
        }
        match exit {
            Some(0) => Ok(()),
            other => Err(format!("rm -rf exited {other:?}")),
        }
    };
    match timeout(s.h.call_timeout(), run).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {:?}", s.h.call_timeout())),
    }
}

/// One entry of a tree on this machine, as a copy must keep it.
#[derive(Debug, PartialEq, Eq)]
enum Node {
    Dir {
        mode: u32,
    },
    /// `mtime` in whole seconds: what a tar header keeps.
    File {
        mode: u32,
        mtime: u64,
        data: Vec<u8>,
    },
    Symlink {
        target: PathBuf,
    },
}

impl Node {
    /// In a few words, without 300 KiB of data.
    fn describe(&self) -> String {
        match self {
            Node::Dir { mode } => format!("directory {mode:o}"),
            Node::File { mode, mtime, data } => {
                format!("file {mode:o}, {} bytes, mtime {mtime}", data.len())
            }
            Node::Symlink { target } => format!("symlink to {}", target.display()),
        }
    }
}

/// Every entry below `root` (and `root` itself, as ""), by relative path.
fn read_tree(check: &str, root: &Path) -> BTreeMap<PathBuf, Node> {
    let mut nodes = BTreeMap::new();
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        let path = root.join(&rel);
        let node = read_node(&path, &rel, &mut todo)
            .unwrap_or_else(|e| panic!("[{check}] reading {}: {e}", path.display()));
        nodes.insert(rel, node);
    }
    nodes
}

/// The entry at `path`; a directory's entries are added to `todo`, relative as `rel` is.
fn read_node(path: &Path, rel: &Path, todo: &mut Vec<PathBuf>) -> std::io::Result<Node> {
    let meta = std::fs::symlink_metadata(path)?;
    let mode = meta.permissions().mode() & 0o7777;
    Ok(if meta.file_type().is_symlink() {
        Node::Symlink {
            target: std::fs::read_link(path)?,
        }
    } else if meta.is_dir() {
        for entry in std::fs::read_dir(path)? {
            todo.push(rel.join(entry?.file_name()));
        }
        Node::Dir { mode }
    } else {
        Node::File {
            mode,
            mtime: meta
                .modified()?
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            data: std::fs::read(path)?,
        }
    })
}

/// Makes the tree the round trip copies, at `root`: a nested directory with a file, an
/// executable of mode 0750, a relative symlink to the nested file and a 300 KiB file with an
/// old modification time.
fn make_tree(check: &str, root: &Path) {
    let write = |rel: &str, data: &[u8], mode: u32| {
        let path = root.join(rel);
        std::fs::write(&path, data)
            .and_then(|()| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)))
            .unwrap_or_else(|e| panic!("[{check}] writing {}: {e}", path.display()));
    };
    let nested = root.join("nested/deeper");
    std::fs::create_dir_all(&nested)
        .unwrap_or_else(|e| panic!("[{check}] making {}: {e}", nested.display()));
    for (dir, mode) in [("", 0o755), ("nested", 0o750), ("nested/deeper", 0o700)] {
        let path = root.join(dir);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
            .unwrap_or_else(|e| panic!("[{check}] chmod {}: {e}", path.display()));
    }
    write("nested/deeper/leaf.txt", b"a leaf\n", 0o644);
    write("run.sh", b"#!/bin/sh\necho run\n", 0o750);
    write("big.bin", &noise(BIG_FILE), 0o600);
    let big = root.join("big.bin");
    std::fs::File::options()
        .write(true)
        .open(&big)
        .and_then(|f| f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(MTIME_SECS)))
        .unwrap_or_else(|e| panic!("[{check}] setting the mtime of {}: {e}", big.display()));
    let link = root.join("link");
    std::os::unix::fs::symlink("nested/deeper/leaf.txt", &link)
        .unwrap_or_else(|e| panic!("[{check}] making the symlink {}: {e}", link.display()));
}

/// What differs between the tree sent and the tree that came back, one line per entry.
fn tree_differences(sent: &BTreeMap<PathBuf, Node>, back: &BTreeMap<PathBuf, Node>) -> Vec<String> {
    let mut lines = Vec::new();
    for (rel, want) in sent {
        match back.get(rel) {
            None => lines.push(format!(
                "{}: missing ({} sent)",
                rel.display(),
                want.describe()
            )),
            Some(got) if got != want => {
                let data = match (want, got) {
                    (Node::File { data: w, .. }, Node::File { data: g, .. }) if w != g => {
                        format!("; {}", first_difference(g, w))
                    }
                    _ => String::new(),
                };
                lines.push(format!(
                    "{}: sent {}, came back {}{data}",
                    rel.display(),
                    want.describe(),
                    got.describe()
                ));
            }
            Some(_) => {}
        }
    }
    for (rel, got) in back {
        if !sent.contains_key(rel) {
            lines.push(format!(
                "{}: not sent, came back {}",
                rel.display(),
                got.describe()
            ));
        }
    }
    lines
}

/// A tree copied into a running sandbox at a new path (so: as that path) and copied out
/// again comes back as it was sent: every file byte-exact (a 300 KiB one across the agent's
/// frames), every mode (a 0750 file, 0750 and 0700 directories), the big file's mtime and
/// the symlink's target, and its root named after the path. Needs `copy`.
pub async fn copy_round_trips_a_tree(h: &dyn DriverHarness) {
    run_check(h, "copy_round_trips_a_tree", |s| {
        Box::pin(round_trip_body(s))
    })
    .await;
}

async fn round_trip_body(s: &mut Session<'_>) {
    if needs(s, Needs::Copy).await.is_none() {
        return;
    }
    let id = s.create_running("alpha", "demo", 1).await.sandbox_id;
    let dest = scratch_path();
    removing(s, &id, &[&dest], round_trip(s, &id, &dest)).await;
}

async fn round_trip(s: &Session<'_>, id: &str, dest: &str) {
    let check = s.check();
    let local = tempfile::tempdir().unwrap_or_else(|e| panic!("[{check}] a temp dir: {e}"));
    let tree = local.path().join("tree");
    make_tree(check, &tree);
    let sent = read_tree(check, &tree);
    let tar = pack(check, &tree);
    if let Err(e) = try_copy_to(s, id, dest, &tar).await {
        panic!(
            "[{check}] copy_to {dest} (a new path) of a {} byte tar failed: {e}",
            tar.len()
        );
    }
    let back = try_copy_from(s, id, dest)
        .await
        .unwrap_or_else(|e| panic!("[{check}] copy_from {dest} after copy_to failed: {e}"));
    let out = local.path().join("back");
    std::fs::create_dir(&out).unwrap_or_else(|e| panic!("[{check}] making {}: {e}", out.display()));
    sbx_agent::archive::unpack(&back[..], &out).unwrap_or_else(|e| {
        panic!(
            "[{check}] unpacking the {} bytes copy_from {dest} answered: {e}",
            back.len()
        )
    });
    let name = Path::new(dest).file_name().unwrap_or_default();
    let roots: Vec<_> = std::fs::read_dir(&out)
        .unwrap_or_else(|e| panic!("[{check}] reading {}: {e}", out.display()))
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    assert_eq!(
        roots,
        [name],
        "[{check}] the tar of copy_from {dest} must be rooted at the path's name"
    );
    let got = read_tree(check, &out.join(name));
    let differences = tree_differences(&sent, &got);
    assert!(
        differences.is_empty(),
        "[{check}] the tree copied to {dest} and back differs from the one sent:\n  {}",
        differences.join("\n  ")
    );
}

/// What a copy must refuse: an archive entry `../NAME` or `/tmp/NAME` unpacked into an
/// existing directory is `InvalidArgument`, and writes nothing (copying `NAME` out again is
/// the error of a missing path); copy_from a missing path is `InvalidArgument` naming it;
/// either copy on a stopped sandbox is `FailedPrecondition` unless the driver has
/// `copy_when_stopped`. Needs `copy`.
pub async fn copy_refuses_escapes_and_missing_paths(h: &dyn DriverHarness) {
    run_check(h, "copy_refuses_escapes_and_missing_paths", |s| {
        Box::pin(refuses_body(s))
    })
    .await;
}

async fn refuses_body(s: &mut Session<'_>) {
    let check = s.check();
    if needs(s, Needs::Copy).await.is_none() {
        return;
    }
    let id = s.create_running("alpha", "demo", 1).await.sandbox_id;
    let dest = scratch_path();
    let dotdot = format!("{dest}-dotdot");
    let absolute = format!("{dest}-absolute");
    removing(
        s,
        &id,
        &[&dest, &dotdot, &absolute],
        refuses(s, &id, &dest, &dotdot, &absolute),
    )
    .await;

    s.stop(&id).await;
    if s.capabilities().await.copy_when_stopped {
        // Copies of a stopped sandbox: copy_reaches_a_stopped_sandboxs_files.
        return;
    }
    let local = tempfile::tempdir().unwrap_or_else(|e| panic!("[{check}] a temp dir: {e}"));
    let tar = pack(check, local.path());
    let to = try_copy_to(s, &id, &dest, &tar).await;
    assert!(
        matches!(to, Err(DriverError::FailedPrecondition(_))),
        "[{check}] copy_to a stopped sandbox must be FailedPrecondition, got {to:?}"
    );
    let from = try_copy_from(s, &id, SCRATCH).await;
    assert!(
        matches!(from, Err(DriverError::FailedPrecondition(_))),
        "[{check}] copy_from a stopped sandbox must be FailedPrecondition, got {:?}",
        from.map(|tar| format!("{} bytes of tar", tar.len()))
    );
}

async fn refuses(s: &Session<'_>, id: &str, dest: &str, dotdot: &str, absolute: &str) {
    let check = s.check();
    // An empty directory first, so that dest exists and the hostile entries go into it.
    let local = tempfile::tempdir().unwrap_or_else(|e| panic!("[{check}] a temp dir: {e}"));
    let empty = pack(check, local.path());
    if let Err(e) = try_copy_to(s, id, dest, &empty).await {
        panic!("[{check}] copy_to {dest} of an empty directory failed: {e}");
    }
    // dotdot is dest's sibling: `../` its name, from inside dest.
    let up = format!("../{}", dotdot.rsplit('/').next().unwrap_or(dotdot));
    for (entry, lands) in [(up.as_str(), dotdot), (absolute, absolute)] {
        let tar = hostile(&[(entry, "escaped\n")]);
        let answer = try_copy_to(s, id, dest, &tar).await;
        assert!(
            matches!(answer, Err(DriverError::InvalidArgument(_))),
            "[{check}] copy_to {dest} (a directory) of a tar with the entry {entry:?} must be \
             InvalidArgument, got {answer:?}"
        );
        let escaped = try_copy_from(s, id, lands).await;
        assert!(
            matches!(&escaped, Err(DriverError::InvalidArgument(m)) if m.contains(lands)),
            "[{check}] after the refused entry {entry:?}, copy_from {lands} must be the \
             InvalidArgument of a missing path, naming it; got {:?}",
            escaped.map(|tar| format!("{} bytes of tar: the entry was written", tar.len()))
        );
    }
}

/// An input stream the check writes to while the connection is open.
/// A sandbox created `stopped` is Stopped and runs nothing until a start; with
/// `copy_when_stopped`, a file copied in before the first start is there when the workload
/// runs, and is copied out again after a stop; a symlink the workload left pointing at a host
/// directory leads a stopped copy nowhere outside the sandbox (the host directory stays
/// empty). Without `copy_when_stopped`, copy_to a stopped sandbox is `FailedPrecondition`.
pub async fn copy_reaches_a_stopped_sandboxs_files(h: &dyn DriverHarness) {
    run_check(h, "copy_reaches_a_stopped_sandboxs_files", |s| {
        Box::pin(stopped_body(s))
    })
    .await;
}

async fn stopped_body(s: &mut Session<'_>) {
    let check = s.check();
    let mut req = s.create_request("alpha", "made", s.h.long_running_spec(), 1);
    req.stopped = true;
    let id = req.sandbox_id.clone();
    let made = s.create(req).await;
    assert_eq!(
        made.state,
        pb::State::Stopped as i32,
        "[{check}] a create with stopped must answer a Stopped sandbox, got {made:?}"
    );
    sleep(Duration::from_millis(300)).await;
    let still = s.get(&id).await;
    assert_eq!(
        still.state,
        pb::State::Stopped as i32,
        "[{check}] a sandbox created stopped must not start by itself, got {still:?}"
    );
    let caps = s.capabilities().await;
    if !caps.copy {
        eprintln!("conformance: {check}: the copies skip: the driver reports no copy");
        s.start(&id, 2).await;
        s.wait_for_state(&id, pb::State::Running).await;
        return;
    }
    let local = tempfile::tempdir().unwrap_or_else(|e| panic!("[{check}] a temp dir: {e}"));
    let up = local.path().join("up");
    std::fs::create_dir(&up).unwrap_or_else(|e| panic!("[{check}] making {}: {e}", up.display()));
    std::fs::write(up.join("f"), "before the first start\n")
        .unwrap_or_else(|e| panic!("[{check}] writing a file: {e}"));
    std::fs::set_permissions(up.join("f"), std::fs::Permissions::from_mode(0o640))
        .unwrap_or_else(|e| panic!("[{check}] chmod: {e}"));
    let tar = pack(check, &up);
    let copied = try_copy_to(s, &id, "/sandbox", &tar).await;
    if !caps.copy_when_stopped {
        assert!(
            matches!(copied, Err(DriverError::FailedPrecondition(_))),
            "[{check}] copy_to a stopped sandbox without copy_when_stopped must be \
             FailedPrecondition, got {copied:?}"
        );
        return;
    }
    copied.unwrap_or_else(|e| panic!("[{check}] copy_to /sandbox of a sandbox made stopped: {e}"));
    s.start(&id, 2).await;
    s.wait_for_state(&id, pb::State::Running).await;
    let host_dir = tempfile::tempdir().unwrap_or_else(|e| panic!("[{check}] a temp dir: {e}"));
    if caps.exec && s.h.runs_processes() {
        let cat = s
            .exec(&id, vec!["cat".into(), "/sandbox/up/f".into()])
            .await;
        assert_eq!(
            (cat.exit_code, cat.stdout.as_str()),
            (Some(0), "before the first start\n"),
            "[{check}] the file copied in before the first start, read by the workload: {cat:?}"
        );
        let ln = s
            .exec(
                &id,
                vec![
                    "ln".into(),
                    "-s".into(),
                    host_dir.path().display().to_string(),
                    "/sandbox/esc".into(),
                ],
            )
            .await;
        assert_eq!(
            ln.exit_code,
            Some(0),
            "[{check}] planting a symlink: {ln:?}"
        );
    }
    s.stop(&id).await;
    let back = try_copy_from(s, &id, "/sandbox/up/f")
        .await
        .unwrap_or_else(|e| panic!("[{check}] copy_from /sandbox/up/f after a stop: {e}"));
    let out = local.path().join("back");
    std::fs::create_dir(&out).unwrap_or_else(|e| panic!("[{check}] making {}: {e}", out.display()));
    sbx_agent::archive::unpack(&back[..], &out)
        .unwrap_or_else(|e| panic!("[{check}] unpacking what copy_from answered: {e}"));
    let f = out.join("f");
    assert_eq!(
        std::fs::read_to_string(&f).ok().as_deref(),
        Some("before the first start\n"),
        "[{check}] copy_from a stopped sandbox"
    );
    let mode = std::fs::metadata(&f).map(|m| m.permissions().mode() & 0o7777);
    assert_eq!(
        mode.ok(),
        Some(0o640),
        "[{check}] the mode copied in and out"
    );
    // Through the planted symlink: whatever the copy answers, nothing reaches the host.
    let payload = pack(check, &up);
    for dest in ["/sandbox/esc", "/sandbox/esc/up"] {
        let answer = try_copy_to(s, &id, dest, &payload).await;
        eprintln!("conformance: {check}: copy_to {dest} through the planted symlink: {answer:?}");
        let on_host: Vec<_> = std::fs::read_dir(host_dir.path())
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.file_name())).collect())
            .unwrap_or_default();
        assert!(
            on_host.is_empty(),
            "[{check}] copy_to {dest} of a stopped sandbox, through a symlink to the host's {}, \
             wrote {on_host:?} there (the copy answered {answer:?})",
            host_dir.path().display()
        );
    }
}

fn forward_input() -> (
    mpsc::UnboundedSender<pb::PortForwardInput>,
    crate::ForwardInputStream,
) {
    let (tx, rx) = mpsc::unbounded();
    (tx, Box::pin(rx))
}

fn forward_request(id: &str, port: u16) -> pb::PortForwardStart {
    pb::PortForwardStart {
        sandbox_id: id.to_string(),
        port: u32::from(port),
    }
}

async fn try_forward(
    s: &Session<'_>,
    id: &str,
    port: u16,
    input: crate::ForwardInputStream,
) -> Result<DriverStream<pb::PortForwardOutput>, DriverError> {
    let what = format!("port_forward to {port} in {id}");
    s.call(
        &what,
        s.driver().port_forward(forward_request(id, port), input),
    )
    .await
}

/// With an echo server listening in the sandbox ([`DriverHarness::echo_server`]), a
/// forwarded connection carries 100 KiB there and back byte-exact: the data is sent, then
/// `close_write` (the input stream stays open), and what comes back is the same bytes, then
/// `closed`; once the input ends too, the stream ends. Needs `port_forward` and exec.
pub async fn port_forward_carries_bytes_both_ways(h: &dyn DriverHarness) {
    run_check(h, "port_forward_carries_bytes_both_ways", |s| {
        Box::pin(both_ways_body(s))
    })
    .await;
}

async fn both_ways_body(s: &mut Session<'_>) {
    let check = s.check();
    if needs(s, Needs::PortForwardAndExec).await.is_none() {
        return;
    }
    let Some(server) = s.h.echo_server(ECHO_PORT) else {
        eprintln!("conformance: {check} skipped: the harness has no echo server for this driver");
        return;
    };
    let id = s.create_running("alpha", "demo", 1).await.sandbox_id;
    let req = pb::ExecRequest {
        sandbox_id: id.clone(),
        command: server.clone(),
        ..Default::default()
    };
    // Held until the end: dropping it ends the server.
    let mut serving = s
        .call(
            &format!("exec {server:?}"),
            s.driver().exec_io(req, no_exec_input()),
        )
        .await
        .unwrap_or_else(|e| panic!("[{check}] exec of the echo server {server:?} failed: {e}"));

    // The server listens soon after the exec started: until then, FailedPrecondition.
    let (tx, mut output) = {
        let asked = Instant::now();
        loop {
            let (tx, input) = forward_input();
            match try_forward(s, &id, ECHO_PORT, input).await {
                Ok(output) => break (tx, output),
                Err(DriverError::FailedPrecondition(_)) if asked.elapsed() < PROMPTLY => {}
                Err(e) => {
                    let said = timeout(Duration::from_millis(500), serving.next()).await;
                    panic!(
                        "[{check}] port_forward to the echo server {server:?} on port \
                         {ECHO_PORT}, {:?} after its start: {e} (the server's first output: \
                         {said:?})",
                        asked.elapsed()
                    );
                }
            }
            sleep(Duration::from_millis(50)).await;
        }
    };

    let sent = noise(FORWARDED);
    let send = |input: Input| {
        tx.unbounded_send(pb::PortForwardInput { input: Some(input) })
            .unwrap_or_else(|_| panic!("[{check}] the driver dropped the forward's input"));
    };
    send(Input::Data(sent.clone()));
    send(Input::CloseWrite(true));
    let read = async {
        let mut back = Vec::new();
        loop {
            match output.next().await {
                Some(Ok(pb::PortForwardOutput {
                    output: Some(Output::Data(b)),
                })) => back.extend_from_slice(&b),
                Some(Ok(pb::PortForwardOutput {
                    output: Some(Output::Closed(true)),
                })) => return Ok(back),
                other => return Err((back, format!("{other:?}"))),
            }
        }
    };
    let back = match s.call("reading the forward until closed", read).await {
        Ok(back) => back,
        Err((back, other)) => panic!(
            "[{check}] after {} bytes of the {} sent came back, expected more data or closed, \
             got {other}",
            back.len(),
            sent.len()
        ),
    };
    assert!(
        back == sent,
        "[{check}] the echo server must send back the {} bytes sent, {} came: {}",
        sent.len(),
        back.len(),
        first_difference(&back, &sent)
    );

    // Both directions closed once the input ends: the stream ends, with nothing more.
    drop(tx);
    let rest = timeout(PROMPTLY, output.next()).await;
    assert!(
        matches!(rest, Ok(None)),
        "[{check}] after closed, and the input ended, the forward's stream must end within \
         {PROMPTLY:?}; got {rest:?}"
    );
    drop(serving);
}

/// A port nobody listens on is `FailedPrecondition` naming the port, within the call's
/// deadline; so is a forward to a stopped sandbox. Needs `port_forward`.
pub async fn port_forward_to_a_closed_port_fails(h: &dyn DriverHarness) {
    run_check(h, "port_forward_to_a_closed_port_fails", |s| {
        Box::pin(closed_port_body(s))
    })
    .await;
}

async fn closed_port_body(s: &mut Session<'_>) {
    let check = s.check();
    if needs(s, Needs::PortForward).await.is_none() {
        return;
    }
    let id = s.create_running("alpha", "demo", 1).await.sandbox_id;
    let (_tx, input) = forward_input();
    let answer = try_forward(s, &id, CLOSED_PORT, input).await;
    let port = CLOSED_PORT.to_string();
    assert!(
        matches!(&answer, Err(DriverError::FailedPrecondition(m)) if m.contains(&port)),
        "[{check}] port_forward to port {CLOSED_PORT}, where nothing listens, must be \
         FailedPrecondition naming the port, got {:?}",
        answer.map(|_| "a connection")
    );

    s.stop(&id).await;
    let (_tx, input) = forward_input();
    let answer = try_forward(s, &id, CLOSED_PORT, input).await;
    assert!(
        matches!(&answer, Err(DriverError::FailedPrecondition(_))),
        "[{check}] port_forward to a stopped sandbox must be FailedPrecondition, got {:?}",
        answer.map(|_| "a connection")
    );
}

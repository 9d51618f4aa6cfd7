//! Keeps the sandbox's processes out of each other's descriptors and memory: the main process
//! and every exec each run in a Landlock domain of their own.
//!
//! Every process of a sandbox runs as the same user, and the kernel lets a process read and
//! write the memory (`/proc/<pid>/mem`), open the descriptors (`/proc/<pid>/fd/N`) and read
//! the environment of any dumpable process of its own user. Without more, the workload could
//! read an operator's `exec -i` stdin from the exec's pipe, write into a terminal exec's
//! output, patch the memory of a command an operator runs, or read the credentials an exec
//! got in its environment — and one exec could do the same to another.
//!
//! Landlock (Linux 5.13+) adds a rule to every such access (the kernel's "ptrace access
//! check", which `/proc/<pid>/{mem,fd,environ,cwd,root,maps}` and `ptrace` itself go through):
//! a process in a Landlock domain reaches only processes of its own domain or of domains
//! nested in it. So `sbx-agent run` puts the main process into a domain of its own before it
//! becomes the command, and the agent puts each exec into another, in the child between fork
//! and exec. Siblings' domains are not nested in each other: the workload and each exec
//! reach their own processes (and what those start) and nothing else of the sandbox — not an
//! exec, not the agent, not the loggers, not the init. The agent itself is in no domain.
//!
//! The domain restricts nothing else. A ruleset denies what it *handles* and does not grant,
//! so it handles only what it must and grants all of it beneath `/`: executing a file (the
//! one right every Landlock ABI has, so that the ruleset is not empty) and, from ABI 2 on,
//! `REFER` — the right to link or rename a file into another directory. `REFER` is the one
//! right the kernel handles in every ruleset whether it is named or not: a domain that does
//! not grant it refuses every cross-directory `link(2)` and `rename(2)` with `EXDEV`, which
//! breaks `git clone` of a local repository, `git push` to a bare one and `mv`'s rename (it
//! falls back to a copy without a word). Every other right of later ABIs (truncate, device
//! ioctls, the network, scoping of signals and abstract sockets) is handled only when named,
//! and none is. A process may add domains of its own inside it (Landlock stacks them).
//!
//! What the workload still sees of an exec, and why: that it runs and its command line (`ps`
//! reads `/proc/<pid>/cmdline` and `stat`, which the kernel shows every process of the same
//! pid namespace), and it can signal it (the same user may; an operator's `kill` in an exec
//! must reach the workload the same way). Not its descriptors, memory, environment or
//! working directory.
//!
//! Written against the system calls, not a library: what runs between fork and exec must be
//! async-signal-safe (no allocation, no lock) — two system calls on a ruleset made before the
//! fork — which a library's builder does not promise.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::libc;

/// `LANDLOCK_ACCESS_FS_EXECUTE` (ABI 1).
const ACCESS_FS_EXECUTE: u64 = 1;
/// `LANDLOCK_ACCESS_FS_REFER` (ABI 2): handled by every ruleset of an ABI that has it.
const ACCESS_FS_REFER: u64 = 1 << 13;
/// `LANDLOCK_CREATE_RULESET_VERSION`: `landlock_create_ruleset` answers the kernel's ABI.
const CREATE_RULESET_VERSION: u32 = 1;
/// `LANDLOCK_RULE_PATH_BENEATH`.
const RULE_PATH_BENEATH: libc::c_int = 1;

/// `struct landlock_ruleset_attr` as Landlock's first version has it (its later fields are
/// optional: a shorter struct is the first version's).
#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
}

/// `struct landlock_path_beneath_attr` (packed, as the kernel declares it).
#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

/// A ruleset from which each [`Domain::enter`] makes a new domain.
#[derive(Debug)]
pub struct Domain {
    ruleset: OwnedFd,
}

/// The rights a ruleset of Landlock ABI `abi` handles, all of them granted beneath `/`:
/// executing, and linking or renaming across directories where the ABI has that right (see
/// the module docs).
pub fn handled_rights(abi: i64) -> u64 {
    if abi >= 2 {
        ACCESS_FS_EXECUTE | ACCESS_FS_REFER
    } else {
        ACCESS_FS_EXECUTE
    }
}

/// The kernel's Landlock ABI version. An error when the kernel has no Landlock.
#[allow(unsafe_code)]
pub fn abi() -> io::Result<i64> {
    // SAFETY: with a null attribute and size 0, the version flag makes the call a query
    // that reads and writes no memory.
    let version = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<RulesetAttr>(),
            0usize,
            CREATE_RULESET_VERSION,
        )
    };
    if version < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(version)
}

impl Domain {
    /// The ruleset ([`handled_rights`] of the kernel's ABI, granted beneath `/`). An error
    /// when the kernel has no Landlock (`ENOSYS`, or `EOPNOTSUPP` when it is built in but
    /// off): see [`unsupported`].
    #[allow(unsafe_code)]
    pub fn new() -> io::Result<Domain> {
        let rights = handled_rights(abi()?);
        let attr = RulesetAttr {
            handled_access_fs: rights,
        };
        // SAFETY: `attr` is a live, initialised `landlock_ruleset_attr` of the size passed;
        // the kernel only reads it. The result is a new descriptor (close-on-exec) or -1.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_landlock_create_ruleset,
                &attr as *const RulesetAttr,
                std::mem::size_of::<RulesetAttr>(),
                0u32,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
        let ruleset = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let root = rustix::fs::open(
            "/",
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )?;
        let rule = PathBeneathAttr {
            allowed_access: rights,
            parent_fd: root.as_raw_fd(),
        };
        // SAFETY: both descriptors are open and ours; `rule` is a live, initialised
        // `landlock_path_beneath_attr`, only read by the kernel.
        let added = unsafe {
            libc::syscall(
                libc::SYS_landlock_add_rule,
                ruleset.as_raw_fd(),
                RULE_PATH_BENEATH,
                &rule as *const PathBeneathAttr,
                0u32,
            )
        };
        if added < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Domain { ruleset })
    }

    /// The ruleset's descriptor, for [`enter_raw`] in a forked child.
    pub fn raw(&self) -> RawFd {
        self.ruleset.as_raw_fd()
    }

    /// The calling thread enters a new domain of this ruleset (and sets `no_new_privs`,
    /// which Landlock requires of a process without `CAP_SYS_ADMIN`; the sandbox's processes
    /// have it already).
    pub fn enter(&self) -> io::Result<()> {
        enter_raw(self.raw())
    }
}

/// [`Domain::enter`] on a ruleset descriptor: two system calls, nothing allocated — safe
/// between fork and exec.
#[allow(unsafe_code)]
pub fn enter_raw(ruleset: RawFd) -> io::Result<()> {
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS) takes integers only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: landlock_restrict_self takes a descriptor and flags; a bad descriptor is EBADF.
    if unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset, 0u32) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `e` says the kernel has no Landlock (not built, or not enabled at boot).
pub fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// Inside a domain, a file is linked and renamed into another directory (`REFER`, which
    /// every ruleset of ABI 2 and later handles, is granted), and a file still runs. On a
    /// ruleset that handles only executing, both fail with `EXDEV` (what broke `git clone`).
    /// A thread of its own enters the domain (Landlock confines the calling thread) and ends.
    #[test]
    fn in_a_domain_links_and_renames_cross_directories() {
        let domain = match Domain::new() {
            Ok(domain) => domain,
            Err(e) if unsupported(&e) => {
                eprintln!("no Landlock on this kernel: {e}");
                return;
            }
            Err(e) => panic!("a ruleset: {e}"),
        };
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir_all(a.join("deeper")).unwrap();
        std::fs::create_dir(&b).unwrap();
        std::fs::write(a.join("f"), b"data").unwrap();
        std::fs::write(a.join("deeper/g"), b"more").unwrap();
        let (a2, b2) = (a.clone(), b.clone());
        let results = std::thread::spawn(move || {
            domain.enter().unwrap();
            [
                std::fs::hard_link(a2.join("f"), b2.join("linked")),
                std::fs::rename(a2.join("f"), b2.join("renamed")),
                std::fs::rename(a2.join("deeper"), b2.join("moved-dir")),
                std::process::Command::new("true").status().map(|_| ()),
            ]
        })
        .join()
        .unwrap();
        for (what, result) in ["link", "rename", "rename of a directory", "exec"]
            .iter()
            .zip(&results)
        {
            assert!(
                result.is_ok(),
                "{what} across directories in a domain: {result:?}"
            );
        }
        assert_eq!(std::fs::read(b.join("linked")).unwrap(), b"data");
        assert_eq!(std::fs::read(b.join("renamed")).unwrap(), b"data");
        assert_eq!(std::fs::read(b.join("moved-dir/g")).unwrap(), b"more");
    }

    /// The rights a ruleset handles follow the ABI: `REFER` from 2 on, never anything that
    /// would deny more than executing.
    #[test]
    fn the_handled_rights_follow_the_abi() {
        assert_eq!(handled_rights(1), ACCESS_FS_EXECUTE);
        for abi in 2..=7 {
            assert_eq!(handled_rights(abi), ACCESS_FS_EXECUTE | ACCESS_FS_REFER);
        }
    }

    /// A child in a domain of its own cannot open the descriptors or enter the working
    /// directory of a process outside it (its parent, the test: the same user, dumpable, so
    /// both would open without the domain), and can still run programs; the test reads its
    /// child's. (Not `environ` or `maps`: a caller with `CAP_PERFMON`, as a test run as root
    /// has, reads those past any ptrace check; no sandbox process has it.) Skipped (and said)
    /// where the kernel has no Landlock.
    #[test]
    fn a_process_in_a_domain_cannot_open_what_is_outside_it() {
        let domain = match Domain::new() {
            Ok(domain) => domain,
            Err(e) if unsupported(&e) => {
                eprintln!("no Landlock on this kernel: {e}");
                return;
            }
            Err(e) => panic!("a ruleset: {e}"),
        };
        let me = std::process::id();
        let script = format!(
            "cat /proc/{me}/fd/0 </dev/null >/dev/null 2>&1 && echo fd-open; \
             ls /proc/{me}/cwd/ >/dev/null 2>&1 && echo cwd-open; \
             echo ran; exec sleep 5"
        );
        let ruleset = domain.raw();
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", &script])
            .stdout(std::process::Stdio::piped());
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure only makes the two system calls of `enter_raw`.
        #[allow(unsafe_code)]
        unsafe {
            cmd.pre_exec(move || enter_raw(ruleset));
        }
        let mut child = cmd.spawn().unwrap();
        // The parent (in no domain) reaches into the child.
        let child_fd = format!("/proc/{}/environ", child.id());
        let mut reached = false;
        for _ in 0..50 {
            if std::fs::read(&child_fd).is_ok_and(|e| !e.is_empty()) {
                reached = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let mut out = String::new();
        use std::io::Read;
        let mut stdout = child.stdout.take().unwrap();
        let mut buf = [0u8; 64];
        while !out.contains("ran") {
            let n = stdout.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            out.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(reached, "the parent could not read its child's environment");
        assert_eq!(
            out.trim(),
            "ran",
            "the confined child reached outside: {out}"
        );
    }
}

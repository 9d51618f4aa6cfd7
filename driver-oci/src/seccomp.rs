//! The default seccomp profile of an oci sandbox: deny by default (EPERM), allow the system
//! calls ordinary programs make — the usual container allowlist — and nothing that changes
//! the machine or reaches across the sandbox's boundary.
//!
//! Refused on purpose (absent from [`ALLOWED`]): mounting and the new mount API (`mount`,
//! `umount2`, `fsopen`, `open_tree`, …), new or joined namespaces (`unshare`, `setns`, and
//! `clone` with any `CLONE_NEW*` flag), keyrings (`keyctl`, `add_key`, `request_key`), `bpf`,
//! `perf_event_open`, `userfaultfd`, process inspection across processes (`ptrace`,
//! `process_vm_readv`/`writev`, `kcmp`, `pidfd_getfd`), kernel modules and kexec, `reboot`,
//! swap, clocks, `pivot_root`, `acct`, `quotactl`, `open_by_handle_at`, `io_uring_*`,
//! `syslog`, raw I/O ports and the NUMA policy calls. `clone3` answers ENOSYS, so the C
//! library falls back to `clone`, whose flags seccomp can inspect (clone3 passes them in
//! memory, which a filter cannot read).
//!
//! Sockets of the families ordinary programs use, and no others ([`SOCKET_FAMILIES`]): local
//! (`AF_UNIX`), IPv4 and IPv6 (`AF_INET`, `AF_INET6`) and netlink (`AF_NETLINK`: `ip`, and
//! glibc's `getaddrinfo` asks it which address families the host has). Every other family is
//! answered `EAFNOSUPPORT`, as a kernel built without it would answer, so a program that
//! probes falls back. Among them `AF_VSOCK`, which would let a sandbox bind and listen in the
//! host's vsock space, outside its network namespace and the sandbox network's rules, and the
//! families with a long record of kernel bugs and no use in a sandbox (`AF_ALG`, `AF_KEY`,
//! `AF_PACKET` — refused by the kernel too without `CAP_NET_RAW` over the host's network
//! namespace —, `AF_BLUETOOTH`, `AF_RDS`, `AF_TIPC`, `AF_XDP`, …). The family is compared
//! as the whole 64-bit argument: a value with high bits set, which the kernel would truncate
//! to an allowed `int`, matches nothing allowed. `socketpair` makes `AF_UNIX` pairs only.
//!
//! The profile is for x86-64 (and its x32 ABI), not for 32-bit x86: an i386 program makes its
//! sockets through `socketcall`, whose arguments are in memory where no filter can read them,
//! so the family could not be checked there (libseccomp drops the condition: every family
//! would open). A 32-bit x86 program in an oci sandbox is therefore killed at its first system
//! call (the filter's action for an architecture it does not list).
//!
//! Names the host's libseccomp does not know are skipped by the runtime, so the list can
//! name calls newer than some kernels.

use oci_spec::runtime::{
    Arch, LinuxSeccomp, LinuxSeccompAction, LinuxSeccompArgBuilder, LinuxSeccompBuilder,
    LinuxSeccompOperator, LinuxSyscall, LinuxSyscallBuilder,
};

/// `CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER |
/// CLONE_NEWPID | CLONE_NEWNET`: a `clone` with any of these is refused.
pub const CLONE_NAMESPACE_FLAGS: u64 = 0x0002_0000 | 0x7C00_0000 | 0x0200_0000;

/// `EPERM`, the answer to a refused call.
const EPERM: u32 = 1;
/// `ENOSYS`, the answer to `clone3`.
const ENOSYS: u32 = 38;
/// `EAFNOSUPPORT`, the answer to a socket of a family not in [`SOCKET_FAMILIES`].
const EAFNOSUPPORT: u32 = 97;

/// The socket families a sandbox may open (see the module docs): `AF_UNIX`, `AF_INET`,
/// `AF_INET6`, `AF_NETLINK`.
pub const SOCKET_FAMILIES: &[u64] = &[1, 2, 10, 16];
/// `AF_UNIX`, the one family `socketpair` may make.
const AF_UNIX: u64 = 1;

/// The system calls allowed without conditions.
pub const ALLOWED: &[&str] = &[
    "accept",
    "accept4",
    "access",
    "alarm",
    "arch_prctl",
    "bind",
    "brk",
    "cachestat",
    "capget",
    "capset",
    "chdir",
    "chmod",
    "chown",
    "chroot",
    "clock_getres",
    "clock_gettime",
    "clock_nanosleep",
    "close",
    "close_range",
    "connect",
    "copy_file_range",
    "creat",
    "dup",
    "dup2",
    "dup3",
    "epoll_create",
    "epoll_create1",
    "epoll_ctl",
    "epoll_pwait",
    "epoll_pwait2",
    "epoll_wait",
    "eventfd",
    "eventfd2",
    "execve",
    "execveat",
    "exit",
    "exit_group",
    "faccessat",
    "faccessat2",
    "fadvise64",
    "fallocate",
    "fanotify_mark",
    "fchdir",
    "fchmod",
    "fchmodat",
    "fchmodat2",
    "fchown",
    "fchownat",
    "fcntl",
    "fdatasync",
    "fgetxattr",
    "flistxattr",
    "flock",
    "fork",
    "fremovexattr",
    "fsetxattr",
    "fstat",
    "fstatfs",
    "fsync",
    "ftruncate",
    "futex",
    "futex_requeue",
    "futex_wait",
    "futex_waitv",
    "futex_wake",
    "futimesat",
    "getcpu",
    "getcwd",
    "getdents",
    "getdents64",
    "getegid",
    "geteuid",
    "getgid",
    "getgroups",
    "getitimer",
    "getpeername",
    "getpgid",
    "getpgrp",
    "getpid",
    "getppid",
    "getpriority",
    "getrandom",
    "getresgid",
    "getresuid",
    "getrlimit",
    "get_robust_list",
    "getrusage",
    "getsid",
    "getsockname",
    "getsockopt",
    "get_thread_area",
    "gettid",
    "gettimeofday",
    "getuid",
    "getxattr",
    "inotify_add_watch",
    "inotify_init",
    "inotify_init1",
    "inotify_rm_watch",
    "io_cancel",
    "ioctl",
    "io_destroy",
    "io_getevents",
    "io_pgetevents",
    "ioprio_get",
    "ioprio_set",
    "io_setup",
    "io_submit",
    "kill",
    "landlock_add_rule",
    "landlock_create_ruleset",
    "landlock_restrict_self",
    "lchown",
    "lgetxattr",
    "link",
    "linkat",
    "listen",
    "listxattr",
    "llistxattr",
    "lremovexattr",
    "lseek",
    "lsetxattr",
    "lstat",
    "madvise",
    "map_shadow_stack",
    "membarrier",
    "memfd_create",
    "memfd_secret",
    "mincore",
    "mkdir",
    "mkdirat",
    "mknod",
    "mknodat",
    "mlock",
    "mlock2",
    "mlockall",
    "mmap",
    "mprotect",
    "mq_getsetattr",
    "mq_notify",
    "mq_open",
    "mq_timedreceive",
    "mq_timedsend",
    "mq_unlink",
    "mremap",
    "msgctl",
    "msgget",
    "msgrcv",
    "msgsnd",
    "msync",
    "munlock",
    "munlockall",
    "munmap",
    "nanosleep",
    "newfstatat",
    "open",
    "openat",
    "openat2",
    "pause",
    "pidfd_open",
    "pidfd_send_signal",
    "pipe",
    "pipe2",
    "pkey_alloc",
    "pkey_free",
    "pkey_mprotect",
    "poll",
    "ppoll",
    "prctl",
    "pread64",
    "preadv",
    "preadv2",
    "prlimit64",
    "process_mrelease",
    "pselect6",
    "pwrite64",
    "pwritev",
    "pwritev2",
    "read",
    "readahead",
    "readlink",
    "readlinkat",
    "readv",
    "recvfrom",
    "recvmmsg",
    "recvmsg",
    "remap_file_pages",
    "removexattr",
    "rename",
    "renameat",
    "renameat2",
    "restart_syscall",
    "rmdir",
    "rseq",
    "rt_sigaction",
    "rt_sigpending",
    "rt_sigprocmask",
    "rt_sigqueueinfo",
    "rt_sigreturn",
    "rt_sigsuspend",
    "rt_sigtimedwait",
    "rt_tgsigqueueinfo",
    "sched_getaffinity",
    "sched_getattr",
    "sched_getparam",
    "sched_get_priority_max",
    "sched_get_priority_min",
    "sched_getscheduler",
    "sched_rr_get_interval",
    "sched_setaffinity",
    "sched_setattr",
    "sched_setparam",
    "sched_setscheduler",
    "sched_yield",
    "seccomp",
    "select",
    "semctl",
    "semget",
    "semop",
    "semtimedop",
    "sendfile",
    "sendmmsg",
    "sendmsg",
    "sendto",
    "setfsgid",
    "setfsuid",
    "setgid",
    "setgroups",
    "setitimer",
    "setpgid",
    "setpriority",
    "setregid",
    "setresgid",
    "setresuid",
    "setreuid",
    "setrlimit",
    "set_robust_list",
    "setsid",
    "setsockopt",
    "set_thread_area",
    "set_tid_address",
    "setuid",
    "setxattr",
    "shmat",
    "shmctl",
    "shmdt",
    "shmget",
    "shutdown",
    "sigaltstack",
    "signalfd",
    "signalfd4",
    "splice",
    "stat",
    "statfs",
    "statx",
    "symlink",
    "symlinkat",
    "sync",
    "sync_file_range",
    "syncfs",
    "sysinfo",
    "tee",
    "tgkill",
    "time",
    "timer_create",
    "timer_delete",
    "timer_getoverrun",
    "timer_gettime",
    "timer_settime",
    "timerfd_create",
    "timerfd_gettime",
    "timerfd_settime",
    "times",
    "tkill",
    "truncate",
    "umask",
    "uname",
    "unlink",
    "unlinkat",
    "utime",
    "utimensat",
    "utimes",
    "vfork",
    "vmsplice",
    "wait4",
    "waitid",
    "write",
    "writev",
];

/// `personality` is allowed only for these personas (Linux, 32-bit, UNAME26, and the query
/// 0xffffffff); the rest (ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC) weaken the process.
const PERSONAS: &[u64] = &[0x0, 0x8, 0x2_0000, 0x2_0008, 0xffff_ffff];

/// The profile, as the runtime config takes it.
pub fn default_profile() -> LinuxSeccomp {
    let mut syscalls = vec![rule(
        ALLOWED,
        LinuxSeccompAction::ScmpActAllow,
        None,
        Vec::new(),
    )];
    // clone: allowed when none of the namespace flags is set.
    syscalls.push(rule(
        &["clone"],
        LinuxSeccompAction::ScmpActAllow,
        None,
        vec![(
            0,
            CLONE_NAMESPACE_FLAGS,
            Some(0),
            LinuxSeccompOperator::ScmpCmpMaskedEq,
        )],
    ));
    syscalls.push(rule(
        &["clone3"],
        LinuxSeccompAction::ScmpActErrno,
        Some(ENOSYS),
        Vec::new(),
    ));
    // socket: the allowed families; every other answers EAFNOSUPPORT (the numbers between
    // and around them, one rule each below the highest allowed, and one rule for the rest).
    for family in SOCKET_FAMILIES {
        syscalls.push(rule(
            &["socket"],
            LinuxSeccompAction::ScmpActAllow,
            None,
            vec![(0, *family, None, LinuxSeccompOperator::ScmpCmpEq)],
        ));
    }
    let highest = *SOCKET_FAMILIES.iter().max().expect("families are listed");
    for family in (0..highest).filter(|f| !SOCKET_FAMILIES.contains(f)) {
        syscalls.push(rule(
            &["socket"],
            LinuxSeccompAction::ScmpActErrno,
            Some(EAFNOSUPPORT),
            vec![(0, family, None, LinuxSeccompOperator::ScmpCmpEq)],
        ));
    }
    syscalls.push(rule(
        &["socket"],
        LinuxSeccompAction::ScmpActErrno,
        Some(EAFNOSUPPORT),
        vec![(0, highest, None, LinuxSeccompOperator::ScmpCmpGt)],
    ));
    syscalls.push(rule(
        &["socketpair"],
        LinuxSeccompAction::ScmpActAllow,
        None,
        vec![(0, AF_UNIX, None, LinuxSeccompOperator::ScmpCmpEq)],
    ));
    for persona in PERSONAS {
        syscalls.push(rule(
            &["personality"],
            LinuxSeccompAction::ScmpActAllow,
            None,
            vec![(0, *persona, None, LinuxSeccompOperator::ScmpCmpEq)],
        ));
    }
    LinuxSeccompBuilder::default()
        .default_action(LinuxSeccompAction::ScmpActErrno)
        .default_errno_ret(EPERM)
        // Not ScmpArchX86: see the module docs (socketcall).
        .architectures(vec![Arch::ScmpArchX86_64, Arch::ScmpArchX32])
        .syscalls(syscalls)
        .build()
        .expect("the seccomp profile is complete")
}

fn rule(
    names: &[&str],
    action: LinuxSeccompAction,
    errno: Option<u32>,
    args: Vec<(usize, u64, Option<u64>, LinuxSeccompOperator)>,
) -> LinuxSyscall {
    let mut builder = LinuxSyscallBuilder::default()
        .names(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
        .action(action);
    if let Some(errno) = errno {
        builder = builder.errno_ret(errno);
    }
    if !args.is_empty() {
        let args = args
            .into_iter()
            .map(|(index, value, value_two, op)| {
                let arg = LinuxSeccompArgBuilder::default()
                    .index(index)
                    .value(value)
                    .op(op);
                match value_two {
                    Some(two) => arg.value_two(two),
                    None => arg,
                }
                .build()
                .expect("a seccomp argument is complete")
            })
            .collect::<Vec<_>>();
        builder = builder.args(args);
    }
    builder.build().expect("a seccomp rule is complete")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calls that must never be allowed, each a way across the boundary.
    const REFUSED: &[&str] = &[
        "mount",
        "umount2",
        "unshare",
        "setns",
        "keyctl",
        "add_key",
        "request_key",
        "bpf",
        "ptrace",
        "process_vm_readv",
        "process_vm_writev",
        "init_module",
        "finit_module",
        "delete_module",
        "kexec_load",
        "reboot",
        "pivot_root",
        "open_by_handle_at",
        "perf_event_open",
        "userfaultfd",
        "fsopen",
        "fsmount",
        "move_mount",
        "open_tree",
        "swapon",
        "io_uring_setup",
        "clock_settime",
        "settimeofday",
        "syslog",
        "iopl",
        // Allowed only with arguments (see `socket_families_are_fenced`).
        "socket",
        "socketpair",
    ];

    #[test]
    fn the_boundary_calls_are_not_allowed_and_nothing_is_listed_twice() {
        for name in REFUSED {
            assert!(!ALLOWED.contains(name), "{name} must be refused");
        }
        let mut sorted = ALLOWED.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ALLOWED.len(), "a call is listed twice");
    }

    #[test]
    fn the_profile_denies_by_default_and_fences_clone() {
        let json = serde_json::to_value(default_profile()).unwrap();
        assert_eq!(json["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(json["defaultErrnoRet"], 1);
        let rules = json["syscalls"].as_array().unwrap();
        let clone = rules
            .iter()
            .find(|r| r["names"] == serde_json::json!(["clone"]))
            .unwrap();
        assert_eq!(clone["args"][0]["value"], CLONE_NAMESPACE_FLAGS);
        assert_eq!(clone["args"][0]["valueTwo"], 0);
        assert_eq!(clone["args"][0]["op"], "SCMP_CMP_MASKED_EQ");
        // CLONE_NEWUSER (0x10000000) and CLONE_NEWNS (0x20000) are among the fenced flags.
        assert_ne!(CLONE_NAMESPACE_FLAGS & 0x1000_0000, 0);
        assert_ne!(CLONE_NAMESPACE_FLAGS & 0x0002_0000, 0);
        let clone3 = rules
            .iter()
            .find(|r| r["names"] == serde_json::json!(["clone3"]))
            .unwrap();
        assert_eq!(clone3["errnoRet"], 38);
    }

    /// `socket` is allowed for the listed families alone, compared exactly; every other
    /// family below the highest has an EAFNOSUPPORT rule and the rest one above it; AF_VSOCK
    /// (40) is among the refused; `socketpair` makes AF_UNIX pairs only.
    #[test]
    fn socket_families_are_fenced() {
        let json = serde_json::to_value(default_profile()).unwrap();
        let rules = json["syscalls"].as_array().unwrap();
        let socket: Vec<_> = rules
            .iter()
            .filter(|r| r["names"] == serde_json::json!(["socket"]))
            .collect();
        let mut allowed = Vec::new();
        let mut refused_exactly = Vec::new();
        let mut refused_above = None;
        for r in &socket {
            let arg = &r["args"][0];
            assert_eq!(arg["index"], 0, "{r}");
            let value = arg["value"].as_u64().unwrap();
            match (r["action"].as_str().unwrap(), arg["op"].as_str().unwrap()) {
                ("SCMP_ACT_ALLOW", "SCMP_CMP_EQ") => allowed.push(value),
                ("SCMP_ACT_ERRNO", "SCMP_CMP_EQ") => {
                    assert_eq!(r["errnoRet"], 97);
                    refused_exactly.push(value)
                }
                ("SCMP_ACT_ERRNO", "SCMP_CMP_GT") => {
                    assert_eq!(r["errnoRet"], 97);
                    refused_above = Some(value)
                }
                other => panic!("an unexpected socket rule {other:?}: {r}"),
            }
        }
        allowed.sort_unstable();
        assert_eq!(allowed, [1, 2, 10, 16]);
        let above = refused_above.expect("a rule for every family above the allowed");
        for family in 0..=64u64 {
            let refused = refused_exactly.contains(&family) || family > above;
            assert_ne!(
                allowed.contains(&family),
                refused,
                "family {family} is both or neither allowed and refused"
            );
        }
        assert!(40 > above, "AF_VSOCK (40) must be refused");
        // No i386: its socketcall would hide the family from every rule above.
        assert_eq!(
            json["architectures"],
            serde_json::json!(["SCMP_ARCH_X86_64", "SCMP_ARCH_X32"])
        );
        let pair: Vec<_> = rules
            .iter()
            .filter(|r| r["names"] == serde_json::json!(["socketpair"]))
            .collect();
        assert_eq!(pair.len(), 1);
        assert_eq!(pair[0]["action"], "SCMP_ACT_ALLOW");
        assert_eq!(pair[0]["args"][0]["value"], 1);
        assert_eq!(pair[0]["args"][0]["op"], "SCMP_CMP_EQ");
    }
}

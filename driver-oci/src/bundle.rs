//! The OCI runtime config (`config.json`) of a sandbox's run, and the process config of an
//! exec. Pure: inputs in, a `Spec` out; tested as data.
//!
//! The boundary is on by default, with the defaults a container user expects:
//! - a user namespace mapping the sandbox's uids 0..size to the host's `host_uid..`, so root
//!   inside is an unprivileged uid on the host (files it writes are owned by that uid);
//! - its own pid, mount, uts, ipc, net (loopback only) and cgroup namespaces;
//! - the runtime-default capability set (within the user namespace), no inheritable or
//!   ambient capabilities, `no_new_privs`;
//! - the default seccomp profile ([`super::seccomp`]);
//! - masked and read-only `/proc` and `/sys` paths, `/sys` and the cgroup tree read-only;
//! - cgroup limits for cpu, memory and pids (a fork bomb stays inside).

use std::path::Path;

use oci_spec::runtime::{
    Capabilities, Capability, Linux, LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder,
    LinuxDeviceCgroupBuilder, LinuxIdMappingBuilder, LinuxMemoryBuilder, LinuxNamespace,
    LinuxNamespaceBuilder, LinuxNamespaceType, LinuxPidsBuilder, LinuxResources,
    LinuxResourcesBuilder, Mount, MountBuilder, Process, ProcessBuilder, RootBuilder, Spec,
    SpecBuilder, UserBuilder,
};

use sbx_images::IdMap;

/// Where the sandbox init (a static busybox and its script) appears inside.
pub const INIT_MOUNT: &str = "/dev/.sbx";
/// The file of the run directory bound at `/etc/hostname` (the sandbox's name and a newline).
pub const HOSTNAME_FILE: &str = "hostname";
/// The init's own scratch directory inside (its FIFOs and the stop mark): a small tmpfs of
/// the sandbox's, which host code never opens.
pub const RUN_MOUNT: &str = "/dev/.sbx-run";
/// Where the persistent volume appears inside.
pub const VOLUME_MOUNT: &str = "/sandbox";

/// The CFS period, in microseconds.
const CPU_PERIOD_US: u64 = 100_000;
/// The smallest CFS quota the kernel takes, in microseconds.
const CPU_MIN_QUOTA_US: i64 = 1_000;

/// The runtime-default capability set (within the sandbox's user namespace).
const CAPABILITIES: &[Capability] = &[
    Capability::Chown,
    Capability::DacOverride,
    Capability::Fsetid,
    Capability::Fowner,
    Capability::Mknod,
    Capability::NetRaw,
    Capability::Setgid,
    Capability::Setuid,
    Capability::Setfcap,
    Capability::Setpcap,
    Capability::NetBindService,
    Capability::SysChroot,
    Capability::Kill,
    Capability::AuditWrite,
];

/// Paths of `/proc` and `/sys` that a sandbox cannot read.
const MASKED: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

/// Paths of `/proc` a sandbox can read but not write.
const READ_ONLY: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

pub use sbx_agent::user::ProcessUser;

/// What one run of a sandbox is made of.
#[derive(Debug, Clone)]
pub struct RunSpec<'a> {
    pub hostname: &'a str,
    /// The container's process: the init and its arguments.
    pub args: Vec<String>,
    pub env: Vec<String>,
    pub cwd: &'a str,
    pub user: ProcessUser,
    pub id_map: IdMap,
    pub cgroup_path: &'a str,
    pub cpu_millis: u32,
    pub memory_bytes: u64,
    pub pids_limit: i64,
    /// The most ptys the sandbox's own `/dev/pts` holds (`host::ptys`).
    pub max_ptys: u32,
    pub volume: &'a Path,
    pub init_dir: &'a Path,
    pub run_dir: &'a Path,
    /// The exec devpts instance's mount on the host, bound at `host::ptys::EXEC_PTS_MOUNT`.
    pub exec_pts: &'a Path,
    /// The network namespace to join (the gateway's network); `None`: a new one, loopback
    /// only.
    pub netns: Option<&'a Path>,
}

/// The process of a run or of an exec: argv, environment, directory, user, and the same
/// capabilities and `no_new_privs` either way (resource limits are the driver's own).
pub fn process(args: Vec<String>, env: Vec<String>, cwd: &str, user: &ProcessUser) -> Process {
    let caps: Capabilities = CAPABILITIES.iter().copied().collect();
    let capabilities = LinuxCapabilitiesBuilder::default()
        .bounding(caps.clone())
        .effective(caps.clone())
        .permitted(caps)
        .inheritable(Capabilities::new())
        .ambient(Capabilities::new())
        .build()
        .expect("capabilities are complete");
    let mut user_builder = UserBuilder::default().uid(user.uid).gid(user.gid);
    if !user.additional_gids.is_empty() {
        user_builder = user_builder.additional_gids(user.additional_gids.clone());
    }
    ProcessBuilder::default()
        .terminal(false)
        .user(user_builder.build().expect("a user is complete"))
        .args(args)
        .env(env)
        .cwd(cwd)
        .capabilities(capabilities)
        .no_new_privileges(true)
        .build()
        .expect("a process is complete")
}

fn mount(destination: &str, typ: &str, source: &str, options: &[&str]) -> Mount {
    MountBuilder::default()
        .destination(destination)
        .typ(typ)
        .source(source)
        .options(options.iter().map(|o| o.to_string()).collect::<Vec<_>>())
        .build()
        .expect("a mount is complete")
}

fn bind(destination: &str, source: &Path, options: &[&str]) -> Mount {
    let mut all = vec!["rbind"];
    all.extend_from_slice(options);
    mount(destination, "bind", &source.to_string_lossy(), &all)
}

/// The runtime config of one run.
pub fn runtime_config(run: &RunSpec<'_>) -> Spec {
    SpecBuilder::default()
        .version("1.0.2")
        .root(
            RootBuilder::default()
                .path("rootfs")
                .readonly(false)
                .build()
                .expect("a root is complete"),
        )
        .hostname(run.hostname)
        .process(process(
            run.args.clone(),
            run.env.clone(),
            run.cwd,
            &run.user,
        ))
        .mounts(mounts(run))
        .linux(linux(run))
        .build()
        .expect("a runtime config is complete")
}

/// The run's mounts: the kernel's file systems, the sandbox's volume, its init and exec
/// terminals, its run directory, its hostname and (on the gateway's network) its resolver.
fn mounts(run: &RunSpec<'_>) -> Vec<Mount> {
    let max_ptys = format!("max={}", run.max_ptys);
    let mut mounts = vec![
        mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"]),
        mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        ),
        mount(
            "/dev/pts",
            "devpts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
                "gid=5",
                // Mounted inside the container's mount namespace, the instance cannot take
                // the host's reserve of ptys; `max` keeps one sandbox from the others' share.
                &max_ptys,
            ],
        ),
        mount(
            "/dev/shm",
            "tmpfs",
            "shm",
            &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        ),
        mount(
            "/dev/mqueue",
            "mqueue",
            "mqueue",
            &["nosuid", "noexec", "nodev"],
        ),
        // A sysfs mount needs the network namespace to belong to the container's user
        // namespace; the gateway's network gives a namespace host root made (so that the
        // workload holds no capability over it), and the kernel then refuses sysfs. The host's
        // /sys, bound read-only and without its submounts, stands in: the same devices, and
        // the host's interface names under /sys/class/net. Recursive: inside a user namespace
        // the kernel refuses a bind that would uncover what the host's submounts cover; the
        // cgroup mount below goes on top of the host's /sys/fs/cgroup.
        match run.netns {
            None => mount(
                "/sys",
                "sysfs",
                "sysfs",
                &["nosuid", "noexec", "nodev", "ro"],
            ),
            Some(_) => mount(
                "/sys",
                "bind",
                "/sys",
                &["rbind", "nosuid", "noexec", "nodev", "ro"],
            ),
        },
        mount(
            "/sys/fs/cgroup",
            "cgroup",
            "cgroup",
            &["nosuid", "noexec", "nodev", "relatime", "ro"],
        ),
        bind(VOLUME_MOUNT, run.volume, &["rw", "nosuid", "nodev"]),
        bind(INIT_MOUNT, run.init_dir, &["ro", "nosuid", "nodev"]),
        bind(
            sbx_host_kit::ptys::EXEC_PTS_MOUNT,
            run.exec_pts,
            &["nosuid", "noexec"],
        ),
        mount(
            RUN_MOUNT,
            "tmpfs",
            "tmpfs",
            &[
                "nosuid",
                "nodev",
                "noexec",
                "mode=0700",
                &format!("uid={}", run.user.uid),
                &format!("gid={}", run.user.gid),
                "size=64k",
            ],
        ),
        // `cat /etc/hostname` agrees with `hostname`: the image's file (if any) would name
        // the machine it was built on. Read-only: the name is the sandbox's, set at create.
        bind(
            "/etc/hostname",
            &run.run_dir.join(HOSTNAME_FILE),
            &["ro", "nosuid", "nodev", "noexec"],
        ),
    ];
    // On the gateway's network, names resolve through the gateway's resolver, which answers
    // those the sandbox's policy holds: the image's file would name resolvers it cannot
    // reach. Read-only, like the rest of what the network is.
    if run.netns.is_some() {
        mounts.push(bind(
            "/etc/resolv.conf",
            &run.run_dir.join(sbx_host_kit::sandbox_network::RESOLV_FILE),
            &["ro", "nosuid", "nodev", "noexec"],
        ));
    }
    mounts
}

/// The run's `linux` section: its user namespace's id mappings, its namespaces, its cgroup
/// and limits, the masked and read-only paths and the seccomp profile.
fn linux(run: &RunSpec<'_>) -> Linux {
    let id_mapping = |host: u32| {
        vec![
            LinuxIdMappingBuilder::default()
                .container_id(0u32)
                .host_id(host)
                .size(run.id_map.size)
                .build()
                .expect("an id mapping is complete"),
        ]
    };
    LinuxBuilder::default()
        .uid_mappings(id_mapping(run.id_map.host_uid))
        .gid_mappings(id_mapping(run.id_map.host_gid))
        .namespaces(namespaces(run))
        .cgroups_path(run.cgroup_path)
        .resources(resources(run))
        .masked_paths(MASKED.iter().map(|p| p.to_string()).collect::<Vec<_>>())
        .readonly_paths(READ_ONLY.iter().map(|p| p.to_string()).collect::<Vec<_>>())
        .seccomp(super::seccomp::default_profile())
        .build()
        .expect("the linux section is complete")
}

/// The run's namespaces: all new, but the network's when the gateway's network gave one.
fn namespaces(run: &RunSpec<'_>) -> Vec<LinuxNamespace> {
    [
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Mount,
        LinuxNamespaceType::Network,
        LinuxNamespaceType::Cgroup,
        LinuxNamespaceType::User,
    ]
    .into_iter()
    .map(|typ| {
        let mut ns = LinuxNamespaceBuilder::default().typ(typ);
        if let (LinuxNamespaceType::Network, Some(path)) = (typ, run.netns) {
            ns = ns.path(path.to_path_buf());
        }
        ns.build().expect("a namespace is complete")
    })
    .collect::<Vec<_>>()
}

/// The run's limits: no devices, its pids, and its memory and cpu when it asks for them.
fn resources(run: &RunSpec<'_>) -> LinuxResources {
    let mut resources = LinuxResourcesBuilder::default()
        .devices(vec![
            LinuxDeviceCgroupBuilder::default()
                .allow(false)
                .access("rwm")
                .build()
                .expect("a device rule is complete"),
        ])
        .pids(
            LinuxPidsBuilder::default()
                .limit(run.pids_limit)
                .build()
                .expect("a pids limit is complete"),
        );
    if run.memory_bytes > 0 {
        let limit = i64::try_from(run.memory_bytes).unwrap_or(i64::MAX);
        resources = resources.memory(
            LinuxMemoryBuilder::default()
                .limit(limit)
                .build()
                .expect("a memory limit is complete"),
        );
    }
    if run.cpu_millis > 0 {
        let quota = (i64::from(run.cpu_millis) * CPU_PERIOD_US as i64 / 1000).max(CPU_MIN_QUOTA_US);
        resources = resources.cpu(
            LinuxCpuBuilder::default()
                .quota(quota)
                .period(CPU_PERIOD_US)
                .build()
                .expect("a cpu limit is complete"),
        );
    }
    resources.build().expect("resources are complete")
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn sample() -> (PathBuf, PathBuf, PathBuf) {
        ("/s/volume".into(), "/s/init".into(), "/s/run-1".into())
    }

    fn config(memory_bytes: u64, cpu_millis: u32) -> serde_json::Value {
        let (volume, init, run) = sample();
        let spec = runtime_config(&RunSpec {
            hostname: "web",
            args: vec!["/dev/.sbx/busybox".into(), "sh".into()],
            env: vec!["PATH=/bin".into()],
            cwd: "/",
            user: ProcessUser::default(),
            id_map: IdMap {
                host_uid: 200_000,
                host_gid: 300_000,
                size: 65_536,
            },
            cgroup_path: "/sbx-oci/x",
            cpu_millis,
            memory_bytes,
            pids_limit: 512,
            max_ptys: 128,
            volume: &volume,
            init_dir: &init,
            run_dir: &run,
            exec_pts: std::path::Path::new("/s/exec-pts"),
            netns: None,
        });
        serde_json::to_value(spec).unwrap()
    }

    #[test]
    fn the_boundary_is_in_the_config() {
        let c = config(64 << 20, 500);
        let ns: Vec<&str> = c["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["type"].as_str().unwrap())
            .collect();
        for wanted in ["pid", "ipc", "uts", "mount", "network", "cgroup", "user"] {
            assert!(ns.contains(&wanted), "namespace {wanted} missing: {ns:?}");
        }
        assert_eq!(c["linux"]["uidMappings"][0]["hostID"], 200_000);
        assert_eq!(c["linux"]["uidMappings"][0]["containerID"], 0);
        assert_eq!(c["linux"]["gidMappings"][0]["hostID"], 300_000);
        assert_eq!(c["process"]["noNewPrivileges"], true);
        let bounding = c["process"]["capabilities"]["bounding"].as_array().unwrap();
        assert!(!bounding.iter().any(|c| c == "CAP_SYS_ADMIN"));
        assert!(bounding.iter().any(|c| c == "CAP_CHOWN"));
        assert_eq!(
            c["process"]["capabilities"]["ambient"],
            serde_json::json!([])
        );
        assert_eq!(c["linux"]["seccomp"]["defaultAction"], "SCMP_ACT_ERRNO");
        assert!(
            c["linux"]["readonlyPaths"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p == "/proc/sysrq-trigger")
        );
        assert!(
            c["linux"]["maskedPaths"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p == "/proc/kcore")
        );
        assert_eq!(c["linux"]["resources"]["pids"]["limit"], 512);
        assert_eq!(c["linux"]["resources"]["memory"]["limit"], 64 << 20);
        assert_eq!(c["linux"]["resources"]["cpu"]["quota"], 50_000);
        assert_eq!(c["linux"]["resources"]["cpu"]["period"], 100_000);
        assert_eq!(c["hostname"], "web");
        let sys = c["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["destination"] == "/sys")
            .unwrap();
        assert!(sys["options"].as_array().unwrap().iter().any(|o| o == "ro"));
        let volume = c["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["destination"] == VOLUME_MOUNT)
            .unwrap();
        assert_eq!(volume["source"], "/s/volume");
    }

    #[test]
    fn no_limits_are_written_when_none_are_asked_and_tiny_cpu_is_raised() {
        let c = config(0, 0);
        assert!(c["linux"]["resources"].get("memory").is_none());
        assert!(c["linux"]["resources"].get("cpu").is_none());
        // The pids limit is always there.
        assert_eq!(c["linux"]["resources"]["pids"]["limit"], 512);
        let c = config(0, 1);
        assert_eq!(c["linux"]["resources"]["cpu"]["quota"], 1_000);
    }
}

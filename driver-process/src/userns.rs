//! The user namespace a workload runs in: uid and gid 0 inside, host ids `BASE..BASE+SIZE`
//! outside (200000..265535 by default, the image store's [`IdMap`]), no capabilities and
//! `no_new_privs`.
//!
//! The sandbox's pid, mount, uts, ipc and net namespaces are made by host root (the launch, see
//! [`super::launch`]) and so belong to the host's user namespace; the workload's user namespace
//! is made inside them, last, and owns none of them. Root inside therefore holds no capability
//! over its own mounts, hostname or network: it cannot unmount `/proc` or the hidden paths,
//! `setns` into another namespace, or write a sysctl; and on the host's files it is host uid
//! BASE, a stranger (it cannot read `/etc/shadow`, write `/root` or a cgroup's `cgroup.procs`).
//! The main process and every exec'd command run as
//!
//! ```text
//! unshare --user --map-users=BASE,0,SIZE --map-groups=BASE,0,SIZE --setuid 0 --setgid 0 --
//!   setpriv --no-new-privs --bounding-set=-all --inh-caps=-all --ambient-caps=-all -- COMMAND…
//! ```
//!
//! `unshare` writes the maps through the setuid helpers `newuidmap`/`newgidmap` (Debian:
//! `uidmap`), which allow a range only when `/etc/subuid` and `/etc/subgid` grant it to root;
//! `--setgid 0` also drops the supplementary groups (root's host gid 0 among them). With an
//! empty bounding set a later `exec` of any program (setuid or file-capability ones too,
//! `no_new_privs` besides) gives no capability back. [`check`] finds at open what is missing
//! and says what to install or add.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use sbx_driver_api::DriverError;
use sbx_images::IdMap;

/// The programs and maps the jail is made with; passed to the launch and exec shells.
#[derive(Debug, Clone)]
pub struct Jail {
    pub unshare: PathBuf,
    pub setpriv: PathBuf,
    pub id_map: IdMap,
}

impl Jail {
    /// The arguments the shim takes first: `UNSHARE SETPRIV UID_MAP GID_MAP`, the maps (the
    /// sandbox's range `m`) as `unshare --map-users` wants them.
    pub fn shell_args(&self, m: &IdMap) -> [OsString; 4] {
        [
            self.unshare.clone().into(),
            self.setpriv.clone().into(),
            format!("{},0,{}", m.host_uid, m.size).into(),
            format!("{},0,{}", m.host_gid, m.size).into(),
        ]
    }
}

/// Checks, at open, what the jail needs: an id map that does not reach host root, the
/// programs, and the subordinate-id grants for root. The error says exactly what to do.
pub fn check(
    id_map: &IdMap,
    find: impl Fn(&str) -> Option<PathBuf>,
    subuid: &Path,
    subgid: &Path,
) -> Result<(), DriverError> {
    if id_map.size == 0 || id_map.host_uid == 0 || id_map.host_gid == 0 {
        return Err(DriverError::InvalidArgument(format!(
            "process driver id map {id_map:?}: it must be non-empty and start above host id 0 \
             (a map from 0 would run workloads as host root)"
        )));
    }
    let missing: Vec<&str> = ["newuidmap", "newgidmap"]
        .into_iter()
        .filter(|p| find(p).is_none())
        .collect();
    if !missing.is_empty() {
        return Err(DriverError::Unavailable(format!(
            "the process driver runs workloads in a user namespace and needs {} on PATH: \
             apt-get install uidmap",
            missing.join(" and ")
        )));
    }
    if find("setpriv").is_none() {
        return Err(DriverError::Unavailable(
            "the process driver drops every capability with `setpriv` and needs it on PATH: \
             apt-get install util-linux"
                .to_string(),
        ));
    }
    for (file, base) in [(subuid, id_map.host_uid), (subgid, id_map.host_gid)] {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        if !grants(&text, base, id_map.size) {
            return Err(DriverError::Unavailable(format!(
                "{} does not grant root the host ids {base}..{} the process driver maps its \
                 workloads to: echo root:{base}:{} >> {}",
                file.display(),
                u64::from(base) + u64::from(id_map.size) - 1,
                id_map.size,
                file.display()
            )));
        }
    }
    Ok(())
}

/// Whether a subordinate-id file (`name:start:count` lines) grants root (by name or uid 0)
/// the whole range `base..base+size` in one line, as `newuidmap` wants it.
fn grants(text: &str, base: u32, size: u32) -> bool {
    let want_end = u64::from(base) + u64::from(size);
    text.lines().any(|line| {
        let mut fields = line.trim().split(':');
        let (Some(owner), Some(start), Some(count)) = (fields.next(), fields.next(), fields.next())
        else {
            return false;
        };
        let (Ok(start), Ok(count)) = (start.parse::<u64>(), count.parse::<u64>()) else {
            return false;
        };
        matches!(owner, "root" | "0") && start <= u64::from(base) && start + count >= want_end
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subordinate_id_lines_must_cover_the_whole_map_for_root() {
        assert!(grants("root:200000:65536\n", 200_000, 65_536));
        assert!(grants(
            "alice:100000:65536\n0:100000:200000\n",
            200_000,
            65_536
        ));
        assert!(!grants("", 200_000, 65_536));
        assert!(!grants("alice:200000:65536\n", 200_000, 65_536));
        assert!(!grants("root:200000:65535\n", 200_000, 65_536));
        assert!(!grants("root:200001:65536\n", 200_000, 65_536));
        // Two lines that together cover the range are not one grant.
        assert!(!grants(
            "root:200000:30000\nroot:230000:35536\n",
            200_000,
            65_536
        ));
        assert!(!grants("root:x:65536\nroot\n", 200_000, 65_536));
    }

    #[test]
    fn open_says_what_to_install_or_add() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good");
        std::fs::write(&good, "root:200000:65536\n").unwrap();
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "").unwrap();
        let map = IdMap::default();
        let all = |_: &str| Some(PathBuf::from("/usr/bin/x"));
        check(&map, all, &good, &good).unwrap();

        let no_uidmap = |p: &str| (p == "setpriv").then(|| PathBuf::from("/usr/bin/setpriv"));
        let e = check(&map, no_uidmap, &good, &good)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("apt-get install uidmap") && e.contains("newuidmap"),
            "{e}"
        );

        let e = check(&map, all, &good, &empty).unwrap_err().to_string();
        assert!(
            e.contains(&format!("echo root:200000:65536 >> {}", empty.display())),
            "{e}"
        );
        let missing = dir.path().join("absent");
        let e = check(&map, all, &missing, &good).unwrap_err().to_string();
        assert!(e.contains(&missing.display().to_string()), "{e}");

        let root_map = IdMap {
            host_uid: 0,
            ..IdMap::default()
        };
        let e = check(&root_map, all, &good, &good).unwrap_err();
        assert!(matches!(e, DriverError::InvalidArgument(_)), "{e:?}");
    }
}

//! Shared by the oci driver's integration tests (root, runc and a static busybox needed): a
//! state dir, an image store holding the built-in busybox image and a cgroup parent of its
//! own per test, and the leak check every test ends with (no container, cgroup, mount or
//! process of the test left behind).

#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sbx_driver_api::{ComputeDriver, pb};
use sbx_driver_oci::{OciDriver, OciDriverOptions};
use sbx_images::{IdMap, ImageInfo, ImageStore};
use uuid::Uuid;

/// One test's world.
pub struct TestEnv {
    pub dir: tempfile::TempDir,
    pub images: ImageStore,
    pub image: ImageInfo,
    pub cgroup_parent: String,
    /// The driver's pids limit, when a test wants its own.
    pub pids_limit: Option<i64>,
    /// The driver's `log_max`, when a test sets one.
    pub log_max: Option<u64>,
    finished: bool,
}

impl Drop for TestEnv {
    /// A failed test must not leave containers behind for the next: kill and delete every
    /// container of the test's runtime root, unmount what is mounted under its dir.
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let root = self.state_dir().join("runc");
        let list = std::process::Command::new("runc")
            .arg("--root")
            .arg(&root)
            .args(["list", "-q"])
            .output();
        if let Ok(out) = list {
            for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = std::process::Command::new("runc")
                    .arg("--root")
                    .arg(&root)
                    .args(["delete", "--force", id])
                    .status();
            }
        }
        for mount in mounts_under(self.dir.path()) {
            let _ = nix::mount::umount2(Path::new(&mount), nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

impl TestEnv {
    pub fn new() -> TestEnv {
        let dir = tempfile::Builder::new()
            .prefix("sbx-oci-test-")
            .tempdir()
            .unwrap();
        // The sandboxes' host uid walks through the state dir to each rootfs.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        let images = ImageStore::open(dir.path().join("images"), IdMap::default()).unwrap();
        let image = images
            .import_busybox(&busybox(), "sbx.local/busybox:latest")
            .unwrap();
        TestEnv {
            dir,
            images,
            image,
            cgroup_parent: format!("sbx-test-{}", Uuid::new_v4().simple()),
            pids_limit: None,
            log_max: None,
            finished: false,
        }
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("oci")
    }

    pub fn options(&self) -> OciDriverOptions {
        OciDriverOptions {
            cgroup_parent: self.cgroup_parent.clone(),
            default_grace: Duration::from_secs(2),
            poll_interval: Duration::from_millis(50),
            pids_limit: self.pids_limit.unwrap_or(1024),
            log_max: self.log_max.unwrap_or(OciDriverOptions::default().log_max),
            ..OciDriverOptions::default()
        }
    }

    pub async fn open(&self) -> OciDriver {
        OciDriver::open(self.state_dir(), self.images.clone(), self.options())
            .await
            .unwrap()
    }

    /// A spec running `command` in the busybox image.
    pub fn spec(&self, command: &[&str]) -> pb::SandboxSpec {
        pb::SandboxSpec {
            command: command.iter().map(|s| s.to_string()).collect(),
            image: self.image.digest.clone(),
            ..Default::default()
        }
    }

    /// Deletes every sandbox (through a fresh driver), then asserts that nothing of the test
    /// is left: no runtime container, no cgroup under the parent, no mount under the dir, no
    /// process that mentions it.
    pub async fn finish(mut self) {
        let driver = self.open().await;
        for snapshot in driver.list().await.unwrap() {
            let req = pb::DeleteRequest {
                sandbox_id: snapshot.sandbox_id.clone(),
            };
            assert!(
                driver.delete(req).await.unwrap().deleted,
                "{}",
                snapshot.sandbox_id
            );
        }
        drop(driver);
        let out = std::process::Command::new("runc")
            .arg("--root")
            .arg(self.state_dir().join("runc"))
            .args(["list", "-q"])
            .output()
            .unwrap();
        let left = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(left.is_empty(), "runtime containers left: {left}");
        let cgroups = OciDriver::cgroup_leftovers(&self.cgroup_parent);
        assert!(cgroups.is_empty(), "cgroups left: {cgroups:?}");
        let mounts = mounts_under(self.dir.path());
        assert!(mounts.is_empty(), "mounts left: {mounts:?}");
        let sandboxes = std::fs::read_dir(self.state_dir().join("sandboxes"))
            .unwrap()
            .count();
        assert_eq!(sandboxes, 0, "sandbox directories left");
        self.finished = true;
        remove_cgroup_parent(&self.cgroup_parent);
    }
}

/// The static busybox the tests use (Debian's busybox-static).
pub fn busybox() -> PathBuf {
    ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect("these tests need busybox-static")
}

/// Mount points under `dir`, from this process's mount table.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let needle = dir.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.starts_with(&needle))
        .map(str::to_string)
        .collect()
}

/// The number of processes in sandbox `id`'s pids cgroup (v1 or v2), if it has one.
pub fn pids_current(parent: &str, id: Uuid) -> Option<u64> {
    ["/sys/fs/cgroup/pids", "/sys/fs/cgroup"]
        .iter()
        .find_map(|root| std::fs::read_to_string(format!("{root}/{parent}/{id}/pids.current")).ok())
        .and_then(|t| t.trim().parse().ok())
}

/// Removes the (empty) parent cgroup the runtime made in each hierarchy.
fn remove_cgroup_parent(parent: &str) {
    for entry in std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
    {
        let _ = std::fs::remove_dir(entry.path().join(parent));
    }
}

/// Runs `command` in sandbox `id` and returns (exit code, stdout, stderr).
pub async fn exec(driver: &dyn ComputeDriver, id: &str, command: &[&str]) -> (i32, String, String) {
    use futures::StreamExt;
    let mut stream = driver
        .exec(pb::ExecRequest {
            sandbox_id: id.to_string(),
            command: command.iter().map(|s| s.to_string()).collect(),
            timeout_seconds: 20,
            ..Default::default()
        })
        .await
        .unwrap();
    let (mut out, mut err, mut code) = (Vec::new(), Vec::new(), None);
    while let Some(item) = stream.next().await {
        match item.unwrap().chunk {
            Some(pb::exec_output::Chunk::Stdout(b)) => out.extend(b),
            Some(pb::exec_output::Chunk::Stderr(b)) => err.extend(b),
            Some(pb::exec_output::Chunk::Exit(e)) => code = Some(e.code),
            None => {}
        }
    }
    (
        code.expect("an exit"),
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    )
}

/// Creates sandbox `name` from `spec` under a new id.
pub async fn create(
    driver: &OciDriver,
    env: &TestEnv,
    name: &str,
    spec: pb::SandboxSpec,
) -> (Uuid, pb::Snapshot) {
    let id = Uuid::new_v4();
    let snapshot = driver
        .create(pb::CreateRequest {
            run_env: Default::default(),
            sandbox_id: id.to_string(),
            workspace: "ws".into(),
            name: name.into(),
            spec: Some(spec),
            generation: 1,
            stopped: false,
        })
        .await
        .unwrap_or_else(|e| panic!("create {name} in {}: {e}", env.state_dir().display()));
    (id, snapshot)
}

/// Waits (bounded) until the sandbox is in `state`.
pub async fn wait_for(driver: &OciDriver, id: Uuid, state: pb::State) -> pb::Snapshot {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let s = driver
            .get(pb::GetRequest {
                sandbox_id: id.to_string(),
            })
            .await
            .unwrap();
        if s.state == state as i32 {
            return s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "sandbox {id} not {state:?} in time: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

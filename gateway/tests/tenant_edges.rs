//! Where one tenant meets another, through the real `sbxd` (sim driver) with `--auth token` and
//! the real `sbx`: a grant holds the workspace it was made for, by id — not a workspace made
//! later under the same name.

mod common;

use std::path::Path;

use common::{CliRun, SBXD, Sbxd, run_bounded, sbx};

fn secured(data: &Path) -> Sbxd {
    Sbxd::start(data, "sim", &["--auth", "token"])
}

/// `sbxd token create` on `data`: the identity's token.
fn identity(data: &Path, name: &str, role: &str, workspaces: &[&str]) -> String {
    let mut command = common::sbxd_command();
    command
        .args(["token", "create", "--data-dir"])
        .arg(data)
        .args(["--name", name, "--role", role]);
    for w in workspaces {
        command.args(["--workspace", w]);
    }
    let made = run_bounded(&mut command, &format!("sbxd token create --name {name}"));
    assert_eq!(made.code, 0, "token create {name}: {made:?}");
    made.stdout.lines().last().unwrap_or_default().to_string()
}

fn sbx_as(endpoint: &str, token: &str, args: &[&str]) -> CliRun {
    let mut all = vec!["--token", token];
    all.extend_from_slice(args);
    sbx(endpoint, &all)
}

fn assert_denied(run: &CliRun, what: &str) {
    assert_eq!(run.code, 1, "{what}: {run:?}");
    assert!(
        run.stderr.contains("PERMISSION_DENIED") || run.stderr.to_lowercase().contains("not found"),
        "{what}: {run:?}"
    );
}

fn token_list(data: &Path) -> String {
    run_bounded(
        common::sbxd_command()
            .args(["token", "list", "--data-dir"])
            .arg(data),
        "sbxd token list",
    )
    .stdout
}

/// A token scoped to `wq` keeps nothing once `wq` is deleted: a new tenant's `wq` (its
/// sandbox by name, by id, in lists) is a stranger to it; a grant to a workspace that does not
/// exist holds nothing, even once one of that name is made; a scoped admin cannot make the
/// successor of its deleted workspace; an identities file from before ids is bound at start
/// to the workspaces then.
#[test]
fn a_grant_holds_its_workspace_not_a_later_one_of_the_same_name() {
    let data = tempfile::tempdir().unwrap();
    let d = secured(data.path());
    let ep = d.endpoint();
    let root = identity(data.path(), "root", "admin", &[]);
    sbx_as(&ep, &root, &["workspace", "create", "wq"]).ok();
    let ed = identity(data.path(), "ed", "editor", &["wq"]);
    let boss = identity(data.path(), "boss", "admin", &["wq"]);
    let early = identity(data.path(), "early", "editor", &["later"]);
    sbx_as(
        &ep,
        &ed,
        &[
            "sandbox", "create", "-w", "wq", "-n", "mine", "--", "sleep", "1000",
        ],
    )
    .ok();
    let listed = token_list(data.path());
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with("ed\t") && l.contains("wq (")),
        "the grant shows its workspace's id: {listed}"
    );

    // The tenant goes; another comes under the same name.
    sbx_as(&ep, &root, &["sandbox", "delete", "-w", "wq", "mine"]).ok();
    sbx_as(&ep, &root, &["workspace", "delete", "wq"]).ok();
    assert_denied(
        &sbx_as(&ep, &boss, &["workspace", "create", "wq"]),
        "the deleted workspace's scoped admin makes its successor",
    );
    sbx_as(&ep, &root, &["workspace", "create", "wq"]).ok();
    sbx_as(
        &ep,
        &root,
        &[
            "sandbox", "create", "-w", "wq", "-n", "theirs", "--", "sleep", "1000",
        ],
    )
    .ok();
    let theirs = sbx_as(
        &ep,
        &root,
        &["sandbox", "get", "-w", "wq", "theirs", "-o", "json"],
    )
    .json()["id"]
        .as_str()
        .unwrap()
        .to_string();
    for (who, token) in [("ed", &ed), ("boss", &boss)] {
        assert_denied(
            &sbx_as(&ep, token, &["sandbox", "list", "-w", "wq"]),
            &format!("{who} lists the new wq"),
        );
        assert_denied(
            &sbx_as(&ep, token, &["sandbox", "delete", "-w", "wq", "theirs"]),
            &format!("{who} deletes the new tenant's sandbox"),
        );
        assert_denied(
            &sbx_as(&ep, token, &["sandbox", "get", "--id", &theirs]),
            &format!("{who} gets the new tenant's sandbox by id"),
        );
        let all = sbx_as(&ep, token, &["sandbox", "list", "-A", "-o", "json"]);
        assert!(
            !all.stdout.contains("theirs"),
            "{who} sees the new tenant's sandbox in list -A: {all:?}"
        );
    }
    sbx_as(&ep, &root, &["sandbox", "get", "-w", "wq", "theirs"]).ok();

    // A grant to a workspace that did not exist is dead, also once one of the name is made.
    sbx_as(&ep, &root, &["workspace", "create", "later"]).ok();
    assert_denied(
        &sbx_as(&ep, &early, &["sandbox", "list", "-w", "later"]),
        "a grant made before its workspace",
    );

    // An identities file from before ids (names only) is bound at start to the workspaces of
    // those names then: the new wq, and nothing for a name no workspace has.
    drop(d);
    let file = data.path().join("auth/identities.json");
    let text = std::fs::read_to_string(&file).unwrap();
    let mut old: serde_json::Value = serde_json::from_str(&text).unwrap();
    old["format"] = 1.into();
    for id in old["identities"].as_array_mut().unwrap() {
        id.as_object_mut().unwrap().remove("workspace_ids");
    }
    if let Some(first) = old["identities"].as_array_mut().unwrap().first_mut() {
        assert_eq!(first["name"], "root");
    }
    std::fs::write(&file, serde_json::to_vec(&old).unwrap()).unwrap();
    let d = secured(data.path());
    let ep = d.endpoint();
    sbx_as(&ep, &ed, &["sandbox", "get", "-w", "wq", "theirs"]).ok();
    // Bound once: deleting and making wq again leaves it behind.
    sbx_as(&ep, &root, &["sandbox", "delete", "-w", "wq", "theirs"]).ok();
    sbx_as(&ep, &root, &["workspace", "delete", "wq"]).ok();
    sbx_as(&ep, &root, &["workspace", "create", "wq"]).ok();
    assert_denied(
        &sbx_as(&ep, &ed, &["sandbox", "list", "-w", "wq"]),
        "a migrated grant reaches the next wq",
    );
}

/// Another local user of the host (`nobody`) reads, runs and writes nothing of the gateway's
/// data dir while a sandbox with a credential in its environment restarts 20 times: not its
/// log, record, runtime config or disk image, not its files or a setuid binary it made in
/// `/sandbox`, not its root filesystem; and the credential appears nowhere it can read. Needs
/// root, runc, busybox-static and setpriv (oci, the default driver).
#[test]
fn another_local_user_reaches_nothing_of_an_oci_sandbox() {
    spied_on(
        "",
        &["--oci-cgroup-parent"],
        "drivers/oci/sandboxes",
        "disk/volume",
        &[
            "bundle/config.json",
            "disk.img",
            "disk/upper/etc/passwd",
            "bundle/rootfs/etc/passwd",
        ],
    );
}

/// The same for a `process` sandbox (its persistent directory is `root/`).
#[test]
fn another_local_user_reaches_nothing_of_a_process_sandbox() {
    // (The test harness gives every sbxd its process cgroup parent.)
    spied_on("process", &[], "drivers/process/sandboxes", "root", &[]);
}

/// A sandbox on `driver` (`cgroup_flag` names its cgroup parent) whose directory is under
/// `sandboxes`, its `/sandbox` at `volume` in it and `more` files of its own, restarted 20
/// times while `nobody` tries every path.
fn spied_on(driver: &str, cgroup_flag: &[&str], sandboxes: &str, volume: &str, more: &[&str]) {
    use std::os::unix::fs::PermissionsExt;
    let data = common::DataDir::new();
    // The data dir's parent lets others walk through, as /var/lib does.
    std::fs::set_permissions(data.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let parent = common::CgroupParent(format!("sbx-gateway-tests-private-{}", common::unique()));
    let mut flags: Vec<&str> = cgroup_flag.to_vec();
    if !flags.is_empty() {
        flags.push(&parent.0);
    }
    let d = Sbxd::start(data.path(), driver, &flags);
    let ep = d.endpoint();
    let secret = format!("sbx-credential-{}", common::unique());
    // Each start writes its files whole and renames them into place: at no moment is `cred`
    // there without the secret.
    let script = "echo \"token is $TOKEN\"; echo \"$TOKEN\" > /sandbox/.cred && \
                  mv /sandbox/.cred /sandbox/cred; cp /bin/busybox /sandbox/.sush && \
                  chmod 4755 /sandbox/.sush && mv /sandbox/.sush /sandbox/sush; \
                  chmod 777 /sandbox; exec sleep 3600";
    let env = format!("TOKEN={secret}");
    sbx(
        &ep,
        &[
            "sandbox", "create", "s", "--env", &env, "--", "sh", "-c", script,
        ],
    )
    .ok();
    let id = sbx(&ep, &["sandbox", "get", "s", "-o", "json"]).json()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let dir = data.path().join(sandboxes).join(&id);
    let volume = dir.join(volume);
    // Every path the spy tries, as a local user who learnt the sandbox's id (its cgroup names
    // it) would.
    let mut targets = vec![
        dir.join("workload.log"),
        dir.join("workload.log.1"),
        dir.join("sandbox.json"),
        volume.join("cred"),
        data.path().join("store/db"),
        data.path().join("secrets.key"),
    ];
    targets.extend(more.iter().map(|m| dir.join(m)));
    let stop = data.path().join("spy-stop");
    let loot = tempfile::tempdir().unwrap();
    std::fs::set_permissions(loot.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = loot.path().join("loot");
    let mut spy_script = format!("while [ ! -e {stop} ]; do\n", stop = stop.display());
    for t in &targets {
        spy_script.push_str(&format!(
            "  cat {t} 2>/dev/null | grep -q {secret} && echo 'read {t}' >> {out}\n  \
             [ -r {t} ] && echo 'readable {t}' >> {out}\n",
            t = t.display(),
            out = out.display()
        ));
    }
    spy_script.push_str(&format!(
        "  {volume}/sush id -u >/dev/null 2>&1 && echo 'ran the setuid binary' >> {out}\n  \
         touch {volume}/planted 2>/dev/null && echo 'planted' >> {out}\n  \
         ls {dir} >/dev/null 2>&1 && echo 'listed the sandbox dir' >> {out}\n  \
         echo round >> {out}.rounds\n  sleep 0.05\ndone\n",
        volume = volume.display(),
        dir = dir.display(),
        out = out.display()
    ));
    let mut spy = std::process::Command::new("setpriv")
        .args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            "sh",
            "-c",
        ])
        .arg(&spy_script)
        .spawn()
        .expect("setpriv (util-linux) runs the spy as nobody");
    for _ in 0..20 {
        sbx(&ep, &["sandbox", "restart", "s"]).ok();
    }
    std::fs::write(&stop, "").unwrap();
    let ended = common::wait_bounded(&mut spy, std::time::Duration::from_secs(30), "the spy");
    assert!(ended.code().is_some(), "{ended:?}");
    let rounds = std::fs::read_to_string(format!("{}.rounds", out.display())).unwrap_or_default();
    assert!(
        rounds.lines().count() >= 5,
        "the spy ran only {} rounds",
        rounds.lines().count()
    );
    let loot = std::fs::read_to_string(&out).unwrap_or_default();
    assert!(loot.is_empty(), "nobody reached into the sandbox: {loot}");
    // As root, the same paths hold the secret: the spy looked in the right places.
    assert!(
        std::fs::read_to_string(volume.join("cred"))
            .unwrap()
            .contains(&secret)
    );
    assert!(
        std::fs::read_to_string(dir.join("workload.log"))
            .unwrap()
            .contains(&secret)
    );
    sbx(&ep, &["sandbox", "delete", "s"]).ok();
    drop(d);
    if driver.is_empty() {
        common::assert_oci_left_nothing(data.path(), &parent.0);
    }
}

/// Every file under the image store's blobs and layers, with its size.
fn store_files(images: &Path) -> Vec<(String, u64)> {
    let mut files = Vec::new();
    let mut dirs = vec![images.join("blobs"), images.join("layers")];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let meta = entry.metadata().unwrap();
            if meta.is_dir() {
                dirs.push(entry.path());
            } else {
                files.push((entry.path().display().to_string(), meta.len()));
            }
        }
    }
    files.sort();
    files
}

mod revoked_uploads {
    use std::time::{Duration, Instant};

    use sbx_proto::v1::image_service_client::ImageServiceClient;
    use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
    use sbx_proto::v1::{
        CopyFromSandboxRequest, CopyToSandboxInput, CopyToSandboxStart, ImportImageHeader,
        ImportImageRequest, ListImagesRequest, SandboxRef, copy_to_sandbox_input,
        import_image_request,
    };
    use tokio_stream::wrappers::ReceiverStream;
    use tonic::metadata::AsciiMetadataValue;
    use tonic::service::Interceptor;
    use tonic::{Code, Request, Status};

    #[derive(Clone)]
    struct Bearer(AsciiMetadataValue);

    impl Interceptor for Bearer {
        fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
            req.metadata_mut().insert("authorization", self.0.clone());
            Ok(req)
        }
    }

    fn bearer(token: &str) -> Bearer {
        Bearer(format!("Bearer {token}").parse().unwrap())
    }

    /// A tar of one file `name` of `size` bytes, whole.
    fn tar_of(name: &str, size: usize) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(size as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder
            .append_data(&mut header, name, &vec![7u8; size][..])
            .unwrap();
        builder.into_inner().unwrap()
    }

    /// Sends `bytes` on `tx` 4 KiB every 100 ms (a slow client), until they are all sent or
    /// the call is gone.
    async fn drip<T>(tx: tokio::sync::mpsc::Sender<T>, bytes: Vec<u8>, wrap: fn(Vec<u8>) -> T) {
        for piece in bytes.chunks(4096) {
            if tx.send(wrap(piece.to_vec())).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A revoke during a slow `CopyToSandbox` and a slow `ImportImage` ends each within about
    /// a second (the gateway rechecks every second), though the client goes on sending; the
    /// file is not in the sandbox under its name and the image is not recorded.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_revoke_ends_a_slow_upload_and_nothing_of_it_is_kept() {
        // On oci, the default driver (copies reach a real sandbox; images a real store).
        let data = super::common::DataDir::new();
        let parent = super::common::CgroupParent(format!(
            "sbx-gateway-tests-revoke-{}",
            super::common::unique()
        ));
        let d = super::Sbxd::start(
            data.path(),
            "",
            &["--auth", "token", "--oci-cgroup-parent", &parent.0],
        );
        let ep = d.endpoint();
        let root = super::identity(data.path(), "root", "admin", &[]);
        super::sbx_as(
            &ep,
            &root,
            &["sandbox", "create", "box", "--", "sleep", "1000"],
        )
        .ok();
        for (name, what) in [("copier", "copy"), ("importer", "import")] {
            let token = super::identity(data.path(), name, "editor", &[]);
            let channel = d.channel().await;
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let began = Instant::now();
            let call = match what {
                "copy" => {
                    let mut client =
                        SandboxServiceClient::with_interceptor(channel, bearer(&token));
                    tx.send(CopyToSandboxInput {
                        input: Some(copy_to_sandbox_input::Input::Start(CopyToSandboxStart {
                            sandbox: Some(SandboxRef {
                                workspace: String::new(),
                                name: "box".into(),
                                id: String::new(),
                            }),
                            path: "/sandbox".into(),
                        })),
                    })
                    .await
                    .unwrap();
                    let sending = tokio::spawn(drip(tx, tar_of("late.bin", 400_000), |b| {
                        CopyToSandboxInput {
                            input: Some(copy_to_sandbox_input::Input::Data(b)),
                        }
                    }));
                    let call = tokio::spawn(async move {
                        client
                            .copy_to_sandbox(ReceiverStream::new(rx))
                            .await
                            .map(|_| ())
                    });
                    (call, sending)
                }
                _ => {
                    let (itx, irx) = tokio::sync::mpsc::channel(4);
                    drop(tx);
                    drop(rx);
                    let mut client = ImageServiceClient::with_interceptor(channel, bearer(&token));
                    itx.send(ImportImageRequest {
                        part: Some(import_image_request::Part::Header(ImportImageHeader {
                            name: "localhost/revoked:latest".into(),
                            ..Default::default()
                        })),
                    })
                    .await
                    .unwrap();
                    let sending = tokio::spawn(drip(itx, tar_of("rootfs-file", 400_000), |b| {
                        ImportImageRequest {
                            part: Some(import_image_request::Part::Chunk(b)),
                        }
                    }));
                    let call = tokio::spawn(async move {
                        client
                            .import_image(ReceiverStream::new(irx))
                            .await
                            .map(|_| ())
                    });
                    (call, sending)
                }
            };
            let (call, sending) = call;
            tokio::time::sleep(Duration::from_millis(1500)).await;
            if call.is_finished() {
                panic!("the {what} ended before the revoke: {:?}", call.await);
            }
            let revoked_at = Instant::now();
            let gone = common_revoke(data.path(), name);
            assert!(gone, "revoking {name}");
            let answer = tokio::time::timeout(Duration::from_secs(10), call)
                .await
                .expect("the call ended")
                .unwrap();
            let took = revoked_at.elapsed();
            eprintln!(
                "a revoke ended a slow {what} in {took:?} (upload began {:?} before)",
                revoked_at - began
            );
            let status = answer.expect_err("a revoked upload must fail");
            assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
            assert!(
                took < Duration::from_secs(3),
                "the {what} went on for {took:?}"
            );
            sending.abort();
        }
        // Nothing of either upload is kept.
        let channel = d.channel().await;
        let mut sandboxes = SandboxServiceClient::with_interceptor(channel.clone(), bearer(&root));
        let copied = sandboxes
            .copy_from_sandbox(CopyFromSandboxRequest {
                sandbox: Some(SandboxRef {
                    workspace: String::new(),
                    name: "box".into(),
                    id: String::new(),
                }),
                path: "/sandbox/late.bin".into(),
            })
            .await;
        let mut found = false;
        if let Ok(stream) = copied {
            use futures::StreamExt;
            let mut stream = stream.into_inner();
            while let Some(item) = stream.next().await {
                found |= item.is_ok();
            }
        }
        assert!(!found, "the revoked copy's file is in the sandbox");
        let mut images = ImageServiceClient::with_interceptor(channel, bearer(&root));
        let listed = images
            .list_images(ListImagesRequest::default())
            .await
            .map(|r| format!("{:?}", r.into_inner()))
            .unwrap_or_default();
        assert!(
            !listed.contains("revoked"),
            "the revoked import is recorded: {listed}"
        );
        super::sbx_as(&ep, &root, &["sandbox", "delete", "box"]).ok();
        drop(d);
        super::common::assert_oci_left_nothing(data.path(), &parent.0);
    }

    /// A revoke during a pull that crawls through a throttled registry ends it within about
    /// a second (the gateway's recheck), though the registry goes on sending: the caller gets
    /// UNAUTHENTICATED, nothing is recorded, and nothing of the pull stays in the store.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_revoke_ends_a_pull_and_nothing_of_it_is_kept() {
        use sbx_drivers::image::fixtures::{self, LocalRegistry, TarEntry};
        use sbx_proto::v1::{PullImageRequest, pull_image_response, pull_progress};
        if !LocalRegistry::available("a_revoke_ends_a_pull_and_nothing_of_it_is_kept") {
            return;
        }
        let data = super::common::DataDir::new();
        let d = super::Sbxd::start(data.path(), "sim", &["--sim-images", "--auth", "token"]);
        let root = super::identity(data.path(), "root", "admin", &[]);
        let puller = super::identity(data.path(), "puller", "editor", &[]);
        let work = tempfile::tempdir().unwrap();
        let registry = LocalRegistry::start(&work.path().join("registry"));
        // 4 MiB that do not compress, at 256 KiB/s: a 16 s pull.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let noise: Vec<u8> = (0..(4 << 20) / 8)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_le_bytes()
            })
            .collect();
        let layer = fixtures::tar_bytes(&[TarEntry::file("noise", &noise)]);
        fixtures::write_oci_layout(&work.path().join("slow"), &[layer], "v1");
        registry.push(
            &work.path().join("slow"),
            &format!("{}/sbx-test/slow:v1", registry.addr),
            &[],
        );
        let proxy = super::common::throttled_proxy(&registry.addr, 256 << 10);
        let images_dir = data.path().join("images");
        let before = store_files(&images_dir);

        let mut client = ImageServiceClient::with_interceptor(d.channel().await, bearer(&puller));
        let mut stream = client
            .pull_image(PullImageRequest {
                reference: format!("{proxy}/sbx-test/slow:v1"),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        // Under way: a layer's bytes are coming.
        let began = Instant::now();
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(20), stream.message())
                .await
                .expect("progress within 20 s")
                .unwrap()
                .expect("the pull goes on");
            if let Some(pull_image_response::Message::Progress(p)) = msg.message
                && matches!(p.event, Some(pull_progress::Event::Layer(_)))
            {
                break;
            }
        }
        let revoked_at = Instant::now();
        assert!(common_revoke(data.path(), "puller"), "revoking puller");
        let ended = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                match stream.message().await {
                    Ok(Some(msg)) => {
                        if let Some(pull_image_response::Message::Image(image)) = msg.message {
                            return Ok(image);
                        }
                    }
                    Ok(None) => return Err(Status::unknown("the stream ended with no answer")),
                    Err(status) => return Err(status),
                }
            }
        })
        .await
        .expect("the pull ended within 30 s");
        let took = revoked_at.elapsed();
        eprintln!(
            "a revoke ended a pull in {took:?} (its bytes began {:?} before)",
            revoked_at - began
        );
        let status = ended.expect_err("a revoked pull must fail");
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
        assert!(
            took < Duration::from_secs(4),
            "the pull went on for {took:?}"
        );
        let mut images = ImageServiceClient::with_interceptor(d.channel().await, bearer(&root));
        let listed = format!(
            "{:?}",
            images
                .list_images(ListImagesRequest::default())
                .await
                .unwrap()
                .into_inner()
        );
        assert!(
            !listed.contains("slow"),
            "the revoked pull is recorded: {listed}"
        );
        // Whatever it fetched is gone again (the config blob too), and nothing is in tmp/.
        let deadline = Instant::now() + Duration::from_secs(10);
        while store_files(&images_dir) != before {
            assert!(
                Instant::now() < deadline,
                "the revoked pull left {:?}",
                store_files(&images_dir)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let tmp: Vec<_> = std::fs::read_dir(images_dir.join("tmp"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(tmp.is_empty(), "{tmp:?}");
    }

    /// Every file under the image store's blobs and layers, with its size.
    fn store_files(images: &std::path::Path) -> Vec<(String, u64)> {
        super::store_files(images)
    }

    fn common_revoke(data: &std::path::Path, name: &str) -> bool {
        super::run_bounded(
            std::process::Command::new(super::SBXD)
                .args(["token", "revoke", "--data-dir"])
                .arg(data)
                .arg(name),
            "sbxd token revoke",
        )
        .code
            == 0
    }
}

/// A registry on 127.0.0.1 that answers every request slowly: the headers of a 4 KiB body at
/// once, then a byte every 100 ms — each read makes progress, so no read deadline fires.
/// Serves until the test ends (its thread is detached; the listener is the test's own).
fn dripping_registry() -> std::net::SocketAddr {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming().take(64) {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                let mut request = [0u8; 4096];
                let _ = conn.read(&mut request);
                let head = "HTTP/1.1 200 OK\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\n\
                            Docker-Content-Digest: sha256:0000000000000000000000000000000000000000000000000000000000000000\r\n\
                            Content-Length: 4096\r\n\r\n";
                if conn.write_all(head.as_bytes()).is_err() {
                    return;
                }
                // At most 4096 bytes over ~7 minutes: bounded, and far past any deadline here.
                for _ in 0..4096 {
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    if conn.write_all(b" ").is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// A pull from a registry that drips ends at `--pull-timeout` (REGISTRY_DEADLINE, nothing
/// kept), and while it runs an `image rm` and 10 creates in other workspaces each answer
/// within a second: no lock of the image store is held across the download.
#[test]
fn a_stalled_registry_stalls_nobody_else_and_ends_at_its_deadline() {
    use std::time::{Duration, Instant};
    let data = common::DataDir::new();
    let d = Sbxd::start(
        data.path(),
        "sim",
        &["--sim-images", "--pull-timeout", "4s"],
    );
    let ep = d.endpoint();
    let registry = dripping_registry();
    for ws in ["t1", "t2"] {
        sbx(&ep, &["workspace", "create", ws]).ok();
    }
    let reference = format!("{registry}/slow/app:1");
    let pulling = {
        let ep = ep.clone();
        std::thread::spawn(move || {
            let began = Instant::now();
            let run = sbx(&ep, &["image", "pull", &reference]);
            (run, began.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(800));
    assert!(
        !pulling.is_finished(),
        "the pull ended before the others were tried"
    );
    let mut slowest = Duration::ZERO;
    let t = Instant::now();
    let rm = sbx(&ep, &["image", "rm", "sbx.local/nothing:1"]);
    assert_ne!(rm.code, 0, "{rm:?}");
    slowest = slowest.max(t.elapsed());
    for i in 0..10 {
        let ws = if i % 2 == 0 { "t1" } else { "t2" };
        let t = Instant::now();
        sbx(
            &ep,
            &[
                "sandbox",
                "create",
                "-w",
                ws,
                "-n",
                &format!("s{i}"),
                "--",
                "sleep",
                "100",
            ],
        )
        .ok();
        slowest = slowest.max(t.elapsed());
    }
    assert!(
        !pulling.is_finished(),
        "the pull ended before the others were done"
    );
    assert!(
        slowest < Duration::from_secs(1),
        "an image rm or a create took {slowest:?} while a pull dripped"
    );
    let (pulled, took) = pulling.join().unwrap();
    assert_ne!(pulled.code, 0, "{pulled:?}");
    assert!(
        pulled.stderr.contains("--pull-timeout"),
        "the error names the deadline: {pulled:?}"
    );
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(15),
        "the pull took {took:?} against a 4 s deadline"
    );
    let images = sbx(&ep, &["image", "list", "-o", "json"]).ok().to_string();
    assert!(!images.contains("slow/app"), "{images}");
    eprintln!(
        "while a pull dripped: the slowest rm or create took {slowest:?}; the pull ended after {took:?}"
    );
}

mod image_limits {
    use std::path::Path;

    use sbx_drivers::image::fixtures::{TarEntry, gzip, sha256, tar_bytes};

    /// An OCI layout at `dir` of one image whose manifest lists `times` times the layer
    /// `blob` (gzip-compressed, or a plain tar when `gzipped` is false) of uncompressed digest
    /// `diff_id`, each claimed to be `claimed` bytes (None: its real size).
    fn layout(
        dir: &Path,
        blob: &[u8],
        diff_id: &str,
        gzipped: bool,
        claimed: Option<u64>,
        times: usize,
    ) {
        let blobs = dir.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).unwrap();
        let put = |bytes: &[u8]| {
            let digest = sha256(bytes);
            std::fs::write(blobs.join(&digest[7..]), bytes).unwrap();
            digest
        };
        let layer_digest = put(blob);
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64", "os": "linux",
            "config": {"Cmd": ["/bin/true"]},
            "rootfs": {"type": "layers", "diff_ids": vec![diff_id; times]},
        }))
        .unwrap();
        let config_digest = put(&config);
        let media = if gzipped {
            "application/vnd.oci.image.layer.v1.tar+gzip"
        } else {
            "application/vnd.oci.image.layer.v1.tar"
        };
        let layer = serde_json::json!({
            "mediaType": media, "digest": layer_digest,
            "size": claimed.unwrap_or(blob.len() as u64),
        });
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": config_digest, "size": config.len()},
            "layers": vec![layer; times],
        }))
        .unwrap();
        let manifest_digest = put(&manifest);
        let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest, "size": manifest.len()}]});
        std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
        std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    }

    /// One hostile image: its name, its layer's blob and uncompressed digest, whether the blob
    /// is gzip, the size its manifest claims, how many times it lists the layer, and the flag
    /// of the limit it must meet.
    type Case = (
        &'static str,
        Vec<u8>,
        String,
        bool,
        Option<u64>,
        usize,
        &'static str,
    );

    use super::store_files;

    /// A gzip bomb (a small layer that unpacks to 96 MiB), a layer of 20,000 empty files, a
    /// manifest that claims a 10^15-byte layer and an image of 5,000 layers are each refused
    /// with RESOURCE_EXHAUSTED naming the limit passed (64Mi, 10,000 files, 127 layers here),
    /// nothing of them recorded, and the image store's files left as they were.
    #[test]
    fn images_over_the_limits_are_refused_and_leave_the_store_as_it_was() {
        let data = super::common::DataDir::new();
        let d = super::Sbxd::start(
            data.path(),
            "sim",
            &[
                "--sim-images",
                "--image-max-size",
                "64Mi",
                "--image-max-files",
                "10000",
            ],
        );
        let ep = d.endpoint();
        let images = data.path().join("images");
        let before = store_files(&images);
        let bomb = tar_bytes(&[TarEntry::file("zeros", &vec![0u8; 96 << 20])]);
        let many: Vec<TarEntry> = (0..20_000)
            .map(|i| TarEntry::file(&format!("f/{i}"), b""))
            .collect();
        let many = tar_bytes(&many);
        let small = tar_bytes(&[TarEntry::file("hello", b"hi")]);
        let cases: [Case; 4] = [
            (
                "bomb",
                gzip(&bomb),
                sha256(&bomb),
                true,
                None,
                1,
                "--image-max-size",
            ),
            (
                "many",
                gzip(&many),
                sha256(&many),
                true,
                None,
                1,
                "--image-max-files",
            ),
            (
                "liar",
                small.clone(),
                sha256(&small),
                false,
                Some(1_000_000_000_000_000),
                1,
                "--image-max-size",
            ),
            (
                "tall",
                small.clone(),
                sha256(&small),
                false,
                None,
                5000,
                "--image-max-layers",
            ),
        ];
        drop(bomb);
        for (name, blob, diff_id, gzipped, claimed, times, limit) in cases {
            let dir = data.path().join(format!("layout-{name}"));
            layout(&dir, &blob, &diff_id, gzipped, claimed, times);
            let started = std::time::Instant::now();
            let run = super::sbx(
                &ep,
                &[
                    "image",
                    "import",
                    dir.to_str().unwrap(),
                    "--name",
                    &format!("{name}:1"),
                ],
            );
            assert_ne!(run.code, 0, "{name} was imported: {run:?}");
            assert!(
                run.stderr.contains(limit) && run.stderr.contains("IMAGE_TOO_LARGE"),
                "{name}: the refusal names {limit}: {run:?}"
            );
            assert!(
                !run.stderr.contains(data.path().to_str().unwrap()),
                "{name}: the refusal names a path of the data dir: {run:?}"
            );
            eprintln!(
                "{name}: refused in {:?}: {}",
                started.elapsed(),
                run.stderr.trim()
            );
            let listed = super::sbx(&ep, &["image", "list", "-o", "json"])
                .ok()
                .to_string();
            assert!(
                !listed.contains(&format!("{name}:1")),
                "{name} recorded: {listed}"
            );
            assert_eq!(
                store_files(&images),
                before,
                "{name} left files in the store"
            );
        }
    }
}

mod what_a_scoped_caller_learns {
    use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
    use sbx_proto::v1::{GetSandboxRequest, ListSandboxesRequest, SandboxRef};
    use tonic::metadata::AsciiMetadataValue;
    use tonic::service::Interceptor;
    use tonic::{Request, Status};

    #[derive(Clone)]
    struct Bearer(AsciiMetadataValue);

    impl Interceptor for Bearer {
        fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
            req.metadata_mut().insert("authorization", self.0.clone());
            Ok(req)
        }
    }

    /// A caller scoped to `mine` pages through `list -A` one sandbox at a time and gets its
    /// three, one a page, then the end — no empty page of the 30 in `big` to count; and a
    /// caller scoped to `default` asking for a name that only other workspaces hold is told it
    /// is not found, with no word of where it is.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pages_and_errors_say_nothing_of_other_workspaces() {
        let data = tempfile::tempdir().unwrap();
        let d = super::secured(data.path());
        let ep = d.endpoint();
        let root = super::identity(data.path(), "root", "admin", &[]);
        for ws in ["big", "mine", "a", "b"] {
            super::sbx_as(&ep, &root, &["workspace", "create", ws]).ok();
        }
        for i in 0..30 {
            let name = format!("b{i:02}");
            super::sbx_as(
                &ep,
                &root,
                &[
                    "sandbox", "create", "-w", "big", "-n", &name, "--", "sleep", "1",
                ],
            )
            .ok();
            if i % 10 == 5 {
                let name = format!("m{i:02}");
                super::sbx_as(
                    &ep,
                    &root,
                    &[
                        "sandbox", "create", "-w", "mine", "-n", &name, "--", "sleep", "1",
                    ],
                )
                .ok();
            }
        }
        for ws in ["a", "b"] {
            super::sbx_as(
                &ep,
                &root,
                &[
                    "sandbox", "create", "-w", ws, "-n", "dup", "--", "sleep", "1",
                ],
            )
            .ok();
        }
        let viewer = super::identity(data.path(), "viewer", "viewer", &["mine"]);
        let bearer = |t: &str| Bearer(format!("Bearer {t}").parse().unwrap());
        let mut client = SandboxServiceClient::with_interceptor(d.channel().await, bearer(&viewer));
        let (mut token, mut pages) = (String::new(), Vec::new());
        for _ in 0..50 {
            let page = client
                .list_sandboxes(ListSandboxesRequest {
                    all_workspaces: true,
                    page_size: 1,
                    page_token: token.clone(),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            pages.push(
                page.sandboxes
                    .iter()
                    .map(|s| s.name.clone())
                    .collect::<Vec<_>>(),
            );
            token = page.next_page_token;
            if token.is_empty() {
                break;
            }
        }
        assert_eq!(
            pages.iter().filter(|p| !p.is_empty()).count(),
            3,
            "{pages:?}"
        );
        assert!(
            pages.len() <= 4 && pages[..3].iter().all(|p| p.len() == 1),
            "the pages show other workspaces' objects by their shape: {pages:?}"
        );
        let defaulter = super::identity(data.path(), "defaulter", "viewer", &["default"]);
        let mut client =
            SandboxServiceClient::with_interceptor(d.channel().await, bearer(&defaulter));
        let err = client
            .get_sandbox(GetSandboxRequest {
                sandbox: Some(SandboxRef {
                    name: "dup".into(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
        let said = format!("{} {:?}", err.message(), err.details());
        assert!(
            !said.contains("\"a\"") && !said.contains("\"b\"") && !said.contains("ambiguous"),
            "a scoped caller learns where the name exists: {said}"
        );
    }
}

/// Images belong to a workspace: what an admin builds into `wb` (its result and its cache
/// step) is not found by an editor of `wa` — by name, by digest or by id — exactly as an
/// image nobody has; what is built into `wa` and the gateway's own images are.
#[test]
fn a_tenant_runs_only_its_workspaces_images_and_published_ones() {
    let data = tempfile::tempdir().unwrap();
    let d = Sbxd::start(data.path(), "sim", &["--auth", "token", "--sim-images"]);
    let ep = d.endpoint();
    let root = identity(data.path(), "root", "admin", &[]);
    for ws in ["wa", "wb"] {
        sbx_as(&ep, &root, &["workspace", "create", ws]).ok();
    }
    let ctx = tempfile::tempdir().unwrap();
    std::fs::write(
        ctx.path().join("Dockerfile"),
        "FROM sbx.local/busybox:latest\nCOPY secret /secret\n",
    )
    .unwrap();
    std::fs::write(ctx.path().join("secret"), "wb's secret\n").unwrap();
    let dir = ctx.path().to_str().unwrap();
    let built = sbx_as(
        &ep,
        &root,
        &[
            "image",
            "build",
            "-w",
            "wb",
            "-t",
            "secret:v1",
            dir,
            "-o",
            "json",
        ],
    )
    .json();
    let digest = built["digest"].as_str().unwrap().to_string();
    let id = built["id"].as_str().unwrap().to_string();
    let editor = identity(data.path(), "editor-a", "editor", &["wa"]);
    for (how, image) in [("by name", "secret:v1"), ("by digest", digest.as_str())] {
        let made = sbx_as(
            &ep,
            &editor,
            &[
                "sandbox", "create", "-w", "wa", "--image", image, "--pull", "never", "--", "cat",
                "/secret",
            ],
        );
        assert_eq!(
            made.code, 1,
            "{how}: an editor of wa ran wb's image: {made:?}"
        );
        assert!(
            made.stderr.contains("IMAGE_NOT_FOUND") && !made.stderr.contains("wb"),
            "{how}: {made:?}"
        );
    }
    // By id: what an id nobody has gets, word for word but the id.
    let by_id = sbx_as(&ep, &editor, &["image", "get", "-w", "wa", "--id", &id]);
    let nobodys = uuid::Uuid::new_v4().to_string();
    let unknown = sbx_as(
        &ep,
        &editor,
        &["image", "get", "-w", "wa", "--id", &nobodys],
    );
    assert_eq!(by_id.code, 1, "{by_id:?}");
    assert_eq!(
        by_id.stderr.replace(&id, "ID"),
        unknown.stderr.replace(&nobodys, "ID"),
        "another workspace's image answers as no image at all"
    );
    // wb's own editor runs it; wa's editor runs what is built into wa and the gateway's.
    let editor_b = identity(data.path(), "editor-b", "editor", &["wb"]);
    sbx_as(
        &ep,
        &editor_b,
        &[
            "sandbox",
            "create",
            "-w",
            "wb",
            "-n",
            "b1",
            "--image",
            "secret:v1",
            "--",
            "sleep",
            "1",
        ],
    )
    .ok();
    std::fs::write(ctx.path().join("secret"), "wa's own\n").unwrap();
    sbx_as(
        &ep,
        &root,
        &["image", "build", "-w", "wa", "-t", "mine:v1", dir],
    )
    .ok();
    for image in ["mine:v1", "sbx.local/busybox:latest"] {
        sbx_as(
            &ep,
            &editor,
            &[
                "sandbox", "create", "-w", "wa", "--image", image, "--", "sleep", "1",
            ],
        )
        .ok();
    }
    // A tenant lists its workspace's images and the gateway's, nothing of wb's.
    let listed = sbx_as(&ep, &editor, &["image", "list", "-w", "wa", "-o", "json"]).json();
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"docker.io/library/mine:v1")
            && names.contains(&"sbx.local/busybox:latest")
            && !names.contains(&"docker.io/library/secret:v1"),
        "{names:?}"
    );
    assert!(
        !listed.to_string().contains(&digest),
        "wb's image (or its cache step) is listed to wa: {listed}"
    );
}

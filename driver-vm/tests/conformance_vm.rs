//! The driver conformance suite against the vm driver (QEMU microVMs; needs qemu-system-x86,
//! qemu-utils, linux-image-amd64 and busybox-static, which `.ci/run` installs). One test per
//! check, each on its own state directory; after each, no VM may be left. `kill` drops the
//! driver instance; the VMs, daemonized, outlive it and the next instance finds them again.

mod vm_support;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sbx_driver_api::conformance::DriverHarness;
use sbx_driver_api::{ComputeDriver, pb};
use vm_support::VmEnv;

/// The vm driver with an image store holding the busybox image, which every sandbox of the
/// suite runs as its root (the guest's init mounts it, and the command and execs run there).
struct VmHarness {
    env: VmEnv,
    _store_dir: tempfile::TempDir,
    images: sbx_images::ImageStore,
    image: String,
}

impl VmHarness {
    fn new() -> VmHarness {
        let store_dir = tempfile::tempdir().expect("temp dir");
        let images = sbx_images::ImageStore::open(
            store_dir.path().join("images"),
            sbx_images::IdMap::default(),
        )
        .expect("an image store");
        let image = images
            .import_busybox(&vm_support::busybox(), "sbx.local/busybox:latest")
            .expect("the busybox image")
            .digest;
        VmHarness {
            env: VmEnv::new(),
            _store_dir: store_dir,
            images,
            image,
        }
    }
}

#[async_trait]
impl DriverHarness for VmHarness {
    async fn open(&self) -> Arc<dyn ComputeDriver> {
        Arc::new(self.env.open_with_images(self.images.clone()).await)
    }

    async fn kill(&self, driver: Arc<dyn ComputeDriver>) {
        drop(driver);
    }

    fn long_running_spec(&self) -> pb::SandboxSpec {
        pb::SandboxSpec {
            command: vec!["sleep".into(), "3600".into()],
            image: self.image.clone(),
            ..Default::default()
        }
    }

    fn settle_timeout(&self) -> Duration {
        Duration::from_secs(60)
    }

    fn call_timeout(&self) -> Duration {
        Duration::from_secs(120)
    }
}

// One test per check, each on its own state directory, so a check can be run alone by name
// (`cargo nextest run -p sbx-drivers --test conformance_vm copy_`); nextest runs them one
// after the other (the `vm` test group). Each check boots its own VMs either way: a shared
// state saved only the driver's open, which with the asset cache is milliseconds.
sbx_driver_api::conformance_suite! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    harness: VmHarness::new(),
    after_each: |h| h.env.assert_no_vm_left(),
}

/// More forwarded connections at once than the VM has exec channels (each holds one for its
/// life, [`sbx_driver_vm::EXEC_CHANNELS`]): every one carries its bytes there and back;
/// those beyond the channels wait for one instead of failing. Prints the boot's time (it
/// grows with the number of channels) and the connections'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_forwards_more_connections_than_exec_channels() {
    use futures::StreamExt;
    use pb::port_forward_input::Input;
    use pb::port_forward_output::Output;

    const CONNECTIONS: usize = 20;
    const PORT: u32 = 7777;
    let h = VmHarness::new();
    let driver = h.open().await;
    let began = std::time::Instant::now();
    let created = driver
        .create(pb::CreateRequest {
            sandbox_id: uuid::Uuid::new_v4().to_string(),
            workspace: "alpha".into(),
            name: "forwards".into(),
            generation: 1,
            spec: Some(h.long_running_spec()),
            ..Default::default()
        })
        .await
        .expect("create");
    eprintln!(
        "create → running in {:?} ({} exec channels)",
        began.elapsed(),
        sbx_driver_vm::EXEC_CHANNELS
    );
    let id = created.sandbox_id;
    let server = driver
        .exec(pb::ExecRequest {
            sandbox_id: id.clone(),
            command: h.echo_server(PORT as u16).expect("an echo server"),
            ..Default::default()
        })
        .await
        .expect("exec of the echo server");
    // Until the server listens: FailedPrecondition.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_tx, rx) = futures::channel::mpsc::unbounded::<pb::PortForwardInput>();
        let req = pb::PortForwardStart {
            sandbox_id: id.clone(),
            port: PORT,
        };
        match driver.port_forward(req, Box::pin(rx)).await {
            Ok(_) => break,
            Err(e) if std::time::Instant::now() < deadline => {
                eprintln!("not yet: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the echo server never listened: {e}"),
        }
    }
    let began = std::time::Instant::now();
    let one = |k: usize| {
        let driver = driver.clone();
        let id = id.clone();
        async move {
            let sent: Vec<u8> = (0..10_000).map(|i| ((i * 7 + k) % 251) as u8).collect();
            let (tx, rx) = futures::channel::mpsc::unbounded();
            let req = pb::PortForwardStart {
                sandbox_id: id,
                port: PORT,
            };
            let mut out = driver
                .port_forward(req, Box::pin(rx))
                .await
                .map_err(|e| format!("connection {k}: {e}"))?;
            for input in [Input::Data(sent.clone()), Input::CloseWrite(true)] {
                let _ = tx.unbounded_send(pb::PortForwardInput { input: Some(input) });
            }
            let mut back = Vec::new();
            loop {
                match out.next().await {
                    Some(Ok(pb::PortForwardOutput {
                        output: Some(Output::Data(b)),
                    })) => back.extend(b),
                    Some(Ok(pb::PortForwardOutput {
                        output: Some(Output::Closed(true)),
                    })) => break,
                    other => return Err(format!("connection {k}: {other:?}")),
                }
            }
            if back != sent {
                return Err(format!(
                    "connection {k}: {} bytes came back of {} sent, or others",
                    back.len(),
                    sent.len()
                ));
            }
            Ok(())
        }
    };
    let all = futures::future::join_all((0..CONNECTIONS).map(one));
    let results = tokio::time::timeout(Duration::from_secs(120), all)
        .await
        .expect("20 forwarded connections within 120 s");
    let failed: Vec<_> = results.into_iter().filter_map(Result::err).collect();
    assert!(failed.is_empty(), "{failed:?}");
    eprintln!(
        "{CONNECTIONS} connections of 10 KB there and back in {:?}",
        began.elapsed()
    );
    drop(server);
    driver
        .delete(pb::DeleteRequest { sandbox_id: id })
        .await
        .expect("delete");
    h.env.assert_no_vm_left();
}

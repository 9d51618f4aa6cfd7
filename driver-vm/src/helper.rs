//! A copy into or out of a stopped VM: its disks are booted in a *helper guest* — the same
//! kernel, init, disks and agents, with no command run (`SBX_HELPER=1` in its run
//! environment) and no network — and the copy runs through the helper's exec channels as it
//! would in the running VM, then the helper powers off (its init syncs and unmounts the disks).
//! So a guest-written filesystem is never mounted, nor parsed, by the host: only by the
//! guest's own kernel, as when the sandbox runs.
//!
//! The sandbox's lock is held from the helper's boot to its end, so a start (or a stop, or a
//! delete) of the sandbox waits for the copy. The helper is no run of the sandbox: its record
//! is not changed (still stopped, its QEMU none) and its console lines carry a run id of the
//! helper's own, so the sandbox's state and exit status are untouched. A driver killed while a
//! helper runs finds its QEMU at open by the pidfile and ends it (the record says stopped).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::OwnedMutexGuard;
use uuid::Uuid;

use super::Inner;
use super::record::VmRecord;
use sbx_driver_api::DriverError;
use sbx_host_kit::command::RunEnv;
use sbx_host_kit::{Desired, HostDriver, internal, locked};

/// A booted helper of sandbox `id`: ended (powered off) when dropped, or by its watchdog
/// once the copy has moved no byte for the driver's `copy_idle_limit` (the helper holds the
/// sandbox's lock, so a caller that stops reading or sending must not hold its start, stop
/// and delete for ever; the copy then fails, its exec cut).
pub(super) struct Helper {
    inner: Arc<Inner>,
    rec: VmRecord,
    /// The sandbox's lock, taken by whichever ends the helper first (this or the watchdog)
    /// and held until its QEMU is gone.
    lock: Arc<std::sync::Mutex<Option<OwnedMutexGuard<()>>>>,
    /// When the copy last moved a byte.
    last: Arc<std::sync::Mutex<Instant>>,
    /// Set when the watchdog ended the helper.
    idled: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for Helper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Helper")
            .field("sandbox", &self.rec.sandbox_id)
            .field("run", &self.rec.run_id)
            .finish()
    }
}

impl Helper {
    /// The copy moved bytes.
    pub(super) fn touch(&self) {
        *locked(&self.last) = Instant::now();
    }

    /// The copy's error, said plainly when the watchdog ended the helper under it.
    pub(super) fn explain(&self, e: DriverError) -> DriverError {
        if self.idled.load(std::sync::atomic::Ordering::SeqCst) {
            DriverError::Unavailable(format!(
                "the copy moved no data for {}s and was ended: its helper vm held the stopped \
                 sandbox (its start, stop and delete wait for a copy)",
                self.inner.opts.copy_idle_limit.as_secs()
            ))
        } else {
            e
        }
    }

    /// Ends the helper (once: the lock goes to the first caller) in a task of its own, which
    /// holds the sandbox's lock until the QEMU is gone.
    fn end(
        inner: &Arc<Inner>,
        rec: &VmRecord,
        lock: &std::sync::Mutex<Option<OwnedMutexGuard<()>>>,
    ) {
        let Some(held) = locked(lock).take() else {
            return;
        };
        locked(&inner.helpers).remove(&rec.sandbox_id);
        let (inner, rec) = (Arc::clone(inner), rec.clone());
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _held = held;
                if let Err(e) = inner.terminate(&rec, Duration::from_secs(2)).await {
                    tracing::warn!(sandbox_id = %rec.sandbox_id, error = %e, "the copy's helper vm did not end");
                }
            });
        }
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        Helper::end(&self.inner, &self.rec, &self.lock);
    }
}

impl Inner {
    /// For a copy of sandbox `id` (as the request names it): a helper booted on its disks
    /// when it is stopped; `None` when its VM runs (or is paused, or unknown: the copy then
    /// answers as an exec would).
    pub(super) async fn helper_for(
        self: &Arc<Self>,
        sandbox: &str,
    ) -> Result<Option<Helper>, DriverError> {
        let Ok(id) = sandbox.parse::<Uuid>() else {
            return Ok(None);
        };
        let lock = self.records.lock(id).await;
        let Some(rec) = self.records.get(id) else {
            return Ok(None);
        };
        if rec.desired == Desired::Running {
            return Ok(None);
        }
        // A stop that did not finish: its QEMU still runs on the disks (and owns the files a
        // launch would replace).
        if Inner::is_alive(&rec) {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} is stopped but its vm has not ended (a stop did not finish); stop \
                 it again, then copy"
            )));
        }
        let mut rec = rec;
        self.ids_of(&mut rec)?;
        let paths = self.paths(id);
        let mut helper = VmRecord {
            run_id: format!("helper{}", Uuid::new_v4().simple()),
            console_offset: std::fs::metadata(&paths.console_log)
                .map(|m| m.len())
                .unwrap_or(0),
            qemu: None,
            paused: false,
            network_allow: None,
            ..rec.clone()
        };
        let initramfs = super::initramfs_in_memory(&self.boot_initramfs(
            &helper,
            0,
            &RunEnv::new(),
            None,
            true,
        )?)?;
        let _slot = self
            .boots
            .acquire()
            .await
            .map_err(|e| internal("waiting for a boot slot", e))?;
        let launched = self
            .launch_of(
                id,
                &helper,
                &paths,
                std::os::fd::AsFd::as_fd(&initramfs),
                false,
                None,
            )?
            .launch()
            .await;
        helper.qemu = Some(launched?);
        locked(&self.helpers).insert(id, helper.run_id.clone());
        let booted = Helper {
            inner: Arc::clone(self),
            rec: helper,
            lock: Arc::new(std::sync::Mutex::new(Some(lock))),
            last: Arc::new(std::sync::Mutex::new(Instant::now())),
            idled: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        };
        let ready = self.wait_booted(&booted.rec).await;
        super::forget_initramfs(&initramfs);
        ready?;
        booted.touch();
        // The watchdog: ends a helper whose copy has gone quiet; gone with the helper.
        let (inner, rec) = (Arc::clone(self), booted.rec.clone());
        let (lock, last) = (Arc::downgrade(&booted.lock), Arc::clone(&booted.last));
        let idled = Arc::clone(&booted.idled);
        let limit = self.opts.copy_idle_limit;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1).min(limit)).await;
                let Some(lock) = lock.upgrade() else { return };
                if locked(&lock).is_none() {
                    return;
                }
                if locked(&last).elapsed() >= limit {
                    tracing::warn!(sandbox_id = %rec.sandbox_id, ?limit, "a copy through a helper vm moved nothing: ended");
                    idled.store(true, std::sync::atomic::Ordering::SeqCst);
                    Helper::end(&inner, &rec, &lock);
                    return;
                }
            }
        });

        tracing::info!(sandbox_id = %id, "a helper vm serves a copy of the stopped sandbox");
        Ok(Some(booted))
    }
}

/// The stream of a copy out of a stopped sandbox, holding its helper until the stream ends or
/// is dropped (or its watchdog ends a copy gone quiet).
pub(super) fn hold<T: Send + 'static>(
    stream: sbx_driver_api::DriverStream<T>,
    helper: Option<Helper>,
) -> sbx_driver_api::DriverStream<T> {
    let Some(helper) = helper else {
        return stream;
    };
    Box::pin(futures::stream::unfold(
        (stream, helper),
        |(mut stream, helper)| async move {
            use futures::StreamExt;
            let item = stream.next().await?;
            helper.touch();
            Some((item.map_err(|e| helper.explain(e)), (stream, helper)))
        },
    ))
}

/// The data of a copy into a stopped sandbox, each chunk telling `helper` the copy moves.
pub(super) fn watched(
    data: sbx_driver_api::ByteStream,
    helper: &Helper,
) -> sbx_driver_api::ByteStream {
    use futures::StreamExt;
    let last = Arc::clone(&helper.last);
    Box::pin(data.inspect(move |_| *locked(&last) = Instant::now()))
}

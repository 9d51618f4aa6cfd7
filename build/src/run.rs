//! One RUN: a sandbox of the build's workspace from the build's image so far, its output
//! streamed to the caller while it runs, and once it ended with status 0 what it changed in
//! its root filesystem read from the driver as a layer (bounded as a pulled image is). The
//! sandbox is deleted however the step ends, and carries a ttl that deletes it should the
//! gateway die first.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use sbx_actors::{ActorError, ImageFailure, LogOptions, Result, SandboxSelector};
use sbx_proto::v1::{
    Lifetime, LifetimeAction, LogStream, NetworkMode, NetworkPolicy, Phase, Sandbox, SandboxSpec,
};
use tokio::io::AsyncWriteExt;
use tokio::task::JoinHandle;

use crate::state::refuse;
use crate::{BUILD_LABEL, Build, BuildEvent, DEFAULT_RUN_TIMEOUT};

/// How often a running RUN's sandbox is looked at.
const POLL: Duration = Duration::from_millis(100);

/// One RUN to run.
pub(crate) struct RunStep {
    pub(crate) cancel: tokio_util::sync::CancellationToken,
    pub(crate) line: usize,
    pub(crate) argv: Vec<String>,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) image: String,
    /// What the image's layers take before this step's (their sizes, as a manifest says).
    pub(crate) base_size: u64,
    pub(crate) name: String,
}

/// The bytes of each stream (stdout, stderr) the follow passed on.
type Counted = Arc<Mutex<[usize; 2]>>;

impl Build<'_> {
    /// One RUN: a sandbox from `run.image` running `run.argv`, its output to the caller, its
    /// changes to `layer`; deleted however it ends.
    pub(crate) async fn run_in_sandbox(&self, run: &RunStep, layer: &Path) -> Result<()> {
        let req = self.req;
        let timeout = req.run_timeout.unwrap_or(DEFAULT_RUN_TIMEOUT);
        let network = match req.allow.is_empty() {
            true => NetworkPolicy {
                mode: NetworkMode::None as i32,
                allow: Vec::new(),
            },
            false => NetworkPolicy {
                mode: NetworkMode::Policy as i32,
                allow: req.allow.clone(),
            },
        };
        let spec = SandboxSpec {
            command: run.argv.clone(),
            env: run.env.iter().cloned().collect(),
            labels: [(BUILD_LABEL.to_string(), run.name.clone())].into(),
            driver: req.driver.clone(),
            image: run.image.clone(),
            network: Some(network),
            // Should the gateway die mid-step, the sandbox still goes.
            lifetime: Some(Lifetime {
                ttl_seconds: timeout.as_secs() + 600,
                on_ttl: LifetimeAction::Delete as i32,
                ..Default::default()
            }),
            ..Default::default()
        };
        let sandbox = self
            .gateway
            .create_sandbox(req.workspace.as_deref(), &run.name, spec)
            .await
            .map_err(|e| refuse_run(run.line, e))?;
        let sel = SandboxSelector::Id(
            uuid::Uuid::parse_str(&sandbox.id)
                .map_err(|e| ActorError::Internal(format!("a sandbox id: {e}")))?,
        );
        let outcome = self.run_in(&sel, run, layer, timeout).await;
        if let Err(e) = self.gateway.delete_sandbox(&sel).await {
            tracing::warn!(sandbox = %sandbox.id, error = %e, "a build step's sandbox was not deleted; its ttl will");
        }
        outcome
    }

    /// The RUN's sandbox followed until it ended, its whole output passed on, and its
    /// changes kept when it succeeded.
    async fn run_in(
        &self,
        sel: &SandboxSelector,
        run: &RunStep,
        layer: &Path,
        timeout: Duration,
    ) -> Result<()> {
        let started = Instant::now();
        // The output as it comes; what the follow had not delivered at the end is read after.
        let counted: Counted = Arc::new(Mutex::new([0usize; 2]));
        let follower = self.follow(sel, counted.clone()).await;
        let ended = match self.wait_ended(sel, run, started, timeout).await {
            Ok(ended) => ended,
            Err(e) => {
                follower.abort();
                return Err(e);
            }
        };
        follower.abort();
        let _ = follower.await;
        let seen = *counted.lock().unwrap_or_else(|p| p.into_inner());
        self.rest_of_log(sel, seen).await;
        succeeded(&ended, run)?;
        self.keep_changes(sel, run, layer).await
    }

    /// Passes the sandbox's output on as it comes, counting what it passed on.
    async fn follow(&self, sel: &SandboxSelector, counted: Counted) -> JoinHandle<()> {
        let follow = self
            .gateway
            .logs(
                sel,
                LogOptions {
                    follow: true,
                    tail_lines: 0,
                    timestamps: false,
                    since: None,
                },
            )
            .await;
        let events = self.events.clone();
        tokio::spawn(async move {
            let Ok(mut stream) = follow else {
                return;
            };
            while let Some(Ok(chunk)) = stream.next().await {
                let stderr = chunk.stream == LogStream::Stderr as i32;
                let len = chunk.data.len();
                if events
                    .send(BuildEvent::Log {
                        data: chunk.data,
                        stderr,
                    })
                    .await
                    .is_err()
                {
                    return;
                }
                // Counted once passed on: an abort in the send leaves it to the re-read.
                counted.lock().unwrap_or_else(|p| p.into_inner())[stderr as usize] += len;
            }
        })
    }

    /// The sandbox once it ended; an error when the build's caller went away or the RUN ran
    /// past its time.
    async fn wait_ended(
        &self,
        sel: &SandboxSelector,
        run: &RunStep,
        started: Instant,
        timeout: Duration,
    ) -> Result<Sandbox> {
        loop {
            let sandbox = self.gateway.get_sandbox(sel).await?;
            match Phase::try_from(sandbox.phase).unwrap_or(Phase::Unspecified) {
                Phase::Completed | Phase::Error | Phase::Stopped => return Ok(sandbox),
                _ => {}
            }
            if run.cancel.is_cancelled() {
                return Err(ActorError::FailedPrecondition(format!(
                    "RUN at line {}: the build's caller went away",
                    run.line
                )));
            }
            if started.elapsed() > timeout {
                return Err(ActorError::FailedPrecondition(format!(
                    "RUN at line {} ran past its {} s (`--run-timeout`)",
                    run.line,
                    timeout.as_secs()
                )));
            }
            tokio::select! {
                () = tokio::time::sleep(POLL) => {}
                () = run.cancel.cancelled() => {}
            }
        }
    }

    /// The rest of the log: the whole of it, past what the follow passed on (`seen`).
    async fn rest_of_log(&self, sel: &SandboxSelector, seen: [usize; 2]) {
        let Ok(mut stream) = self
            .gateway
            .logs(
                sel,
                LogOptions {
                    follow: false,
                    tail_lines: 0,
                    timestamps: false,
                    since: None,
                },
            )
            .await
        else {
            return;
        };
        let mut read = [0usize; 2];
        while let Some(Ok(chunk)) = stream.next().await {
            let stderr = chunk.stream == LogStream::Stderr as i32;
            let at = read[stderr as usize];
            read[stderr as usize] += chunk.data.len();
            let skip = seen[stderr as usize]
                .saturating_sub(at)
                .min(chunk.data.len());
            if skip < chunk.data.len() {
                self.say(BuildEvent::Log {
                    data: chunk.data[skip..].to_vec(),
                    stderr,
                })
                .await;
            }
        }
    }

    /// What the sandbox changed, read from the driver as a layer into `layer`. Bounded as a
    /// pulled image is (`--image-max-size`, the base's layers counted): a sparse file of
    /// terabytes costs the sandbox nothing, its layer would fill the gateway's disk. Each
    /// entry is paid for from its header, before its data is written.
    async fn keep_changes(&self, sel: &SandboxSelector, run: &RunStep, layer: &Path) -> Result<()> {
        let refused = |e: sbx_images::ImageError| match e {
            sbx_images::ImageError::TooLarge { image, why, limit } => ActorError::Image {
                kind: ImageFailure::TooLarge,
                message: format!("{image}: {why} (the limit: {limit})"),
            },
            e @ (sbx_images::ImageError::NoRoom { .. }
            | sbx_images::ImageError::Cancelled { .. }) => e.into(),
            // The driver's tar is ours: one the meter cannot read is a bug.
            e => ActorError::Internal(format!("the layer of RUN at line {}: {e}", run.line)),
        };
        // Taken from the store's free space too (the layer is spooled there), and ended by a
        // cancel at its next entry.
        let content = self.gateway.image_content_store()?;
        let what = format!("the image of RUN at line {}", run.line);
        let mut budget = content
            .limits()
            .budget(&what)
            .watching(content.room(&what), run.cancel.clone());
        budget.take_cached(run.base_size).map_err(refused)?;
        let mut meter = sbx_images::LayerMeter::new(budget);
        let mut stream = self.gateway.copy_changes(sel).await?;
        let mut file = tokio::fs::File::create_new(layer)
            .await
            .map_err(|e| ActorError::Internal(format!("creating a layer: {e}")))?;
        while let Some(chunk) = stream.next().await {
            let data = match chunk {
                Ok(chunk) => chunk.data,
                // What the sandbox made that a layer cannot say (a `.wh.` name…).
                Err(ActorError::Driver(sbx_driver_api::DriverError::FailedPrecondition(m))) => {
                    return Err(ActorError::FailedPrecondition(format!(
                        "RUN at line {}: {m}",
                        run.line
                    )));
                }
                Err(e) => return Err(e),
            };
            meter.feed(&data).map_err(refused)?;
            file.write_all(&data)
                .await
                .map_err(|e| ActorError::Internal(format!("writing a layer: {e}")))?;
        }
        file.sync_all()
            .await
            .map_err(|e| ActorError::Internal(format!("writing a layer: {e}")))?;
        Ok(())
    }
}

/// An error unless the RUN's sandbox completed (exit status 0).
fn succeeded(ended: &Sandbox, run: &RunStep) -> Result<()> {
    if Phase::try_from(ended.phase) == Ok(Phase::Completed) {
        return Ok(());
    }
    let why = match (ended.exit_code, ended.exit_signal) {
        (_, s) if s > 0 => format!("was killed by signal {s}"),
        (Some(code), _) => format!("exited with code {code}"),
        (None, _) => format!("failed: {}", ended.message),
    };
    Err(ActorError::FailedPrecondition(format!(
        "RUN at line {} {why}: {}",
        run.line,
        shown_argv(&run.argv)
    )))
}

/// A command line as shown in an error, at most 200 characters.
fn shown_argv(argv: &[String]) -> String {
    let line = argv.join(" ");
    match line.char_indices().nth(200) {
        Some((i, _)) => format!("{}…", &line[..i]),
        None => line,
    }
}

/// A RUN sandbox's create refused: said against the Dockerfile's line.
fn refuse_run(line: usize, e: ActorError) -> ActorError {
    match e {
        ActorError::InvalidArgument(m) => refuse(line, format!("RUN: {m}")),
        ActorError::FailedPrecondition(m) => {
            ActorError::FailedPrecondition(format!("Dockerfile line {line}: RUN: {m}"))
        }
        e => e,
    }
}

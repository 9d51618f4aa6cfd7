//! The exec of the oci driver: `runc exec` of a process with the workload's environment,
//! user, capabilities and seccomp, started by the sandbox's busybox running
//! [`super::EXEC_SCRIPT`] (a command not found: 127 and `command not found: NAME`). (Watch and logs are the kit's, `host::lifecycle`.)

use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use uuid::Uuid;

use super::record::OciRecord;
use super::{EXEC_SCRIPT, INIT_MOUNT, OciDriver, bundle, rootfs};
use crate::host::exec;
use crate::host::{Desired, internal, validate_command};
use crate::{DriverError, DriverStream, parse_sandbox_id, pb};

impl OciDriver {
    pub(super) async fn exec_stream(
        &self,
        req: pb::ExecRequest,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        validate_command("exec", &req.command, &req.env)?;
        let record = self.inner.records.require(id)?;
        let run = self.inner.run_paths(&record);
        let running = record.desired == Desired::Running && run.live_init().is_some();
        if !running {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} is not running; exec needs a running workload"
            )));
        }
        let paths = self.inner.paths(id);
        let user = rootfs::resolve_user(&record.image.user, &paths.rootfs)
            .map_err(|e| DriverError::FailedPrecondition(format!("the image's user: {e}")))?;
        // Through the sandbox's busybox (see EXEC_SCRIPT), so that a missing command is told
        // by name with 127, as a shell would.
        let mut args = vec![
            format!("{INIT_MOUNT}/busybox"),
            "sh".to_string(),
            "-c".to_string(),
            EXEC_SCRIPT.to_string(),
            "sbx-exec".to_string(),
        ];
        args.extend(req.command.iter().cloned());
        let process = bundle::process(args, exec_env(&record, &req.env), &record.image.cwd, &user);
        let tag = Uuid::new_v4().simple().to_string();
        let process_file = run.dir.join(format!("exec-{tag}.json"));
        let pid_file = run.dir.join(format!("exec-{tag}.pid"));
        let json = serde_json::to_vec(&process).map_err(|e| internal("encoding the exec", e))?;
        std::fs::write(&process_file, json).map_err(|e| internal("writing the exec", e))?;
        let mut command =
            self.inner
                .runtime
                .exec_command(&id.to_string(), &process_file, &pid_file);
        command.stdout(Stdio::piped()).stderr(Stdio::piped());
        let child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                let _ = std::fs::remove_file(&process_file);
                return Err(internal("spawning the runtime's exec", e));
            }
        };
        let timeout =
            (req.timeout_seconds > 0).then(|| Duration::from_secs(u64::from(req.timeout_seconds)));
        // Kills the exec'd process itself: the runtime cannot pass SIGKILL on.
        let end = {
            let pid_file = pid_file.clone();
            move || {
                if let Some(pid) = std::fs::read_to_string(&pid_file)
                    .ok()
                    .and_then(|t| t.trim().parse::<i32>().ok())
                {
                    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
        };
        let finished = move || {
            let _ = std::fs::remove_file(&process_file);
            let _ = std::fs::remove_file(&pid_file);
        };
        exec::stream_output(child, timeout, end, finished)
    }
}

/// The exec's environment: the workload's, with the request's variables replacing
/// same-named ones.
fn exec_env(record: &OciRecord, extra: &std::collections::HashMap<String, String>) -> Vec<String> {
    let mut env: Vec<String> = record
        .image
        .env
        .iter()
        .filter(|kv| {
            let key = kv.split_once('=').map_or(kv.as_str(), |(k, _)| k);
            !extra.contains_key(key)
        })
        .cloned()
        .collect();
    let mut extra: Vec<(&String, &String)> = extra.iter().collect();
    extra.sort();
    env.extend(extra.into_iter().map(|(k, v)| format!("{k}={v}")));
    env
}

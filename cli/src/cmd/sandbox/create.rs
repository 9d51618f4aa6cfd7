//! `sbx sandbox create`: the sandbox asked for, made (its image pulled first when the
//! store lacks it), filled with `--upload`s before its first start, and waited for.

use std::time::Duration;
use std::time::SystemTime;

use clap::Args;
use rand::RngExt;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    CreateSandboxRequest, Resources, SandboxRef, SandboxSpec, StartSandboxRequest,
};

use super::files::{self, Upload, parse_upload};
use super::network::{NetworkModeArg, mode_and_allow};
use super::view::render_sandbox;
use crate::args::{key_value_map, parse_key_value, parse_name};
use crate::cmd::image::{PullPolicy, create_pulling};
use crate::cmd::version::gateway_info;
use crate::connect::{Target, connect};
use crate::lifetime::LifetimeFlags;
use crate::output::OutputArgs;
use crate::reply::print;
use crate::wait::{DEFAULT_SETTLE, Goal, WaitOptions, follow, present};
use crate::{CliError, size};

/// The long help of `sbx sandbox create`: what the wait promises.
pub const CREATE_ABOUT: &str = "Create a sandbox running CMD ARGS… and (unless --detach) wait \
    until it is Ready.\n\n\
    `sbx sandbox create NAME -- CMD ARGS…` (`-n NAME` works too). The wait follows the \
    gateway's watch stream. What Ready promises, when create exits 0 and prints phase Ready: \
    the driver started the main process, the sandbox then stayed Ready for --settle \
    (default 0: create answers the moment the gateway records Ready), and the gateway's \
    record, read just before printing, still said Ready. A main process that ends within the \
    wait (or the settle window) is reported as what it is: exit 0 makes the \
    sandbox Completed (printed, exit 0); a non-zero exit or a signal makes it Error, and \
    create fails (exit 1) with the reason and status, e.g. `sandbox \"web\" failed: \
    main process exited with status 3`. Ready does not promise the process \
    keeps running afterwards (drivers notice an exit within about 250 ms; see `sbx sandbox \
    get`, `sbx wait`); --settle 500 also catches a main process that fails at once.";

#[derive(Debug, Clone, Args)]
pub struct SandboxCreateArgs {
    /// The workspace to create the sandbox in (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// The sandbox's name, unique in its workspace (default: "sbx-" + 8 random characters).
    #[arg(value_name = "NAME", value_parser = parse_name, conflicts_with = "name_flag")]
    pub name: Option<String>,
    /// The sandbox's name, as an option (the same as NAME).
    #[arg(short = 'n', long = "name", id = "name_flag", value_name = "NAME", value_parser = parse_name)]
    pub name_flag: Option<String>,
    /// A label to set, KEY=VALUE; repeatable.
    #[arg(short = 'l', long = "label", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub labels: Vec<(String, String)>,
    /// An environment variable of the workload, KEY=VALUE; repeatable.
    #[arg(short = 'e', long = "env", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub env: Vec<(String, String)>,
    /// CPU limit: cores (2, 0.5) or millicores (500m). Default: no limit.
    #[arg(long, value_name = "CPU", value_parser = size::parse_cpu)]
    pub cpu: Option<u32>,
    /// Memory limit: bytes, or with a unit: 512Mi, 1.5Gi (powers of 1024), 500M, 1G (powers
    /// of 1000). Default: no limit.
    #[arg(long, value_name = "SIZE", value_parser = size::parse_size)]
    pub memory: Option<u64>,
    /// Disk limit (the root filesystem's writable layer and /sandbox together), as --memory
    /// takes sizes: 2Gi, 500M. Default: the workspace's default, else the gateway's
    /// (sbxd --default-disk, 10Gi), on drivers that limit disk.
    #[arg(long, value_name = "SIZE", value_parser = size::parse_size)]
    pub disk: Option<u64>,
    /// The image to run, for drivers with images: a name (busybox, name:tag), name@sha256:…
    /// or sha256:… (default: the gateway's default image). The gateway pins its digest.
    #[arg(long, value_name = "REF")]
    pub image: Option<String>,
    /// When the image is pulled from its registry first: when the store lacks it
    /// (missing), before every create (always), or never.
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = PullPolicy::Missing)]
    pub pull: PullPolicy,
    /// The compute driver to run the sandbox on (default: the gateway's default driver).
    #[arg(long, value_name = "DRIVER")]
    pub driver: Option<String>,
    /// The node to run on, by name (`sbx node list`; "local": the gateway's own drivers).
    /// Default: the gateway places it on the least committed node with room.
    #[arg(long, value_name = "NODE", value_parser = parse_name)]
    pub node: Option<String>,
    /// Only nodes with this label (KEY=VALUE, as `sbx node add --label` set it); repeat.
    #[arg(long = "node-selector", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub node_selector: Vec<(String, String)>,
    /// Create the sandbox without starting its workload: it is Stopped until `sbx sandbox
    /// start` (its files are there, for `sbx sandbox cp`, on drivers that copy while stopped).
    #[arg(long)]
    pub stopped: bool,
    /// Copy a local file or directory into the sandbox before its workload first starts:
    /// LOCAL or LOCAL:DEST, named as `sbx sandbox cp LOCAL NAME:DEST` names it (DEST defaults
    /// to /sandbox: a directory `app` lands at /sandbox/app). Repeatable; needs a driver that
    /// copies while stopped (`sbx version` lists it as cp-when-stopped).
    #[arg(long = "upload", value_name = "LOCAL[:DEST]", value_parser = parse_upload)]
    pub uploads: Vec<Upload>,
    /// A provider of the workspace to attach before the first start, by name or UUID: its
    /// credentials reach the workload's environment and every exec's. Repeatable.
    #[arg(long = "provider", value_name = "PROVIDER")]
    pub providers: Vec<String>,
    /// The sandbox's network: none (loopback only; the default) or policy (an address on
    /// the gateway's network; every connection denied but those --allow admits). --allow
    /// alone means policy.
    #[arg(long, value_enum, value_name = "MODE")]
    pub network: Option<NetworkModeArg>,
    /// With --network policy: admit connections to CIDR[:PORT[-PORT]][/tcp|/udp] (e.g.
    /// 10.1.2.3:443, 10.0.0.0/8:8000-8100/tcp, 192.168.5.7 for every port) or to what a
    /// HOSTNAME[:PORT…] resolves to through the gateway's resolver (api.example.test:443,
    /// *.example.test:443 for every name below it). Repeatable; changed later with `sbx
    /// sandbox network allow|deny|set`.
    #[arg(long = "allow", value_name = "ENTRY")]
    pub allow: Vec<String>,
    #[command(flatten)]
    pub lifetime: LifetimeFlags,
    /// Print the sandbox as soon as it is created, without waiting for Ready.
    #[arg(short = 'd', long)]
    pub detach: bool,
    /// How long to wait for Ready before giving up (the sandbox is left as it is): seconds,
    /// or 30s, 2m, 1h.
    #[arg(long, value_name = "DURATION", default_value_t = 120, value_parser = size::parse_secs)]
    pub timeout: u64,
    /// How long the sandbox must stay Ready before create reports it, in milliseconds (a
    /// main process that ends within it is reported as Completed or as the failure).
    #[arg(long, value_name = "MS", default_value_t = DEFAULT_SETTLE.as_millis() as u64)]
    pub settle: u64,
    /// The workload's command and its arguments, after `--` (may be left out on a driver with
    /// images when the image has an Entrypoint or Cmd: the image's default then runs).
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// Prefix of generated sandbox names.
const GENERATED_NAME_PREFIX: &str = "sbx-";
/// The characters of the random part of a generated name: all valid anywhere in a DNS-1123
/// label, so the name always passes `validate_name`.
const GENERATED_NAME_ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
/// Length of the random part: 36^8 ≈ 2.8e12 names, so collisions in one workspace are rare.
const GENERATED_NAME_RANDOM_LEN: usize = 8;

/// A fresh sandbox name: `sbx-` + 8 random lowercase letters and digits.
pub fn generate_sandbox_name<R: rand::Rng + ?Sized>(rng: &mut R) -> String {
    let mut name = String::with_capacity(GENERATED_NAME_PREFIX.len() + GENERATED_NAME_RANDOM_LEN);
    name.push_str(GENERATED_NAME_PREFIX);
    for _ in 0..GENERATED_NAME_RANDOM_LEN {
        let index = rng.random_range(0..GENERATED_NAME_ALPHABET.len());
        name.push(char::from(GENERATED_NAME_ALPHABET[index]));
    }
    name
}

/// The create request; `generated_name` is used only when `--name` was not given.
pub fn create_sandbox_request(
    args: &SandboxCreateArgs,
    generated_name: String,
) -> Result<CreateSandboxRequest, CliError> {
    let resources =
        (args.cpu.is_some() || args.memory.is_some() || args.disk.is_some()).then(|| Resources {
            cpu_millis: args.cpu.unwrap_or(0),
            memory_bytes: args.memory.unwrap_or(0),
            disk_bytes: args.disk.unwrap_or(0),
        });
    Ok(CreateSandboxRequest {
        providers: args.providers.clone(),
        workspace: args.workspace.clone().unwrap_or_default(),
        name: args
            .name
            .clone()
            .or_else(|| args.name_flag.clone())
            .unwrap_or(generated_name),
        spec: Some(SandboxSpec {
            command: args.command.clone(),
            env: key_value_map("--env", &args.env)?,
            labels: key_value_map("--label", &args.labels)?,
            resources,
            driver: args.driver.clone().unwrap_or_default(),
            image: args.image.clone().unwrap_or_default(),
            image_digest: String::new(),
            network: mode_and_allow(args.network, &args.allow)?,
            node: args.node.clone().unwrap_or_default(),
            node_selector: key_value_map("--node-selector", &args.node_selector)?,
            lifetime: args.lifetime.lifetime()?,
        }),
        stopped: args.stopped || !args.uploads.is_empty(),
    })
}

/// `sbx sandbox create`.
pub async fn run_create(target: &Target, args: &SandboxCreateArgs) -> Result<u8, CliError> {
    let generated = generate_sandbox_name(&mut rand::rng());
    let req = create_sandbox_request(args, generated)?;
    if !args.uploads.is_empty() {
        check_uploads(target, args).await?;
    }
    let mut client = SandboxServiceClient::new(connect(target).await?);
    let created = create_pulling(target, &mut client, req, args.pull).await?;
    let options = WaitOptions {
        timeout: Duration::from_secs(args.timeout),
        settle: Duration::from_millis(args.settle),
    };
    let sandbox = if args.uploads.is_empty() {
        if args.detach {
            created
        } else {
            let goal = if args.stopped {
                Goal::Stopped
            } else {
                Goal::Ready
            };
            present(follow(&client, created, goal, options).await?)?
        }
    } else {
        // Made (Stopped) first, then filled, then started.
        let made = present(follow(&client, created, Goal::Stopped, options).await?)?;
        let this = SandboxRef {
            id: made.id.clone(),
            workspace: String::new(),
            name: String::new(),
        };
        for upload in &args.uploads {
            let copied = files::upload(
                &mut client,
                this.clone(),
                &upload.local,
                upload.dest.clone(),
            )
            .await;
            if let Err(e) = copied {
                eprintln!(
                    "sbx: uploading {} to {}:{} failed; sandbox {:?} (id {}) was created and \
                     left Stopped: copy again with `sbx sandbox cp` and start it, or delete it",
                    upload.local.display(),
                    made.name,
                    upload.dest,
                    made.name,
                    made.id
                );
                return Err(e);
            }
        }
        if args.stopped {
            made
        } else {
            let started = client
                .start_sandbox(StartSandboxRequest {
                    sandbox: Some(this),
                })
                .await?
                .into_inner();
            if args.detach {
                started
            } else {
                present(follow(&client, started, Goal::Ready, options).await?)?
            }
        }
    };
    print(&render_sandbox(&args.output, &sandbox, SystemTime::now())?)?;
    Ok(0)
}

/// Before anything is created: every `--upload`'s local path exists, and the sandbox's
/// driver can copy into a sandbox that has not started.
async fn check_uploads(target: &Target, args: &SandboxCreateArgs) -> Result<(), CliError> {
    for upload in &args.uploads {
        std::fs::symlink_metadata(&upload.local).map_err(|e| CliError::LocalPath {
            path: upload.local.clone(),
            source: e,
        })?;
        if !upload.dest.starts_with('/') {
            return Err(CliError::Usage(format!(
                "--upload {}:{}: the destination must be an absolute path in the sandbox",
                upload.local.display(),
                upload.dest
            )));
        }
    }
    // An older gateway that cannot say is left to answer the copy itself.
    let Ok(info) = gateway_info(target).await else {
        return Ok(());
    };
    let driver = args.driver.clone().unwrap_or(info.default_driver);
    match info.drivers.iter().find(|d| d.name == driver) {
        Some(d) if d.error.is_empty() && !d.copy_when_stopped => Err(CliError::Usage(format!(
            "--upload: driver {driver:?} cannot copy files into a sandbox before it starts; \
             create the sandbox, then copy with `sbx sandbox cp` once it is Ready"
        ))),
        _ => Ok(()),
    }
}

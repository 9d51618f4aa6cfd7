//! The oci driver's flags (`--oci-*`): `sbxd serve` and a driver host (`sbxd driver`, `sbxd
//! node`) take them through the driver registry, and a managed driver host is passed them again
//! ([`OciArgs::to_flags`]). The sandbox network's flags and the host drivers' shared ones
//! (`--uid-pool`, `--log-max`, …) are `sbx_network`'s and `sbx_host_kit`'s; the registry
//! lists them after these, under this heading.

use std::ffi::OsString;
use std::path::PathBuf;

use crate::OciDriverOptions;

/// The oci driver's settings: flags of `sbxd serve` (for `--driver oci` and `managed:oci`,
/// which passes them on to its driver process) and of `sbxd driver --backend oci`. Unused by
/// the other drivers.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
#[command(next_help_heading = "oci driver")]
pub struct OciArgs {
    /// The OCI runtime that runs the containers: a path, or a name looked up on PATH (runc
    /// by default; crun and other runtimes with runc's command line work too).
    #[arg(
        id = "oci_runtime",
        long = "oci-runtime",
        env = "SBX_OCI_RUNTIME",
        default_value = "runc",
        value_name = "PATH"
    )]
    pub runtime: PathBuf,

    /// The most processes (threads included) one sandbox may run at once: a fork bomb stops
    /// there.
    #[arg(
        id = "oci_pids_limit",
        long = "oci-pids-limit",
        env = "SBX_OCI_PIDS_LIMIT",
        default_value_t = 1024,
        value_parser = parse_pids_limit,
        value_name = "N"
    )]
    pub pids_limit: i64,

    /// The most processes every oci sandbox of this gateway may run together (the pids.max
    /// of --oci-cgroup-parent): many sandboxes at their own limit cannot take the host's
    /// pids. Default: half of kernel.pid_max (or of kernel.threads-max, the lower).
    #[arg(
        id = "oci_pids_total",
        long = "oci-pids-total",
        env = "SBX_OCI_PIDS_TOTAL",
        value_parser = parse_pids_total,
        value_name = "N"
    )]
    pub pids_total: Option<u64>,

    /// The static busybox the sandbox init runs on (bound read-only into every sandbox at
    /// /dev/.sbx). Default: /bin/busybox, else /usr/bin/busybox (Debian's busybox-static).
    #[arg(
        id = "oci_busybox",
        long = "oci-busybox",
        env = "SBX_OCI_BUSYBOX",
        value_name = "PATH"
    )]
    pub busybox: Option<PathBuf>,

    /// The cgroup (from each hierarchy's root) under which sandbox cgroups are made.
    #[arg(
        id = "oci_cgroup_parent",
        long = "oci-cgroup-parent",
        env = "SBX_OCI_CGROUP_PARENT",
        default_value = "sbx-oci",
        value_name = "PATH"
    )]
    pub cgroup_parent: String,
}

/// `--oci-pids-total`: at least 64, at most 4 Mi.
pub fn parse_pids_total(text: &str) -> Result<u64, String> {
    sbx_host_kit::flags::parse_bounded(text, "processes", 64, 4 << 20)
}

/// A pids limit: at least 16 (the init, a shell and a few commands), at most 4 Mi.
pub fn parse_pids_limit(text: &str) -> Result<i64, String> {
    sbx_host_kit::flags::parse_bounded(text, "processes", 16, 4 << 20).map(|n| n as i64)
}

impl Default for OciArgs {
    fn default() -> Self {
        let opts = OciDriverOptions::default();
        OciArgs {
            runtime: PathBuf::from("runc"),
            pids_limit: opts.pids_limit,
            pids_total: opts.pids_total,
            busybox: None,
            cgroup_parent: opts.cgroup_parent,
        }
    }
}

impl OciArgs {
    /// The driver's options: these settings, and the driver's defaults for the rest (the
    /// opener adds the network, the uid pool and the caps).
    pub fn driver_options(&self) -> OciDriverOptions {
        OciDriverOptions {
            runtime: Some(self.runtime.clone()),
            busybox: self.busybox.clone(),
            cgroup_parent: self.cgroup_parent.clone(),
            pids_limit: self.pids_limit,
            pids_total: self.pids_total,
            ..OciDriverOptions::default()
        }
    }

    /// These settings as the `--oci-*` flags of a driver host sbxd starts: parsing them (in
    /// the same environment, which the child inherits) gives these settings back.
    pub fn to_flags(&self) -> Vec<OsString> {
        let mut flags: Vec<OsString> = vec![
            "--oci-runtime".into(),
            self.runtime.clone().into(),
            "--oci-pids-limit".into(),
            self.pids_limit.to_string().into(),
            "--oci-cgroup-parent".into(),
            self.cgroup_parent.clone().into(),
        ];
        if let Some(total) = self.pids_total {
            flags.push("--oci-pids-total".into());
            flags.push(total.to_string().into());
        }
        if let Some(busybox) = &self.busybox {
            flags.push("--oci-busybox".into());
            flags.push(busybox.into());
        }
        flags
    }

    /// The paths among these flags that a relative value must be made absolute in (once, at
    /// start, against the current directory): the busybox, and the runtime when it is a path
    /// rather than a name looked up on PATH.
    pub fn paths_mut(&mut self) -> Vec<&mut PathBuf> {
        let mut paths: Vec<&mut PathBuf> = self.busybox.iter_mut().collect();
        if self.runtime.components().count() > 1 {
            paths.push(&mut self.runtime);
        }
        paths
    }
}

#[cfg(test)]
mod flag_tests {
    use clap::{Args, FromArgMatches};

    use super::*;

    fn parse(args: &[&str]) -> Result<OciArgs, clap::Error> {
        OciArgs::augment_args(clap::Command::new("oci"))
            .try_get_matches_from(std::iter::once("oci").chain(args.iter().copied()))
            .and_then(|m| OciArgs::from_arg_matches(&m))
    }

    #[test]
    fn oci_flags_round_trip_and_a_bad_limit_says_why() {
        let args = parse(&[
            "--oci-runtime",
            "crun",
            "--oci-pids-limit",
            "64",
            "--oci-pids-total",
            "4096",
            "--oci-busybox",
            "/opt/busybox",
        ])
        .unwrap();
        let opts = args.driver_options();
        assert_eq!(opts.runtime, Some(PathBuf::from("crun")));
        assert_eq!(opts.pids_limit, 64);
        assert_eq!(opts.pids_total, Some(4096));
        for oci in [OciArgs::default(), args] {
            let flags: Vec<String> = oci
                .to_flags()
                .iter()
                .map(|f| f.to_string_lossy().into_owned())
                .collect();
            let again = parse(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
            assert_eq!(again, oci);
        }
        let err = parse_pids_limit("3").unwrap_err();
        assert!(err.contains("at least 16"), "{err}");
        let err = parse_pids_total("5000000").unwrap_err();
        assert!(err.contains("at most"), "{err}");
    }

    #[test]
    fn only_a_runtime_given_as_a_path_is_made_absolute() {
        let mut args = OciArgs::default();
        assert!(args.paths_mut().is_empty());
        args.runtime = PathBuf::from("bin/crun");
        args.busybox = Some(PathBuf::from("bb"));
        assert_eq!(args.paths_mut().len(), 2);
    }
}

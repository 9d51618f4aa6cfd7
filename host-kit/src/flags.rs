//! The settings every host driver (oci, process and vm) shares, as flags: the host's uid pool
//! (`--uid-pool`, `--uid-lease-dir`), the cap on a sandbox's log (`--log-max`) and on its ptys
//! (`--max-ptys`). `sbxd serve` and a driver host (`sbxd driver`, `sbxd node`) take them
//! through the driver registry; a managed driver host is passed them again
//! ([`HostDriverArgs::to_flags`]). [`parse_bounded`] is the drivers' own flags' parser of a
//! bounded whole number.

use std::ffi::OsString;
use std::path::PathBuf;

use crate::uidpool::UidPool;

/// The host drivers' shared settings. No help heading of their own: the registry places them
/// (under the oci driver's, where they have always been listed).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct HostDriverArgs {
    /// The host ids sandboxes (oci, process and vm: a VM's QEMU runs as its range's first uid)
    /// take their own range of 65536 from: START:COUNT as in /etc/subuid, COUNT a multiple of
    /// 65536 (the default holds 4096 sandboxes at once).
    /// Root's /etc/subuid and /etc/subgid must grant it for the process driver (newuidmap);
    /// it must not overlap the image store's 200000..265535.
    #[arg(
        id = "uid_pool",
        long = "uid-pool",
        env = "SBX_UID_POOL",
        default_value = "1000000:268435456",
        value_name = "START:COUNT",
        value_parser = crate::uidpool::parse_pool
    )]
    pub uid_pool: (u32, u32),

    /// Where the host's uid leases are kept (one file per sandbox's range): shared by every
    /// gateway and driver host on this machine, so none hands out a range another holds.
    #[arg(
        id = "uid_lease_dir",
        long = "uid-lease-dir",
        env = "SBX_UID_LEASE_DIR",
        default_value = crate::uidpool::DEFAULT_LEASE_DIR,
        value_name = "DIR"
    )]
    pub uid_lease_dir: PathBuf,

    /// The most a sandbox's log keeps on disk (oci and process; vm: its console): the log and the part before
    /// it together, the newest output kept (10Mi, 512Ki, …; at least 1Mi). A workload that
    /// writes more loses its oldest output, never the host's disk.
    #[arg(
        id = "log_max",
        long = "log-max",
        env = "SBX_LOG_MAX",
        default_value = "10Mi",
        value_name = "SIZE",
        value_parser = parse_log_max
    )]
    pub log_max: u64,

    /// The most ptys a sandbox holds in each of its two terminal instances (oci and process):
    /// its own /dev/pts, and the one its execs' terminals come from. A sandbox that opens
    /// more gets ENOSPC; neither instance can take the ptys the kernel keeps for the host's
    /// own terminals (kernel.pty.reserve).
    #[arg(
        id = "max_ptys",
        long = "max-ptys",
        env = "SBX_MAX_PTYS",
        default_value_t = crate::ptys::DEFAULT_MAX_PTYS,
        value_parser = crate::ptys::parse_max_ptys,
        value_name = "N"
    )]
    pub max_ptys: u32,
}

impl Default for HostDriverArgs {
    fn default() -> Self {
        HostDriverArgs {
            uid_pool: (crate::uidpool::DEFAULT_START, crate::uidpool::DEFAULT_COUNT),
            uid_lease_dir: PathBuf::from(crate::uidpool::DEFAULT_LEASE_DIR),
            log_max: crate::logfile::DEFAULT_LOG_MAX,
            max_ptys: crate::ptys::DEFAULT_MAX_PTYS,
        }
    }
}

impl HostDriverArgs {
    /// The pool `--uid-pool` and `--uid-lease-dir` give.
    pub fn uid_pool(&self) -> UidPool {
        UidPool {
            start: self.uid_pool.0,
            count: self.uid_pool.1,
            lease_dir: self.uid_lease_dir.clone(),
        }
    }

    /// What a driver host running sandboxes of its own (oci, process or vm) is told of them:
    /// `--uid-pool`, `--uid-lease-dir`, `--log-max` and `--max-ptys`.
    pub fn to_flags(&self) -> Vec<OsString> {
        vec![
            "--uid-pool".into(),
            format!("{}:{}", self.uid_pool.0, self.uid_pool.1).into(),
            "--uid-lease-dir".into(),
            self.uid_lease_dir.clone().into(),
            "--log-max".into(),
            self.log_max.to_string().into(),
            "--max-ptys".into(),
            self.max_ptys.to_string().into(),
        ]
    }
}

/// `--log-max`: a size (see `sbx_proto::quantity`) of at least `sbx_agent::log::MIN_CAP`.
pub fn parse_log_max(text: &str) -> Result<u64, String> {
    match sbx_proto::quantity::parse_bytes(text) {
        Some(bytes) if bytes >= sbx_agent::log::MIN_CAP => Ok(bytes),
        Some(_) => Err("a sandbox's log keeps at least 1Mi".to_string()),
        None => Err("not a size: write bytes, or a number with Ki, Mi or Gi (10Mi)".to_string()),
    }
}

/// A whole number of `unit` within `min..=max`, or an error that says what is expected.
pub fn parse_bounded(text: &str, unit: &str, min: u64, max: u64) -> Result<u64, String> {
    let value: u64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a whole number of {unit}"))?;
    if value < min {
        return Err(format!("{value} {unit} is too small: at least {min}"));
    }
    if value > max {
        return Err(format!("{value} {unit} is too large: at most {max}"));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_cap_is_a_size_of_at_least_a_mebibyte() {
        assert_eq!(parse_log_max("10Mi"), Ok(10 << 20));
        assert_eq!(parse_log_max("1048576"), Ok(1 << 20));
        assert!(parse_log_max("512Ki").unwrap_err().contains("at least 1Mi"));
        assert!(parse_log_max("lots").unwrap_err().contains("not a size"));
    }

    #[test]
    fn the_defaults_are_the_flags_defaults() {
        use clap::{Args, FromArgMatches};
        let parsed = HostDriverArgs::augment_args(clap::Command::new("host"))
            .try_get_matches_from(["host"])
            .and_then(|m| HostDriverArgs::from_arg_matches(&m))
            .unwrap();
        assert_eq!(parsed, HostDriverArgs::default());
        assert_eq!(parsed.log_max, 10 << 20);
    }
}

//! The process driver's own settings: its cgroup parent, a flag of `sbxd serve`
//! (`--process-cgroup-parent`), and the paths it hides from its workloads, which whoever opens
//! it gives (sbxd: its data dir). A driver host takes both as flags of its own (`--cgroup-parent`,
//! `--hide`), as it always has, and fills these settings from them.

use std::path::PathBuf;

/// The process driver's settings.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct ProcessArgs {
    /// process driver: the cgroup (relative to sbxd's own, in each hierarchy) under which
    /// sandbox cgroups are made.
    #[arg(
        id = "process_cgroup_parent",
        long = "process-cgroup-parent",
        env = "SBX_PROCESS_CGROUP_PARENT",
        default_value = "sbx",
        value_name = "PATH"
    )]
    pub cgroup_parent: String,

    /// Paths the driver hides from its workloads (under an empty read-only tmpfs), besides
    /// its own state dir: not a flag of sbxd's, which hides its data dir.
    #[arg(skip)]
    pub hidden_paths: Vec<PathBuf>,
}

impl Default for ProcessArgs {
    fn default() -> Self {
        ProcessArgs {
            cgroup_parent: "sbx".to_string(),
            hidden_paths: Vec::new(),
        }
    }
}

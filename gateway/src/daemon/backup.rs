//! `sbxd store backup` and `sbxd store restore`: the operator's way back from a store that
//! sbxd refuses at startup (see `sbx_storage::backup_store` for the file's format and why the
//! store must be closed). Exit codes: 0 done, 1 refused or failed (what and why on stderr),
//! 2 the store is in use (sbxd runs on the data dir), as for `sbxd store check`.

use std::process::ExitCode;
use std::time::{Duration, Instant, UNIX_EPOCH};

use sbx_storage::{BackupError, BackupSummary, backup_store, restore_store};

use clap::Args;

use super::DataDirArg;

fn failed(e: &BackupError) -> ExitCode {
    eprintln!("error: {e}");
    match e {
        BackupError::InUse { .. } => ExitCode::from(2),
        _ => ExitCode::from(1),
    }
}

fn describe(s: &BackupSummary) -> String {
    let at = sbx_proto::time::rfc3339_nanos(UNIX_EPOCH + Duration::from_millis(s.written_at_ms));
    let at = at.split_once('.').map(|(secs, _)| format!("{secs}Z"));
    format!(
        "{} records ({} entries in {} trees), revision {}, high-water mark {}, schema version \
         {}, {} bytes, backed up at {}",
        s.records,
        s.entries,
        s.trees,
        s.revision,
        s.high_water
            .map(|m| m.to_string())
            .unwrap_or_else(|| "none".into()),
        s.schema_version,
        s.bytes,
        at.unwrap_or_else(|| "?".into())
    )
}

/// The arguments of `store backup` and `store restore`; what `--force` does is told per
/// command (`mut_arg` on each).
#[derive(Debug, Args)]
pub struct BackupArgs {
    /// The backup file.
    #[arg(value_name = "FILE")]
    pub file: std::path::PathBuf,
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub data: DataDirArg,
}

/// DATA/store, or the exit after saying why there is no data dir.
fn store_path(args: &BackupArgs) -> Result<std::path::PathBuf, ExitCode> {
    match super::drivers::data_dir(args.data.data_dir.as_deref()).map_err(|e| e.to_string()) {
        Ok(data) => Ok(data.join("store")),
        Err(message) => {
            eprintln!("error: {message}");
            Err(ExitCode::from(1))
        }
    }
}

pub fn backup(args: &BackupArgs) -> ExitCode {
    let store = match store_path(args) {
        Ok(store) => store,
        Err(code) => return code,
    };
    let began = Instant::now();
    match backup_store(&store, &args.file, args.force) {
        Err(e) => failed(&e),
        Ok(summary) => {
            println!(
                "backed up {} to {}: {} in {:?}",
                store.display(),
                args.file.display(),
                describe(&summary),
                began.elapsed()
            );
            if summary
                .high_water
                .is_some_and(|mark| mark > summary.revision)
            {
                eprintln!(
                    "warning: the store had lost commits when it was backed up (revision {}, \
                     high-water mark {}): the backup holds what was left",
                    summary.revision,
                    summary.high_water.unwrap_or_default()
                );
            }
            ExitCode::SUCCESS
        }
    }
}

pub fn restore(args: &BackupArgs) -> ExitCode {
    let store = match store_path(args) {
        Ok(store) => store,
        Err(code) => return code,
    };
    if let Some(data) = store.parent()
        && let Err(e) = std::fs::create_dir_all(data)
    {
        eprintln!("error: cannot create the data dir {}: {e}", data.display());
        return ExitCode::from(1);
    }
    let began = Instant::now();
    match restore_store(&args.file, &store, args.force) {
        Err(e) => failed(&e),
        Ok(restored) => {
            println!(
                "restored {} into {}: {}; high-water mark set to {}; checked: 0 index \
                 problems, in {:?}",
                args.file.display(),
                store.display(),
                describe(&restored.summary),
                restored.report.revision,
                began.elapsed()
            );
            if let Some(aside) = &restored.moved_aside {
                println!(
                    "the store that was there is kept in {} (with its high-water mark)",
                    aside.display()
                );
            }
            if let Some(mark) = &restored.mark_moved_aside {
                println!(
                    "the high-water mark that was there (without a store) is kept in {}",
                    mark.display()
                );
            }
            ExitCode::SUCCESS
        }
    }
}

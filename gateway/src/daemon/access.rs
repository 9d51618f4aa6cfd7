//! `sbxd token …` and `sbxd certs …`: the operator's side of authentication ([`crate::auth`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, UNIX_EPOCH};

use clap::{Args, Subcommand};

use super::DataDirArg;
use super::backup::BackupArgs;
use crate::auth::Role;
use crate::auth::tokens::{self, NewIdentity};

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Make an identity and print its bearer token (alone, on the last line; it is shown
    /// only this once: the gateway keeps its hash).
    Create(TokenCreateArgs),
    /// The identities: name, role, workspaces, expiry (never a secret).
    List(DataDirArg),
    /// Remove an identity: its token and its certificate stop working at the next call,
    /// and its open streams end within a second.
    Revoke(TokenRevokeArgs),
}

#[derive(Debug, Args)]
pub struct TokenCreateArgs {
    /// The identity's name (a DNS-1123 label); also the subject common name of its client
    /// certificate, if it has one.
    #[arg(long, value_name = "NAME")]
    pub name: String,
    /// A workspace the role holds in; repeat for several. None: every workspace (a
    /// gateway-wide grant, which images need).
    #[arg(long = "workspace", short = 'w', value_name = "WORKSPACE")]
    pub workspaces: Vec<String>,
    /// viewer (read), editor (also change sandboxes, exec, cp, port-forward) or admin (also
    /// create and delete the workspaces).
    #[arg(long, value_enum)]
    pub role: Role,
    /// How long the identity lives: seconds, or 30s, 15m, 24h, 7d. Default: until revoked.
    #[arg(long, value_name = "DURATION", value_parser = parse_ttl)]
    pub ttl: Option<Duration>,
    /// No token: the identity is for a client certificate (mutual TLS) with this name only.
    #[arg(long)]
    pub cert_only: bool,
    /// Print the token in E2B's API-key form (`e2b_` + 40 hex digits) for the E2B SDKs
    /// (`sbxd serve --e2b-listen`): give it as E2B_API_KEY. It works as any other token.
    #[arg(long, conflicts_with = "cert_only")]
    pub e2b: bool,
    #[command(flatten)]
    pub data: DataDirArg,
}

#[derive(Debug, Args)]
pub struct TokenRevokeArgs {
    /// The identity to remove.
    pub name: String,
    #[command(flatten)]
    pub data: DataDirArg,
}

#[derive(Debug, Subcommand)]
pub enum CertsCommand {
    /// Make a CA, a server certificate and client certificates (PEM) in DIR.
    Init(Box<super::certs::CertsInitArgs>),
}

#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Check the store: its revision against the high-water mark of acknowledged commits, and
    /// its indexes against its records. Exit 0 when healthy, 1 when damaged (what is wrong on
    /// stderr), 2 when it cannot be opened (sbxd running on it, for one).
    Check(DataDirArg),
    /// Write a copy of the whole store to FILE (while sbxd is not running on it).
    #[command(long_about = BACKUP_HELP,
              mut_arg("force", |a| a.help("Replace FILE if it exists")))]
    Backup(BackupArgs),
    /// Put a backup made by `sbxd store backup` in place of the store (while sbxd is not
    /// running on it).
    #[command(long_about = RESTORE_HELP,
              mut_arg("force", |a| a.help("Restore over the store in the data dir: it is moved \
                  to DATA/store.before-restore-<unix time>, never deleted")))]
    Restore(BackupArgs),
    /// Copy the store of a stopped gateway into an empty PostgreSQL database, then check the
    /// copy record by record.
    #[command(long_about = MIGRATE_HELP)]
    Migrate(super::store::MigrateArgs),
}

const MIGRATE_HELP: &str = "Copy DATA/store, the embedded store of a stopped gateway, into \
    an empty PostgreSQL database, so that gateways started with `--store URL` serve what it \
    held: every record as it is (ids, names, times, resource versions), the revision, and the \
    order of its indexes. The copy is one transaction, then checked against the original \
    record by record; the embedded store is only read, never changed.\n\n\
    sbxd must be stopped (the copy takes the store's lock; refused, exit 2, while sbxd runs \
    on it). A damaged store is refused: `sbxd store check` says why. A database that holds \
    records is refused. The password comes from --store-password-file or \
    $SBX_STORE_PASSWORD, never from the URL. Exit 0: copied and checked; 1: the copy failed \
    or differs (the database is left as the failure left it: empty when the transaction \
    failed); 2: a store could not be opened.";

const BACKUP_HELP: &str = "Write a copy of the whole store to FILE: every record and index \
    of DATA/store, with its revision and its high-water mark, in one file that says what it \
    holds (a versioned header, the record count, a SHA-256 checksum of all of it).\n\n\
    When: while the store is whole — before an upgrade, on a schedule, before anything risky \
    — so that a store sbxd later refuses at startup (`sbxd store check` says why) can be put \
    back with `sbxd store restore` instead of served with what it lost \
    (--accept-store-loss).\n\n\
    sbxd must be stopped: the backup takes the store's lock, so it is consistent, and is \
    refused (exit 2) while sbxd runs on the data dir. The file is written as FILE.tmp, \
    fsynced and renamed, so FILE is never a half file; an existing FILE is replaced only with \
    --force. It never changes the store.";

const RESTORE_HELP: &str = "Put the store saved in FILE (by `sbxd store backup`) in place of \
    DATA/store, so that `sbxd serve` starts on it and serves exactly what was backed up.\n\n\
    When: sbxd refused its store at startup (lost commits, a cut log, broken indexes) and \
    there is a backup taken before; or to move a gateway's store to another machine.\n\n\
    FILE is checked first (header, format version, length, checksum, counts): a truncated or \
    altered file is refused and nothing changes. A data dir that already holds a store is \
    refused unless --force; then that store is moved to DATA/store.before-restore-<unix \
    time> (its high-water mark beside it) — it is never deleted. The backup is imported \
    beside the store and renamed into place only when complete; the high-water mark is set \
    to the backup's revision and the result is checked. Commits made after the backup are \
    not in it: sandboxes created since have no record in the restored store (workloads of \
    theirs still on a driver are left to the reconciler, as for any record lost). Refused \
    (exit 2) while sbxd runs on the data dir.";

pub fn run_store(command: StoreCommand) -> ExitCode {
    match command {
        StoreCommand::Backup(args) => super::backup::backup(&args),
        StoreCommand::Restore(args) => super::backup::restore(&args),
        StoreCommand::Migrate(args) => super::store::migrate(&args),
        StoreCommand::Check(args) => {
            let data = match data_dir(&args) {
                Ok(data) => data,
                Err(message) => return finish(Err(message)),
            };
            let path = data.join("store");
            let began = std::time::Instant::now();
            let report = sbx_storage::SledStore::open(&path).and_then(|s| s.check_integrity());
            match report {
                Err(e) => {
                    eprintln!("error: cannot check the store in {}: {e}", path.display());
                    ExitCode::from(2)
                }
                Ok(report) => {
                    println!(
                        "store {}: revision {}, high-water mark {}, {} index problem(s), checked \
                         in {:?}",
                        path.display(),
                        report.revision,
                        report
                            .high_water
                            .map(|m| m.to_string())
                            .unwrap_or_else(|| "none".into()),
                        report.problems.len(),
                        began.elapsed()
                    );
                    if report.healthy() {
                        ExitCode::SUCCESS
                    } else {
                        eprintln!("{}", report.describe());
                        ExitCode::from(1)
                    }
                }
            }
        }
    }
}

/// `--ttl`, `--pull-timeout`: seconds, or a number with s, m, h or d; never 0.
pub(super) fn parse_ttl(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, "s"),
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (30s, 15m, 24h, 7d)"))?;
    let secs = match unit {
        "s" => n,
        "m" => n.saturating_mul(60),
        "h" => n.saturating_mul(3600),
        "d" => n.saturating_mul(86_400),
        _ => return Err(format!("{text:?}: the unit must be s, m, h or d")),
    };
    if secs == 0 {
        return Err("a duration of 0 would end at once".to_string());
    }
    Ok(Duration::from_secs(secs))
}

pub fn data_dir(arg: &DataDirArg) -> Result<PathBuf, String> {
    super::drivers::data_dir(arg.data_dir.as_deref()).map_err(|e| e.to_string())
}

fn finish(result: Result<(), String>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(1)
        }
    }
}

fn time(ms: u64) -> String {
    if ms == 0 {
        return "never".to_string();
    }
    let nanos = sbx_proto::time::rfc3339_nanos(UNIX_EPOCH + Duration::from_millis(ms));
    // To the second: "2026-12-01T15:04:05.123456789Z" -> "2026-12-01T15:04:05Z".
    match nanos.split_once('.') {
        Some((secs, _)) => format!("{secs}Z"),
        None => nanos,
    }
}

pub fn run_token(command: TokenCommand) -> ExitCode {
    finish(match command {
        TokenCommand::Create(args) => (|| {
            let data = data_dir(&args.data)?;
            let new = NewIdentity {
                name: args.name.clone(),
                role: args.role,
                workspaces: args.workspaces.iter().cloned().collect::<BTreeSet<_>>(),
                // Bound by sbxd, to the workspaces of these names, when it next reads the file:
                // at once if it runs (before it serves any other call), else at its start.
                workspace_ids: BTreeMap::new(),
                ttl: args.ttl,
                with_token: !args.cert_only,
                e2b: args.e2b,
            };
            let token = tokens::create(&data, &new).map_err(|e| e.to_string())?;
            let scope = if new.workspaces.is_empty() {
                "every workspace".to_string()
            } else {
                let names = new.workspaces.iter().cloned().collect::<Vec<_>>().join(",");
                format!(
                    "{names} (each bound to the workspace of that name when sbxd next reads \
                     the identities: a workspace made later under the name is not it)"
                )
            };
            eprintln!(
                "identity {} made: {} in {scope}{}",
                new.name,
                new.role,
                match new.ttl {
                    Some(ttl) => format!(", for {}s", ttl.as_secs()),
                    None => String::new(),
                }
            );
            match token {
                Some(token) => {
                    eprintln!("its token (shown only now; give it as SBX_TOKEN or --token):");
                    println!("{token}");
                }
                None => eprintln!(
                    "no token: a client certificate with common name {} is its credential \
                     (sbxd certs init --client {})",
                    new.name, new.name
                ),
            }
            Ok(())
        })(),
        TokenCommand::List(args) => (|| {
            let data = data_dir(&args)?;
            let identities = tokens::list(&data).map_err(|e| e.to_string())?;
            println!("NAME\tROLE\tWORKSPACES\tCREDENTIAL\tEXPIRES");
            let now = tokens::now_ms();
            for id in identities {
                println!(
                    "{}\t{}\t{}\t{}\t{}{}",
                    id.name,
                    id.role,
                    id.scope(),
                    if id.token_sha256.is_empty() {
                        "certificate"
                    } else {
                        "token"
                    },
                    time(id.expires_at_ms),
                    if id.expired(now) { " (expired)" } else { "" }
                );
            }
            Ok(())
        })(),
        TokenCommand::Revoke(args) => (|| {
            let data = data_dir(&args.data)?;
            let gone = tokens::revoke(&data, &args.name).map_err(|e| e.to_string())?;
            eprintln!(
                "identity {} revoked ({} in {})",
                gone.name,
                gone.role,
                gone.scope()
            );
            Ok(())
        })(),
    })
}

pub fn run_certs(command: CertsCommand) -> ExitCode {
    finish(match command {
        CertsCommand::Init(args) => (|| {
            let dir = match &args.dir {
                Some(dir) => dir.clone(),
                None => super::drivers::data_dir(args.data_dir.as_deref())
                    .map_err(|e| e.to_string())?
                    .join("tls"),
            };
            let written = super::certs::init(&args, &dir).map_err(|e| e.to_string())?;
            println!("{}", super::certs::describe(&written, &args.names));
            Ok(())
        })(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_are_read_as_people_write_them() {
        assert_eq!(parse_ttl("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_ttl("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(parse_ttl("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_ttl("7d"), Ok(Duration::from_secs(604_800)));
        for bad in ["", "0", "1w", "h", "-1s"] {
            assert!(parse_ttl(bad).is_err(), "{bad}");
        }
    }
}

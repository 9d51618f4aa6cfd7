//! Which store `sbxd serve` keeps its records in: the embedded sled store in DATA/store (the
//! default), or a PostgreSQL database that several gateways share (`--store postgres://…`).
//! The password of a database never goes on the command line, where `ps` shows it: it comes
//! from `--store-password-file` or `$SBX_STORE_PASSWORD`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use sbx_storage::{ObjectStore, PgStore, SledStore};

use super::{DaemonError, DataDirArg};

/// The environment variable a store's password may come from.
pub const PASSWORD_ENV: &str = "SBX_STORE_PASSWORD";

#[derive(Debug, Clone, Default, Args)]
pub struct StoreArgs {
    /// Where the gateway keeps its records. Unset: the embedded store in DATA/store, for one
    /// gateway. `postgres://USER@HOST:PORT/DATABASE`: a PostgreSQL database that several
    /// gateways share (its tables are made at the first start). The URL must not hold the
    /// password (`ps` would show it): give it with --store-password-file or
    /// $SBX_STORE_PASSWORD.
    #[arg(long, env = "SBX_STORE", value_name = "URL")]
    pub store: Option<String>,

    /// A file holding the store's password (its first line; mode 0600 is advised).
    #[arg(
        long,
        env = "SBX_STORE_PASSWORD_FILE",
        value_name = "PATH",
        requires = "store"
    )]
    pub store_password_file: Option<PathBuf>,

    /// With --store: talk to PostgreSQL over TLS only, its certificate checked against this
    /// CA (PEM) and valid for the URL's host; a server without TLS, or with another
    /// certificate, is refused. Unset: plain TCP (keep the database on this host or a trusted
    /// network).
    #[arg(long, env = "SBX_STORE_TLS_CA", value_name = "PEM", requires = "store")]
    pub store_tls_ca: Option<PathBuf>,

    /// With --store: how long a workspace's lease lasts unrenewed, in seconds. Gateways
    /// sharing a store each serve the workspaces whose lease they hold (renewed every third of
    /// it); when one dies, the others take its workspaces over within about this long.
    #[arg(long, env = "SBX_LEASE_SECONDS", value_name = "SECS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(2..=300))]
    pub lease_seconds: u64,

    /// With --store: the address (HOST:PORT) other gateways reach this one at, where they
    /// forward the requests for the workspaces it serves. Unset: the address it listens on
    /// (which must then not be 0.0.0.0 or [::]).
    #[arg(
        long,
        env = "SBX_ADVERTISE",
        value_name = "HOST:PORT",
        requires = "store"
    )]
    pub advertise: Option<String>,

    /// With --store and TLS: the CA that signed the other gateways' certificates (PEM), which
    /// the requests forwarded to them are checked against. Unset: the system's roots.
    #[arg(long, env = "SBX_PEER_TLS_CA", value_name = "PEM", requires = "store")]
    pub peer_tls_ca: Option<PathBuf>,
}

impl StoreArgs {
    /// The address the other gateways forward to: --advertise, or the bound address when it
    /// names one host (a wildcard one is an error, not a silent dead end).
    pub fn advertised(&self, bound: &str) -> Result<String, DaemonError> {
        if let Some(address) = &self.advertise {
            return Ok(address.clone());
        }
        match bound.parse::<std::net::SocketAddr>() {
            Ok(addr) if addr.ip().is_unspecified() => Err(DaemonError::Setup(format!(
                "--listen {bound} is every address of this machine: with --store, say where \
                 the other gateways reach this one with --advertise HOST:PORT"
            ))),
            _ => Ok(bound.to_string()),
        }
    }
}

/// This gateway's id among those sharing a store, kept in DATA/gateway-id (made, mode 0600,
/// at the first start) so that a restarted gateway renews its own leases at once.
pub fn gateway_id(data_dir: &Path) -> Result<uuid::Uuid, DaemonError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = data_dir.join("gateway-id");
    let failed = |e: std::io::Error| DaemonError::Setup(format!("{}: {e}", path.display()));
    match std::fs::read_to_string(&path) {
        Ok(text) => uuid::Uuid::parse_str(text.trim()).map_err(|_| {
            DaemonError::Setup(format!(
                "{} does not hold a gateway id (a UUID); remove it to make a new one",
                path.display()
            ))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let id = uuid::Uuid::new_v4();
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .map_err(failed)?;
            file.write_all(format!("{id}\n").as_bytes())
                .and_then(|()| file.sync_all())
                .map_err(failed)?;
            Ok(id)
        }
        Err(e) => Err(failed(e)),
    }
}

/// A `postgres://` URL parsed into a client config, with the password from the file or the
/// environment. A password inside the URL, another scheme, or a file that cannot be read is
/// an error naming the flag.
pub fn postgres_config(
    url: &str,
    password_file: Option<&Path>,
    password_env: Option<String>,
) -> Result<sbx_storage::PgConfig, DaemonError> {
    let bad = |why: String| DaemonError::Setup(format!("--store {why}"));
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(bad(format!(
            "{url:?}: not a store URL sbxd knows; leave --store unset for the embedded store, \
             or give postgres://USER@HOST:PORT/DATABASE"
        )));
    }
    let mut config: sbx_storage::PgConfig = url
        .parse()
        .map_err(|e| bad(format!("{url:?} is not a PostgreSQL URL: {e}")))?;
    if config.get_password().is_some() {
        return Err(bad(
            "holds a password, which `ps` shows to every user of this machine: take it out \
             of the URL and give it with --store-password-file or $SBX_STORE_PASSWORD"
                .into(),
        ));
    }
    if config.get_dbname().is_none() {
        return Err(bad(format!(
            "{url:?} names no database: postgres://USER@HOST:PORT/DATABASE"
        )));
    }
    let password = match password_file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                DaemonError::Setup(format!("--store-password-file {}: {e}", path.display()))
            })?;
            Some(text.lines().next().unwrap_or("").to_string())
        }
        None => password_env,
    };
    if let Some(password) = password {
        config.password(password);
    }
    Ok(config)
}

impl StoreArgs {
    /// Opens the store these flags name: PostgreSQL (its schema checked and if needed made,
    /// then its integrity checked), or `None` for the embedded store.
    pub async fn open_shared(
        &self,
        accept_loss: bool,
    ) -> Result<Option<Arc<dyn ObjectStore>>, DaemonError> {
        let Some(url) = &self.store else {
            return Ok(None);
        };
        let config = postgres_config(
            url,
            self.store_password_file.as_deref(),
            std::env::var(PASSWORD_ENV).ok(),
        )?;
        let store = PgStore::connect_with(config, store_tls(self.store_tls_ca.as_deref())?)
            .await
            .map_err(|source| DaemonError::SharedStore {
                store: url.clone(),
                source,
            })?;
        tracing::info!(store = %store.describe(), schema = ?store.schema_outcome(), "store opened");
        let began = Instant::now();
        let problems =
            store
                .integrity_problems()
                .await
                .map_err(|source| DaemonError::SharedStore {
                    store: url.clone(),
                    source,
                })?;
        tracing::info!(took = ?began.elapsed(), problems = problems.len(), "store checked");
        if !problems.is_empty() {
            let report = problems
                .iter()
                .map(|p| format!("  {p}"))
                .collect::<Vec<_>>()
                .join("\n");
            if !accept_loss {
                return Err(DaemonError::SharedStoreDamaged {
                    store: store.describe(),
                    report,
                });
            }
            tracing::error!(store = %store.describe(), %report,
                "serving a store whose records disagree, as --accept-store-loss asks");
        }
        Ok(Some(Arc::new(store)))
    }
}

/// `sbxd store migrate`.
#[derive(Debug, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub data: DataDirArg,

    /// The PostgreSQL database to copy into: postgres://USER@HOST:PORT/DATABASE (empty; its
    /// tables are made if missing). No password in it.
    #[arg(long, value_name = "URL")]
    pub to: String,

    /// A file holding the database's password (its first line); else $SBX_STORE_PASSWORD.
    #[arg(long, env = "SBX_STORE_PASSWORD_FILE", value_name = "PATH")]
    pub store_password_file: Option<PathBuf>,

    /// Talk to the database over TLS only, its certificate checked against this CA (PEM).
    #[arg(long, env = "SBX_STORE_TLS_CA", value_name = "PEM")]
    pub store_tls_ca: Option<PathBuf>,
}

/// The TLS configuration of `--store-tls-ca`, if given.
fn store_tls(ca: Option<&Path>) -> Result<Option<rustls::ClientConfig>, DaemonError> {
    ca.map(|ca| {
        crate::tls::rustls_client_config(ca)
            .map_err(|e| DaemonError::Setup(format!("--store-tls-ca: {e}")))
    })
    .transpose()
}

/// Runs `sbxd store migrate`: 0 copied and checked, 1 the copy failed or differs, 2 a store
/// could not be opened.
pub fn migrate(args: &MigrateArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(copy(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, message)) => {
            eprintln!("error: {message}");
            ExitCode::from(code)
        }
    }
}

async fn copy(args: &MigrateArgs) -> Result<(), (u8, String)> {
    let data =
        super::drivers::data_dir(args.data.data_dir.as_deref()).map_err(|e| (2, e.to_string()))?;
    let path = data.join("store");
    if !path.exists() {
        return Err((
            2,
            format!("no store in {}: nothing to migrate", data.display()),
        ));
    }
    let sled = SledStore::open(&path).map_err(|e| {
        (
            2,
            format!(
                "cannot open the store in {} (is sbxd running on it?): {e}",
                path.display()
            ),
        )
    })?;
    let report = sled.check_integrity().map_err(|e| {
        (
            2,
            format!("cannot check the store in {}: {e}", path.display()),
        )
    })?;
    if !report.healthy() {
        return Err((
            1,
            format!(
                "the store in {} is damaged; it is not copied (`sbxd store check` says the \
                 same):\n{}",
                path.display(),
                report.describe()
            ),
        ));
    }
    let config = postgres_config(
        &args.to,
        args.store_password_file.as_deref(),
        std::env::var(PASSWORD_ENV).ok(),
    )
    .map_err(|e| (2, e.to_string().replacen("--store", "--to", 1)))?;
    let tls = store_tls(args.store_tls_ca.as_deref()).map_err(|e| (2, e.to_string()))?;
    let target = PgStore::connect_with(config, tls)
        .await
        .map_err(|e| (2, format!("cannot open {}: {e}", args.to)))?;
    eprintln!(
        "copying {} (revision {}) into {} …",
        path.display(),
        report.revision,
        target.describe()
    );
    let began = Instant::now();
    let summary = target
        .copy_from(&sled)
        .await
        .map_err(|e| (1, e.to_string()))?;
    println!(
        "copied {} record(s) at revision {} into {} and checked the copy, in {:.1?}; start \
         the gateways with --store {}",
        summary.records,
        summary.revision,
        target.describe(),
        began.elapsed(),
        args.to
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_url_never_carries_its_password() {
        let err = postgres_config("postgres://sbx:secret@127.0.0.1:5432/sbx", None, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--store-password-file"), "{err}");
        assert!(
            !err.contains("secret"),
            "the error repeats the password: {err}"
        );
        for (url, says) in [
            ("mysql://sbx@h/db", "not a store URL"),
            ("postgres://sbx@127.0.0.1:5432", "names no database"),
            (
                "postgres://sbx@127.0.0.1:notaport/db",
                "not a PostgreSQL URL",
            ),
        ] {
            let err = postgres_config(url, None, None).unwrap_err().to_string();
            assert!(err.contains(says), "{url}: {err}");
        }
    }

    #[test]
    fn the_password_comes_from_the_file_before_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "from-file\nignored\n").unwrap();
        let url = "postgres://sbx@127.0.0.1:5432/sbx";
        let config = postgres_config(url, Some(&file), Some("from-env".into())).unwrap();
        assert_eq!(config.get_password(), Some(&b"from-file"[..]));
        let config = postgres_config(url, None, Some("from-env".into())).unwrap();
        assert_eq!(config.get_password(), Some(&b"from-env"[..]));
        let missing = dir.path().join("missing");
        let err = postgres_config(url, Some(&missing), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--store-password-file"), "{err}");
    }
}

//! A PostgreSQL server of a test's own: `initdb` into a temp dir, `pg_ctl start` on a free
//! port of 127.0.0.1, stopped (immediately) and removed when dropped. Run as the `postgres`
//! user when the test runs as root (PostgreSQL refuses to run as root), with password
//! authentication (scram-sha-256) for the user `sbx`, so tests connect as a gateway would.
//!
//! The binaries are Debian's (`/usr/lib/postgresql/<version>/bin`, the highest version there),
//! or those in `$SBX_PG_BIN`.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The user the server's tests connect as.
pub const TEST_USER: &str = "sbx";

/// A running PostgreSQL server of the test's own.
#[derive(Debug)]
pub struct TestPostgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    password: String,
    /// The uid and gid the server runs as (`postgres` when the test runs as root).
    run_as: Option<(u32, u32)>,
    running: bool,
}

fn pg_bin() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("SBX_PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(root)
        .map_err(|e| {
            format!(
                "no PostgreSQL at {} ({e}): install Debian's postgresql, or set SBX_PG_BIN",
                root.display()
            )
        })?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .ok_or_else(|| format!("no initdb under {}/*/bin", root.display()))
}

fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(listener.local_addr().map_err(|e| e.to_string())?.port())
}

impl TestPostgres {
    /// Makes and starts a server; an error says what is missing or what failed, with the
    /// server's log.
    pub fn start() -> Result<TestPostgres, String> {
        let bin = pg_bin()?;
        let dir = tempfile::Builder::new()
            .prefix("sbx-pg-")
            .tempdir()
            .map_err(|e| e.to_string())?;
        let run_as = if nix::unistd::geteuid().is_root() {
            let user = nix::unistd::User::from_name("postgres")
                .map_err(|e| e.to_string())?
                .ok_or("running as root, and there is no postgres user to run PostgreSQL as")?;
            Some((user.uid.as_raw(), user.gid.as_raw()))
        } else {
            None
        };
        let password = uuid::Uuid::new_v4().simple().to_string();
        let pwfile = dir.path().join("pwfile");
        std::fs::write(&pwfile, &password).map_err(|e| e.to_string())?;
        if let Some((uid, gid)) = run_as {
            for path in [dir.path(), &pwfile] {
                nix::unistd::chown(
                    path,
                    Some(nix::unistd::Uid::from_raw(uid)),
                    Some(nix::unistd::Gid::from_raw(gid)),
                )
                .map_err(|e| format!("chown {}: {e}", path.display()))?;
            }
        }
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))
            .map_err(|e| e.to_string())?;
        let mut server = TestPostgres {
            dir,
            bin,
            port: free_port()?,
            password,
            run_as,
            running: false,
        };
        let data = server.data_dir();
        server.run(
            "initdb",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-U".as_ref(),
                TEST_USER.as_ref(),
                "--pwfile".as_ref(),
                pwfile.as_os_str(),
                "--auth=scram-sha-256".as_ref(),
                "-E".as_ref(),
                "UTF8".as_ref(),
                "--no-sync".as_ref(),
            ],
        )?;
        std::fs::remove_file(&pwfile).map_err(|e| e.to_string())?;
        server.start_again()?;
        Ok(server)
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// Runs one of the server's programs as the server's user; its output goes to the log.
    fn run(&self, program: &str, args: &[&std::ffi::OsStr]) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("tools.log"))
            .map_err(|e| e.to_string())?;
        let mut cmd = Command::new(self.bin.join(program));
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .current_dir(self.dir.path());
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid).env("HOME", self.dir.path());
        }
        let status = cmd
            .status()
            .map_err(|e| format!("running {program}: {e}"))?;
        if status.success() {
            Ok(())
        } else {
            let tools =
                std::fs::read_to_string(self.dir.path().join("tools.log")).unwrap_or_default();
            let server = std::fs::read_to_string(self.log_path()).unwrap_or_default();
            Err(format!(
                "{program} failed ({status}):\n{tools}\nserver log:\n{server}"
            ))
        }
    }

    /// Starts the server (again, after [`stop`](Self::stop)), on the same port, and waits
    /// until it takes connections.
    pub fn start_again(&mut self) -> Result<(), String> {
        let data = self.data_dir();
        let log = self.log_path();
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections=200",
            self.port,
            self.dir.path().display()
        );
        self.run(
            "pg_ctl",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-l".as_ref(),
                log.as_os_str(),
                "-w".as_ref(),
                "-t".as_ref(),
                "60".as_ref(),
                "-o".as_ref(),
                options.as_ref(),
                "start".as_ref(),
            ],
        )?;
        self.running = true;
        Ok(())
    }

    /// Stops the server: `fast` (clients disconnected, a clean shutdown) or `immediate` (as
    /// a crash: recovery from the WAL at the next start).
    pub fn stop(&mut self, mode: &str) -> Result<(), String> {
        let data = self.data_dir();
        self.run(
            "pg_ctl",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-m".as_ref(),
                mode.as_ref(),
                "-w".as_ref(),
                "stop".as_ref(),
            ],
        )?;
        self.running = false;
        Ok(())
    }

    /// The port the server listens on, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// From now on the server takes TCP connections over TLS only, with the certificate
    /// `cert` and its key `key` (PEM; copied into the server's data dir, owned by its user,
    /// the key 0600); restarts it. Plain TCP connections are refused (`pg_hba.conf`: every
    /// `host` line becomes `hostssl`).
    pub fn require_tls(&mut self, cert: &Path, key: &Path) -> Result<(), String> {
        let data = self.data_dir();
        for (from, name, mode) in [(cert, "server.crt", 0o644), (key, "server.key", 0o600)] {
            let to = data.join(name);
            std::fs::copy(from, &to).map_err(|e| format!("{}: {e}", from.display()))?;
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(mode))
                .map_err(|e| e.to_string())?;
            if let Some((uid, gid)) = self.run_as {
                nix::unistd::chown(
                    &to,
                    Some(nix::unistd::Uid::from_raw(uid)),
                    Some(nix::unistd::Gid::from_raw(gid)),
                )
                .map_err(|e| format!("chown {}: {e}", to.display()))?;
            }
        }
        let conf = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).map_err(|e| e.to_string())?;
        text.push_str("\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n");
        std::fs::write(&conf, text).map_err(|e| e.to_string())?;
        let hba = data.join("pg_hba.conf");
        let text = std::fs::read_to_string(&hba).map_err(|e| e.to_string())?;
        let text: String = text
            .lines()
            .map(|l| match l.strip_prefix("host ") {
                Some(rest) => format!("hostssl {rest}\n"),
                None => format!("{l}\n"),
            })
            .collect();
        std::fs::write(&hba, text).map_err(|e| e.to_string())?;
        self.stop("fast")?;
        self.start_again()
    }

    /// The password of [`TEST_USER`].
    pub fn password(&self) -> &str {
        &self.password
    }

    /// `postgres://sbx@127.0.0.1:PORT/DB`: the URL of database `db`, without the password.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://{TEST_USER}@127.0.0.1:{}/{db}", self.port)
    }

    /// A client config for database `db`, with the password.
    pub fn config(&self, db: &str) -> tokio_postgres::Config {
        let mut config: tokio_postgres::Config = self.url(db).parse().expect("a valid URL");
        config.password(self.password.as_bytes());
        config
    }

    /// Creates the empty database `name` (a fresh store per check). Over the server's Unix
    /// socket, which TLS ([`TestPostgres::require_tls`]) leaves as it is.
    pub async fn create_database(&self, name: &str) -> Result<(), String> {
        let mut config = self.config("postgres");
        config.host_path(self.dir.path());
        let (client, conn) = config
            .connect(tokio_postgres::NoTls)
            .await
            .map_err(|e| format!("connecting to the test server: {e}"))?;
        let task = tokio::spawn(conn);
        let result = client
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await
            .map_err(|e| format!("CREATE DATABASE {name}: {e}"));
        drop(client);
        let _ = task.await;
        result
    }
}

/// A CA and a server certificate for 127.0.0.1 signed by it, as PEM files in `dir`:
/// (CA certificate, server certificate, server key).
pub fn tls_files(
    dir: &std::path::Path,
    ca_name: &str,
) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params
        .distinguished_name
        .push(DnType::CommonName, ca_name);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let paths = (
        dir.join(format!("{ca_name}-ca.pem")),
        dir.join(format!("{ca_name}-server.pem")),
        dir.join(format!("{ca_name}-server-key.pem")),
    );
    std::fs::write(&paths.0, ca.pem()).unwrap();
    std::fs::write(&paths.1, cert.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    paths
}

impl Drop for TestPostgres {
    fn drop(&mut self) {
        if self.running
            && let Err(e) = self.stop("immediate")
        {
            eprintln!("stopping the test PostgreSQL server: {e}");
        }
    }
}

//! Gateways sharing one PostgreSQL: the test's own server, with the password in a file, and
//! `sbxd serve` started on it.

use std::path::Path;

use sbx_storage::conformance::postgres_server::TestPostgres;

use super::{DataDir, Sbxd};

/// A PostgreSQL server of the test's own (stopped on drop) and the password file gateways
/// read (`--store-password-file`).
pub struct SharedStore {
    pub server: TestPostgres,
    _secrets: DataDir,
    pub password_file: String,
}

impl SharedStore {
    pub fn start() -> SharedStore {
        let server = TestPostgres::start().expect("a PostgreSQL server");
        let secrets = DataDir::new();
        let password_file = secrets.path().join("pw");
        std::fs::write(&password_file, server.password()).unwrap();
        SharedStore {
            server,
            _secrets: secrets,
            password_file: password_file.to_str().unwrap().to_string(),
        }
    }

    /// A new database `db` on the server, and its URL (no password in it).
    pub async fn database(&self, db: &str) -> String {
        self.server.create_database(db).await.unwrap();
        self.server.url(db)
    }

    /// `sbxd serve` on database `url` with the `sim` driver as its local one, the store
    /// arguments first, then `extra`.
    pub fn gateway(&self, data: &Path, url: &str, extra: &[&str]) -> Sbxd {
        let mut args = vec!["--store", url, "--store-password-file", &self.password_file];
        args.extend_from_slice(extra);
        Sbxd::start(data, "sim", &args)
    }
}

//! Identities and their tokens, in `DATA/auth/identities.json` (directory 0700, file 0600).
//!
//! An identity is a name (a DNS-1123 label), a role (viewer, editor, admin) and the
//! workspaces it holds that role in — or every workspace (a gateway-wide grant). A grant
//! holds its workspace's UUID: the API resolves it when the grant is made; a grant `sbxd
//! token create` wrote (by name: the store is the running gateway's) is bound by the gateway
//! when it next reads the file — at once if it runs, before it serves the call that found the
//! change — or at its start ([`bind_unbound`]; a format-1 file, from before ids, the same, once).
//! A workspace deleted and made again under the same name is a stranger to a grant, and a
//! grant whose workspace is gone, or was never there, is dead. Its
//! credentials: a bearer token, stored only as its SHA-256 (a token is 32 random bytes, so a
//! fast hash is enough: there is nothing to guess), and a client certificate whose subject
//! common name is the identity's name (mutual TLS). An identity may expire.
//!
//! The file is the store, not sled: `sbxd token create|revoke|list` edit it while the
//! gateway runs (sled is locked by the running sbxd), under an exclusive `flock` of
//! `DATA/auth/lock` so two edits never lose one another, written beside and renamed (a
//! crash leaves the old file or the new one). The gateway reads it again whenever its size
//! or modification time changes — checked on every call — so a revoke is effective at the
//! next call, and open streams check it every [`super::RECHECK`].

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use uuid::Uuid;

use super::Role;

/// The file's format version: 2 binds each grant to its workspace's id; 1 (names only) is
/// read and bound at the gateway's start.
const FORMAT: u32 = 2;

/// What every token begins with, so that one is recognised in a leak scan.
pub const TOKEN_PREFIX: &str = "sbx_";

/// What a token made in E2B's API-key form begins with (`--e2b`): `e2b_` and 40 hex digits
/// (20 random bytes), the form E2B's SDKs and tools take for a key.
pub const E2B_TOKEN_PREFIX: &str = "e2b_";

/// The longest bearer token looked at; anything longer is malformed.
pub const MAX_TOKEN_BYTES: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredIdentity {
    pub name: String,
    pub role: Role,
    /// Empty: every workspace (gateway-wide).
    pub workspaces: BTreeSet<String>,
    /// Each granted workspace's id, by its name: `None` when no workspace of that name existed
    /// when the grant was bound (a dead grant). A name of `workspaces` missing here is not
    /// bound yet (a format-1 file before the gateway's start), and holds nothing meanwhile.
    #[serde(default)]
    pub workspace_ids: BTreeMap<String, Option<Uuid>>,
    /// Hex SHA-256 of the token; empty for an identity known only by its certificate.
    pub token_sha256: String,
    pub created_at_ms: u64,
    /// 0: never.
    pub expires_at_ms: u64,
}

impl StoredIdentity {
    pub fn expired(&self, now_ms: u64) -> bool {
        self.expires_at_ms != 0 && now_ms >= self.expires_at_ms
    }

    /// "every workspace", or the workspaces, comma-separated, each with its id (or why it holds
    /// nothing).
    pub fn scope(&self) -> String {
        if self.workspaces.is_empty() {
            return "every workspace".to_string();
        }
        self.workspaces
            .iter()
            .map(|name| match self.workspace_ids.get(name) {
                Some(Some(id)) => format!("{name} ({id})"),
                Some(None) => format!("{name} (no such workspace: holds nothing)"),
                None => format!("{name} (not bound yet)"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The workspaces this identity's grants hold, by id (each with its name); `None` for a
    /// gateway-wide grant. Dead and unbound grants hold nothing.
    pub fn granted(&self) -> Option<BTreeMap<Uuid, String>> {
        if self.workspaces.is_empty() {
            return None;
        }
        Some(
            self.workspaces
                .iter()
                .filter_map(|name| Some((self.workspace_ids.get(name).copied()??, name.clone())))
                .collect(),
        )
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct File {
    format: u32,
    identities: Vec<StoredIdentity>,
}

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not an identities file this sbxd reads: {why}")]
    Format { path: PathBuf, why: String },
    #[error("{0}")]
    Invalid(String),
    #[error("an identity named {0:?} exists already (revoke it first)")]
    Exists(String),
    #[error("no identity named {name:?}; the identities are: {known}")]
    Unknown { name: String, known: String },
}

/// Where the identities of data dir `data` are.
pub fn dir(data: &Path) -> PathBuf {
    data.join("auth")
}

fn file_path(data: &Path) -> PathBuf {
    dir(data).join("identities.json")
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The hex SHA-256 of a token.
pub fn hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TokenError + '_ {
    move |source| TokenError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn read(data: &Path) -> Result<File, TokenError> {
    let path = file_path(data);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(File::default()),
        Err(e) => return Err(io(&path)(e)),
    };
    let file: File = serde_json::from_slice(&bytes).map_err(|e| TokenError::Format {
        path: path.clone(),
        why: e.to_string(),
    })?;
    // Format 1 is format 2 with every grant unbound (its `workspace_ids` empty).
    if file.format != FORMAT && file.format != 1 {
        return Err(TokenError::Format {
            path,
            why: format!("format {} (this sbxd reads 1 and {FORMAT})", file.format),
        });
    }
    Ok(file)
}

/// Makes `DATA/auth` (0700) and holds its lock while `edit` changes the file.
fn edit<T>(
    data: &Path,
    edit: impl FnOnce(&mut File) -> Result<T, TokenError>,
) -> Result<T, TokenError> {
    let dir = dir(data);
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).map_err(io(&dir))?;
    let lock_path = dir.join("lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&lock_path)
        .map_err(io(&lock_path))?;
    let _held = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| io(&lock_path)(e.into()))?;
    let mut file = read(data)?;
    let answer = edit(&mut file)?;
    file.format = FORMAT;
    let path = file_path(data);
    let tmp = dir.join(".identities.json.tmp");
    let bytes = serde_json::to_vec_pretty(&file).map_err(|e| TokenError::Invalid(e.to_string()))?;
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io(&tmp))?;
    out.write_all(&bytes).map_err(io(&tmp))?;
    out.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    Ok(answer)
}

/// What `sbxd token create` asks for.
#[derive(Debug, Clone)]
pub struct NewIdentity {
    pub name: String,
    pub role: Role,
    /// The granted workspaces, by name.
    pub workspaces: BTreeSet<String>,
    /// Their ids, resolved when the grant is made (the API does); a name missing here is bound
    /// by the gateway when it next reads the file (`sbxd token create`), and `None` (no
    /// workspace of that name) is refused.
    pub workspace_ids: BTreeMap<String, Option<Uuid>>,
    pub ttl: Option<Duration>,
    /// Also a token (else the identity is for a client certificate only).
    pub with_token: bool,
    /// The token in E2B's API-key form (`e2b_` + 40 hex digits) rather than sbx's.
    pub e2b: bool,
}

/// Adds an identity; returns its token (once: only its hash is kept).
pub fn create(data: &Path, new: &NewIdentity) -> Result<Option<String>, TokenError> {
    sbx_proto::names::validate_name(&new.name)
        .map_err(|e| TokenError::Invalid(format!("identity name {:?}: {e}", new.name)))?;
    for ws in &new.workspaces {
        sbx_proto::names::validate_name(ws)
            .map_err(|e| TokenError::Invalid(format!("workspace {ws:?}: {e}")))?;
        if new.workspace_ids.get(ws).is_some_and(Option::is_none) {
            return Err(TokenError::Invalid(format!(
                "no workspace is named {ws:?}: a grant holds a workspace that exists (create \
                 it first)"
            )));
        }
    }
    let token = new.with_token.then(|| {
        if new.e2b {
            let mut bytes = [0u8; 20];
            rand::fill(&mut bytes);
            format!("{E2B_TOKEN_PREFIX}{}", hex::encode(bytes))
        } else {
            let mut bytes = [0u8; 32];
            rand::fill(&mut bytes);
            format!("{TOKEN_PREFIX}{}", hex::encode(bytes))
        }
    });
    edit(data, |file| {
        if file.identities.iter().any(|i| i.name == new.name) {
            return Err(TokenError::Exists(new.name.clone()));
        }
        let now = now_ms();
        file.identities.push(StoredIdentity {
            name: new.name.clone(),
            role: new.role,
            workspaces: new.workspaces.clone(),
            workspace_ids: new
                .workspace_ids
                .iter()
                .filter(|(name, _)| new.workspaces.contains(*name))
                .map(|(name, id)| (name.clone(), *id))
                .collect(),
            token_sha256: token.as_deref().map(hash).unwrap_or_default(),
            created_at_ms: now,
            expires_at_ms: new
                .ttl
                .map(|ttl| now.saturating_add(ttl.as_millis() as u64))
                .unwrap_or(0),
        });
        Ok(())
    })?;
    Ok(token)
}

/// Removes identity `name` (its token and its certificate's access), at once.
pub fn revoke(data: &Path, name: &str) -> Result<StoredIdentity, TokenError> {
    edit(data, |file| {
        match file.identities.iter().position(|i| i.name == name) {
            Some(at) => Ok(file.identities.remove(at)),
            None => Err(TokenError::Unknown {
                name: name.to_string(),
                known: names(file),
            }),
        }
    })
}

fn names(file: &File) -> String {
    if file.identities.is_empty() {
        "(none)".to_string()
    } else {
        file.identities
            .iter()
            .map(|i| i.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Every identity, without secrets (only hashes are stored).
pub fn list(data: &Path) -> Result<Vec<StoredIdentity>, TokenError> {
    Ok(read(data)?.identities)
}

/// The names of the workspaces some grant of `identities` holds without an id yet.
fn unbound_in(identities: &[StoredIdentity]) -> BTreeSet<String> {
    identities
        .iter()
        .flat_map(|i| {
            i.workspaces
                .iter()
                .filter(|name| !i.workspace_ids.contains_key(*name))
                .cloned()
        })
        .collect()
}

/// Binds every grant without an id whose name `ids` holds (its workspace now, `None` when
/// there is none: a dead grant), once; answers how many it bound. The gateway does it with
/// its store's workspaces, at start and whenever the file holds such grants.
pub fn bind_unbound(
    data: &Path,
    ids: &BTreeMap<String, Option<Uuid>>,
) -> Result<usize, TokenError> {
    let mut bound = 0;
    edit(data, |file| {
        for identity in &mut file.identities {
            for name in &identity.workspaces {
                if let (false, Some(id)) =
                    (identity.workspace_ids.contains_key(name), ids.get(name))
                {
                    identity.workspace_ids.insert(name.clone(), *id);
                    bound += 1;
                }
            }
        }
        Ok(())
    })?;
    Ok(bound)
}

/// The gateway's view of the file: read again when it changes.
#[derive(Debug)]
pub struct Identities {
    data: PathBuf,
    cache: Mutex<Cached>,
}

#[derive(Debug, Default)]
struct Cached {
    /// (size, mtime) of the file last read; `None` before the first read or when absent.
    seen: Option<(u64, SystemTime)>,
    identities: Arc<[StoredIdentity]>,
}

impl Identities {
    pub fn open(data: &Path) -> Result<Identities, TokenError> {
        let this = Identities {
            data: data.to_path_buf(),
            cache: Mutex::new(Cached::default()),
        };
        this.current()?;
        Ok(this)
    }

    /// The identities as the file says now (shared: a call copies none of them).
    fn current(&self) -> Result<Arc<[StoredIdentity]>, TokenError> {
        let path = file_path(&self.data);
        let stamp = std::fs::metadata(&path)
            .ok()
            .and_then(|m| Some((m.len(), m.modified().ok()?)));
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if stamp != cache.seen || stamp.is_none() {
            cache.identities = read(&self.data)?.identities.into();
            cache.seen = stamp;
        }
        Ok(cache.identities.clone())
    }

    /// The live (unexpired) identity whose token this is. Every stored hash is compared, in
    /// constant time, so the answer's timing says nothing of which bytes matched.
    pub fn by_token(&self, token: &str) -> Result<Option<StoredIdentity>, TokenError> {
        self.by_token_hash(&hash(token))
    }

    /// [`Identities::by_token`] of a token's hash (an open stream's re-check).
    pub fn by_token_hash(&self, presented: &str) -> Result<Option<StoredIdentity>, TokenError> {
        let now = now_ms();
        let mut found = None;
        for identity in self.current()?.iter() {
            let same: bool = identity
                .token_sha256
                .as_bytes()
                .ct_eq(presented.as_bytes())
                .into();
            if same && !identity.token_sha256.is_empty() && !identity.expired(now) {
                found = Some(identity.clone());
            }
        }
        Ok(found)
    }

    /// The names of the workspaces some grant holds without an id yet (cheap: the file as
    /// last read, read again if it changed).
    pub fn unbound(&self) -> Result<BTreeSet<String>, TokenError> {
        Ok(unbound_in(&self.current()?))
    }

    /// [`bind_unbound`] of this file.
    pub fn bind(&self, ids: &BTreeMap<String, Option<Uuid>>) -> Result<usize, TokenError> {
        bind_unbound(&self.data, ids)
    }

    /// The live identity named `name` (a client certificate's subject).
    pub fn by_name(&self, name: &str) -> Result<Option<StoredIdentity>, TokenError> {
        let now = now_ms();
        Ok(self
            .current()?
            .iter()
            .find(|i| i.name == name && !i.expired(now))
            .cloned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new(name: &str, role: Role, ws: &[&str], ttl: Option<Duration>) -> NewIdentity {
        NewIdentity {
            name: name.into(),
            role,
            workspaces: ws.iter().map(|w| w.to_string()).collect(),
            workspace_ids: ws
                .iter()
                .map(|w| (w.to_string(), Some(Uuid::new_v4())))
                .collect(),
            ttl,
            with_token: true,
            e2b: false,
        }
    }

    /// A grant holds the id it was made with; one to a workspace that does not exist is
    /// refused; a format-1 file's grants hold nothing until bound, then the ids bound, and a
    /// name without a workspace then is dead for good.
    #[test]
    fn grants_hold_workspace_ids_and_old_files_are_bound_once() {
        let data = tempfile::tempdir().unwrap();
        let ids = Identities::open(data.path()).unwrap();
        let made = new("ci", Role::Editor, &["a"], None);
        let a = made.workspace_ids["a"].unwrap();
        let token = create(data.path(), &made).unwrap().unwrap();
        let found = ids.by_token(&token).unwrap().unwrap();
        assert_eq!(found.granted(), Some([(a, "a".to_string())].into()));
        let mut missing = new("x", Role::Viewer, &["b"], None);
        missing.workspace_ids.insert("b".into(), None);
        assert!(matches!(
            create(data.path(), &missing),
            Err(TokenError::Invalid(_))
        ));
        // A file of format 1: names only.
        let old = r#"{"format":1,"identities":[{"name":"old","role":"editor",
            "workspaces":["a","gone"],"token_sha256":"00","created_at_ms":1,"expires_at_ms":0}]}"#;
        std::fs::write(file_path(data.path()), old).unwrap();
        let unbound = ids.unbound().unwrap();
        assert_eq!(unbound, ["a".to_string(), "gone".to_string()].into());
        let before = ids.by_name("old").unwrap().unwrap();
        assert_eq!(
            before.granted(),
            Some(BTreeMap::new()),
            "unbound grants hold nothing"
        );
        let now: BTreeMap<String, Option<Uuid>> =
            [("a".to_string(), Some(a)), ("gone".to_string(), None)].into();
        assert_eq!(bind_unbound(data.path(), &now).unwrap(), 2);
        let after = ids.by_name("old").unwrap().unwrap();
        assert_eq!(after.granted(), Some([(a, "a".to_string())].into()));
        assert!(
            after.scope().contains("gone (no such workspace"),
            "{}",
            after.scope()
        );
        // Once: bound grants are not bound again, to whatever has the name later.
        let later: BTreeMap<String, Option<Uuid>> = [
            ("a".to_string(), Some(Uuid::new_v4())),
            ("gone".to_string(), Some(Uuid::new_v4())),
        ]
        .into();
        assert_eq!(bind_unbound(data.path(), &later).unwrap(), 0);
        assert_eq!(
            ids.by_name("old").unwrap().unwrap().granted(),
            after.granted()
        );
        let text = std::fs::read_to_string(file_path(data.path())).unwrap();
        assert!(text.contains("\"format\": 2"), "{text}");
    }

    #[test]
    fn a_token_is_found_by_itself_only_and_stored_as_a_hash() {
        let data = tempfile::tempdir().unwrap();
        let ids = Identities::open(data.path()).unwrap();
        let token = create(data.path(), &new("ci", Role::Editor, &["a"], None))
            .unwrap()
            .unwrap();
        assert!(token.starts_with(TOKEN_PREFIX) && token.len() == 4 + 64);
        // E2B's key form: found by itself the same way.
        let mut e2b = new("agent", Role::Editor, &["a"], None);
        e2b.e2b = true;
        let key = create(data.path(), &e2b).unwrap().unwrap();
        assert!(
            key.starts_with(E2B_TOKEN_PREFIX) && key.len() == 4 + 40,
            "{key}"
        );
        assert!(
            key[4..]
                .chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_eq!(ids.by_token(&key).unwrap().unwrap().name, "agent");
        let stored = std::fs::read_to_string(file_path(data.path())).unwrap();
        assert!(!stored.contains(&token[4..]), "the token itself is stored");
        let mode = std::fs::metadata(file_path(data.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(ids.by_token(&token).unwrap().unwrap().name, "ci");
        let mut wrong = token.clone();
        wrong.replace_range(10..11, if &token[10..11] == "0" { "1" } else { "0" });
        assert!(ids.by_token(&wrong).unwrap().is_none());
        assert!(ids.by_token("").unwrap().is_none());
        // Revoked: gone at the next lookup.
        revoke(data.path(), "ci").unwrap();
        assert!(ids.by_token(&token).unwrap().is_none());
        assert!(matches!(
            revoke(data.path(), "ci"),
            Err(TokenError::Unknown { .. })
        ));
    }

    #[test]
    fn an_expired_identity_is_not_found_and_names_are_unique_and_valid() {
        let data = tempfile::tempdir().unwrap();
        let ids = Identities::open(data.path()).unwrap();
        let token = create(
            data.path(),
            &new("brief", Role::Viewer, &[], Some(Duration::from_millis(50))),
        )
        .unwrap()
        .unwrap();
        assert!(ids.by_token(&token).unwrap().is_some());
        std::thread::sleep(Duration::from_millis(80));
        assert!(ids.by_token(&token).unwrap().is_none());
        assert!(matches!(
            create(data.path(), &new("brief", Role::Viewer, &[], None)),
            Err(TokenError::Exists(_))
        ));
        assert!(create(data.path(), &new("Bad_Name", Role::Viewer, &[], None)).is_err());
        assert!(create(data.path(), &new("ok", Role::Viewer, &["Bad_WS"], None)).is_err());
        assert_eq!(list(data.path()).unwrap().len(), 1);
    }
}

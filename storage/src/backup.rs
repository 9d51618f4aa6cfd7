//! Backups of the store: one file holding every entry of every sled tree, checked end to end,
//! and its restore into a data directory.
//!
//! Why: sbxd refuses a store that lost acknowledged commits (`fsck.rs`, the high-water mark of
//! `committer.rs`). The way back that keeps what was acknowledged is a copy taken while the
//! store was whole. Copying `DATA/store` by hand works only while sbxd is stopped and only
//! with `DATA/store.high-water` beside it; a backup file is one file, says what it holds, and
//! is refused when it is truncated or altered, and its restore sets the mark that matches it.
//!
//! Consistency: a backup is read with the store opened exclusively — sled's `flock` on
//! `store/db`, the lock sbxd holds while it runs — so nothing writes while the trees are read.
//! A backup while sbxd runs is refused ([`BackupError::InUse`]), not attempted: sled 0.34 has
//! no snapshot across trees, and its `export()` reads tree by tree just the same.
//!
//! Format, version 1 (integers big-endian):
//!
//! | offset | bytes | field                                                   |
//! |-------:|------:|---------------------------------------------------------|
//! | 0      | 16    | magic `sbx-store-backup`                                |
//! | 16     | 4     | format version (1)                                      |
//! | 20     | 8     | length of the whole file, checksum included             |
//! | 28     | 8     | written at, ms since the Unix epoch                     |
//! | 36     | 4     | the store's schema version                              |
//! | 40     | 8     | the store's revision                                    |
//! | 48     | 8     | its high-water mark at backup (`u64::MAX`: none)        |
//! | 56     | 4     | trees                                                   |
//! | 60     | 8     | entries, all trees                                      |
//! | 68     | 8     | records (entries of the `records` tree)                 |
//!
//! Then per tree (in name order): name length (u32), name, entries (u64), and per entry key
//! length (u32), key, value length (u32), value. Last, the SHA-256 of every byte before it
//! (32 bytes). The length in the header tells a truncated file from an altered one.
//!
//! Restore never deletes a store: the one in the way is renamed to
//! `store.before-restore-<unix time>` (with its mark), and the backup is imported into a new
//! directory beside it that is renamed into place only once complete.

use std::fs::{File, OpenOptions};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use sha2::{Digest, Sha256};

use crate::committer::{SLED_LOG_FILE, high_water_path, read_high_water};
use crate::error::StoreError;
use crate::fsck::IntegrityReport;
use crate::layout::{META_SCHEMA_VERSION, TREE_META, TREE_RECORDS};
use crate::schema::SCHEMA_VERSION;
use crate::sled_store::SledStore;

const MAGIC: &[u8; 16] = b"sbx-store-backup";
/// The format this build writes and reads.
pub const BACKUP_FORMAT_VERSION: u32 = 1;
const HEADER_LEN: u64 = 76;
const CHECKSUM_LEN: u64 = 32;
/// Entries imported per sled batch (bounds the memory a restore holds at once).
const IMPORT_BATCH: usize = 10_000;

/// What a backup file holds, from its header (checked against its contents).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupSummary {
    pub written_at_ms: u64,
    pub schema_version: u32,
    /// The store's revision when it was backed up.
    pub revision: u64,
    /// The store's high-water mark when it was backed up.
    pub high_water: Option<u64>,
    pub trees: u32,
    pub entries: u64,
    /// Store records (workspaces, sandboxes, settings, ...): the entries of `records`.
    pub records: u64,
    /// The file's length.
    pub bytes: u64,
}

/// What a restore did.
#[derive(Debug)]
pub struct Restored {
    pub summary: BackupSummary,
    /// Where the store that was in the way went (`store.before-restore-<unix time>`).
    pub moved_aside: Option<PathBuf>,
    /// Where a high-water mark without a store went (the store directory was gone).
    pub mark_moved_aside: Option<PathBuf>,
    /// The restored store's check (healthy, or the restore fails).
    pub report: IntegrityReport,
}

/// Why a backup or a restore was refused or failed. Each names the file or store it is about.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error(
        "the store in {store} is in use (sbxd runs on this data dir, or another `sbxd store` \
         command does): stop it first; a backup or a restore needs the store to itself"
    )]
    InUse { store: PathBuf },
    #[error("there is no store in {store} ({db} does not exist)")]
    NoStore { store: PathBuf, db: PathBuf },
    #[error("{file} already exists; give --force to replace it")]
    FileExists { file: PathBuf },
    #[error(
        "{store} already holds a store; give --force to restore over it (it is then moved to \
         {store}.before-restore-<unix time>, never deleted)"
    )]
    StoreExists { store: PathBuf },
    #[error("{file} is not a usable store backup: {what}")]
    Invalid { file: PathBuf, what: String },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the store in {store}: {source}")]
    Store {
        store: PathBuf,
        #[source]
        source: StoreError,
    },
    #[error(
        "the store restored into {store} fails its check (the store that was there is kept): \
         {report}"
    )]
    RestoredDamaged { store: PathBuf, report: String },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> BackupError {
    let path = path.to_path_buf();
    move |source| BackupError::Io { what, path, source }
}

fn store_err(store: &Path) -> impl FnOnce(StoreError) -> BackupError {
    let store = store.to_path_buf();
    move |source| BackupError::Store { store, source }
}

/// sled takes an exclusive `flock` on `store/db` when it opens a database and holds it until
/// the database closes; taking the same lock tells whether anybody has the store open.
/// `None` when there is no `store/db`.
/// A lock held is waited for as an open waits (`crate::sled_store::LOCK_WAIT`): a handle this
/// process closed a moment ago can keep it that long; a live sbxd keeps it, and the answer is
/// then `InUse`.
fn lock(store: &Path) -> Result<Option<Flock<File>>, BackupError> {
    let db = store.join(SLED_LOG_FILE);
    let began = std::time::Instant::now();
    loop {
        let file = match File::open(&db) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io("cannot open", &db)(e)),
        };
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(locked) => return Ok(Some(locked)),
            Err((_, Errno::EWOULDBLOCK)) if began.elapsed() < crate::sled_store::LOCK_WAIT => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err((_, Errno::EWOULDBLOCK)) => {
                return Err(BackupError::InUse {
                    store: store.to_path_buf(),
                });
            }
            Err((_, errno)) => return Err(io("cannot lock", &db)(errno.into())),
        }
    }
}

/// Writes a backup of the store at `store` (a closed store: see the module docs) to `file`:
/// `file.tmp` first, fsynced, then renamed. An existing `file` is replaced only with `force`.
pub fn backup_store(store: &Path, file: &Path, force: bool) -> Result<BackupSummary, BackupError> {
    if !force && file.symlink_metadata().is_ok() {
        return Err(BackupError::FileExists {
            file: file.to_path_buf(),
        });
    }
    match lock(store)? {
        None => {
            return Err(BackupError::NoStore {
                store: store.to_path_buf(),
                db: store.join(SLED_LOG_FILE),
            });
        }
        // Released before sled takes it (flock is per open file, so ours would block sled's).
        Some(locked) => drop(locked),
    }
    let opened = SledStore::open(store).map_err(|e| match &e {
        StoreError::Io(msg) if msg.contains("could not acquire lock") => BackupError::InUse {
            store: store.to_path_buf(),
        },
        _ => store_err(store)(e),
    })?;
    opened.write_backup(file)
}

/// A writer that hashes and counts what goes through it.
struct Hashing<W: Write> {
    out: W,
    hash: Sha256,
    written: u64,
}

impl<W: Write> Hashing<W> {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.hash.update(bytes);
        self.written += bytes.len() as u64;
        self.out.write_all(bytes)
    }

    fn put_len(&mut self, len: usize) -> std::io::Result<()> {
        let len = u32::try_from(len).map_err(|_| {
            std::io::Error::other(format!("an entry of {len} bytes does not fit the format"))
        })?;
        self.put(&len.to_be_bytes())
    }
}

impl SledStore {
    fn write_backup(&self, file: &Path) -> Result<BackupSummary, BackupError> {
        let store = self.path();
        let db = &self.inner.db;
        let mut names = db.tree_names();
        names.sort();
        // First pass: what each tree holds, for the header and the tree frames.
        let mut trees = Vec::with_capacity(names.len());
        let mut bytes = HEADER_LEN + CHECKSUM_LEN;
        let (mut entries, mut records) = (0u64, 0u64);
        for name in names {
            let tree = db
                .open_tree(&name)
                .map_err(|e| store_err(store)(e.into()))?;
            let mut count = 0u64;
            for entry in tree.iter() {
                let (key, value) = entry.map_err(|e| store_err(store)(e.into()))?;
                count += 1;
                bytes += 8 + key.len() as u64 + value.len() as u64;
            }
            bytes += 4 + name.len() as u64 + 8;
            entries += count;
            if name == TREE_RECORDS.as_bytes() {
                records = count;
            }
            trees.push((name, tree, count));
        }
        let schema_version = match self.inner.trees.meta.get(META_SCHEMA_VERSION) {
            Ok(Some(raw)) => <[u8; 4]>::try_from(&raw[..]).map(u32::from_be_bytes).ok(),
            _ => None,
        }
        .ok_or_else(|| store_err(store)(StoreError::Corrupt("no schema version".into())))?;
        let summary = BackupSummary {
            written_at_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            schema_version,
            revision: self.revision().map_err(store_err(store))?,
            high_water: read_high_water(store).map_err(store_err(store))?,
            trees: trees.len() as u32,
            entries,
            records,
            bytes,
        };

        let tmp = sibling(file, ".tmp");
        let written = (|| {
            let out = File::create(&tmp).map_err(io("cannot create", &tmp))?;
            let mut w = Hashing {
                out: BufWriter::new(out),
                hash: Sha256::new(),
                written: 0,
            };
            let write_err = io("cannot write", &tmp);
            (|| -> std::io::Result<()> {
                w.put(&encode_header(&summary))?;
                for (name, tree, count) in &trees {
                    w.put_len(name.len())?;
                    w.put(name)?;
                    w.put(&count.to_be_bytes())?;
                    let mut seen = 0u64;
                    for entry in tree.iter() {
                        let (key, value) = entry.map_err(std::io::Error::other)?;
                        w.put_len(key.len())?;
                        w.put(&key)?;
                        w.put_len(value.len())?;
                        w.put(&value)?;
                        seen += 1;
                    }
                    if seen != *count {
                        return Err(std::io::Error::other(format!(
                            "tree {} changed during the backup ({count} entries, then {seen})",
                            String::from_utf8_lossy(name)
                        )));
                    }
                }
                let digest = w.hash.clone().finalize();
                w.out.write_all(&digest)?;
                w.written += CHECKSUM_LEN;
                if w.written != summary.bytes {
                    return Err(std::io::Error::other(format!(
                        "wrote {} bytes, {} expected",
                        w.written, summary.bytes
                    )));
                }
                let out = w.out.into_inner().map_err(|e| e.into_error())?;
                out.sync_all()
            })()
            .map_err(write_err)?;
            std::fs::rename(&tmp, file).map_err(io("cannot rename the backup to", file))?;
            sync_parent(file)
        })();
        if written.is_err() {
            // Ours, and half written: never left under a name that looks like a backup.
            let _ = std::fs::remove_file(&tmp);
        }
        written.map(|()| summary)
    }
}

fn encode_header(s: &BackupSummary) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_LEN as usize);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&BACKUP_FORMAT_VERSION.to_be_bytes());
    h.extend_from_slice(&s.bytes.to_be_bytes());
    h.extend_from_slice(&s.written_at_ms.to_be_bytes());
    h.extend_from_slice(&s.schema_version.to_be_bytes());
    h.extend_from_slice(&s.revision.to_be_bytes());
    h.extend_from_slice(&s.high_water.unwrap_or(u64::MAX).to_be_bytes());
    h.extend_from_slice(&s.trees.to_be_bytes());
    h.extend_from_slice(&s.entries.to_be_bytes());
    h.extend_from_slice(&s.records.to_be_bytes());
    debug_assert_eq!(h.len() as u64, HEADER_LEN);
    h
}

/// `path` with `suffix` appended to its file name.
fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

fn sync_parent(path: &Path) -> Result<(), BackupError> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(parent)
        .and_then(|d| d.sync_all())
        .map_err(io("cannot sync the directory", parent))
}

/// Reads a backup file front to back, hashing what it reads.
struct Reader {
    file: PathBuf,
    input: BufReader<File>,
    hash: Sha256,
    at: u64,
    /// Where the checksum begins.
    end: u64,
}

impl Reader {
    fn invalid(&self, what: String) -> BackupError {
        BackupError::Invalid {
            file: self.file.clone(),
            what,
        }
    }

    fn bytes(&mut self, len: u64, what: &str) -> Result<Vec<u8>, BackupError> {
        if self.at + len > self.end {
            return Err(self.invalid(format!(
                "{what} at byte {} ({len} bytes) runs past the end of the data at byte {}",
                self.at, self.end
            )));
        }
        let mut buf = vec![0u8; len as usize];
        self.input
            .read_exact(&mut buf)
            .map_err(io("cannot read", &self.file))?;
        self.hash.update(&buf);
        self.at += len;
        Ok(buf)
    }

    fn u32(&mut self, what: &str) -> Result<u32, BackupError> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_be_bytes(b.try_into().expect("4 bytes")))
    }

    fn u64(&mut self, what: &str) -> Result<u64, BackupError> {
        let b = self.bytes(8, what)?;
        Ok(u64::from_be_bytes(b.try_into().expect("8 bytes")))
    }

    /// The checksum at the end, compared with what was read.
    fn finish(mut self) -> Result<(), BackupError> {
        if self.at != self.end {
            return Err(self.invalid(format!(
                "its data ends at byte {}, the header says {}",
                self.at, self.end
            )));
        }
        let mut stored = [0u8; CHECKSUM_LEN as usize];
        self.input
            .read_exact(&mut stored)
            .map_err(io("cannot read", &self.file))?;
        let actual = self.hash.clone().finalize();
        if actual[..] != stored[..] {
            return Err(self.invalid(format!(
                "checksum mismatch: the SHA-256 of its contents is {}, the file records {} — it \
                 was altered or damaged after it was written",
                hex(&actual),
                hex(&stored)
            )));
        }
        Ok(())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Opens `file` and reads its header: magic, version, length against the file's own.
fn open_backup(file: &Path) -> Result<(Reader, BackupSummary), BackupError> {
    let invalid = |what: String| BackupError::Invalid {
        file: file.to_path_buf(),
        what,
    };
    let input = File::open(file).map_err(io("cannot open", file))?;
    let len = input.metadata().map_err(io("cannot stat", file))?.len();
    if len < HEADER_LEN + CHECKSUM_LEN {
        return Err(invalid(format!(
            "truncated: it is {len} bytes, shorter than a header and a checksum ({})",
            HEADER_LEN + CHECKSUM_LEN
        )));
    }
    let mut r = Reader {
        file: file.to_path_buf(),
        input: BufReader::with_capacity(1 << 20, input),
        hash: Sha256::new(),
        at: 0,
        end: HEADER_LEN,
    };
    if r.bytes(16, "the magic")?[..] != MAGIC[..] {
        return Err(invalid(format!(
            "it does not begin with {:?} (not a backup made by `sbxd store backup`)",
            String::from_utf8_lossy(MAGIC)
        )));
    }
    let version = r.u32("the format version")?;
    if version != BACKUP_FORMAT_VERSION {
        return Err(invalid(format!(
            "format version {version}; this build reads version {BACKUP_FORMAT_VERSION}"
        )));
    }
    let bytes = r.u64("the length")?;
    if len < bytes {
        return Err(invalid(format!(
            "truncated: it is {len} bytes, its header says {bytes}"
        )));
    }
    if len > bytes {
        return Err(invalid(format!(
            "it is {len} bytes, its header says {bytes}: something was appended"
        )));
    }
    let summary = BackupSummary {
        written_at_ms: r.u64("the time")?,
        schema_version: r.u32("the schema version")?,
        revision: r.u64("the revision")?,
        high_water: Some(r.u64("the high-water mark")?).filter(|m| *m != u64::MAX),
        trees: r.u32("the tree count")?,
        entries: r.u64("the entry count")?,
        records: r.u64("the record count")?,
        bytes,
    };
    r.end = bytes - CHECKSUM_LEN;
    Ok((r, summary))
}

/// Checks `file` end to end: the checksum over every byte first (so an altered byte is named
/// as such, whatever it hit), then the frames against the counts in the header. Reads, never
/// writes.
pub fn verify_backup(file: &Path) -> Result<BackupSummary, BackupError> {
    let (mut r, summary) = open_backup(file)?;
    let mut buf = vec![0u8; 1 << 20];
    while r.at < r.end {
        let n = (r.end - r.at).min(buf.len() as u64) as usize;
        r.input
            .read_exact(&mut buf[..n])
            .map_err(io("cannot read", file))?;
        r.hash.update(&buf[..n]);
        r.at += n as u64;
    }
    r.finish()?;
    if summary.schema_version > SCHEMA_VERSION {
        return Err(BackupError::Invalid {
            file: file.to_path_buf(),
            what: format!(
                "it holds a store of schema version {}, newer than this build's {SCHEMA_VERSION}; \
                 restore it with a newer sbxd",
                summary.schema_version
            ),
        });
    }
    read_frames(file, &summary, |_, _| Ok(()))?;
    Ok(summary)
}

/// Reads every tree frame of `file`, handing entries to `sink` in batches of at most
/// [`IMPORT_BATCH`], and checks the counts and the checksum against `expected` (so a file that
/// changed since it was verified is refused too).
fn read_frames(
    file: &Path,
    expected: &BackupSummary,
    mut sink: impl FnMut(&[u8], Vec<(Vec<u8>, Vec<u8>)>) -> Result<(), BackupError>,
) -> Result<(), BackupError> {
    let (mut r, summary) = open_backup(file)?;
    if &summary != expected {
        return Err(r.invalid("it changed while it was being restored".into()));
    }
    let (mut entries, mut records) = (0u64, 0u64);
    for t in 0..summary.trees {
        let name_len = r.u32("a tree name's length")?;
        let name = r.bytes(name_len.into(), "a tree name")?;
        let shown = String::from_utf8_lossy(&name).into_owned();
        let count = r.u64(&format!("tree {shown}'s entry count"))?;
        let mut batch = Vec::new();
        for i in 0..count {
            let what = format!("entry {i} of tree {shown} (tree {t})");
            let key_len = r.u32(&what)?;
            let key = r.bytes(key_len.into(), &what)?;
            let value_len = r.u32(&what)?;
            let value = r.bytes(value_len.into(), &what)?;
            batch.push((key, value));
            if batch.len() == IMPORT_BATCH {
                sink(&name, std::mem::take(&mut batch))?;
            }
        }
        sink(&name, batch)?;
        entries += count;
        if name == TREE_RECORDS.as_bytes() {
            records = count;
        }
    }
    if (entries, records) != (summary.entries, summary.records) {
        return Err(r.invalid(format!(
            "it holds {entries} entries and {records} records, its header says {} and {}",
            summary.entries, summary.records
        )));
    }
    r.finish()
}

/// Restores `file` into the store at `store` (`DATA/store`): verifies it, refuses when a store
/// is there unless `force` (which moves it aside), imports into a new directory beside it,
/// renames that into place, sets the high-water mark to the backup's revision and checks the
/// result. Refused while anybody has the store open.
pub fn restore_store(file: &Path, store: &Path, force: bool) -> Result<Restored, BackupError> {
    let summary = verify_backup(file)?;
    // Held until the old store is out of the way, so that no sbxd opens it meanwhile.
    let _locked = lock(store)?;
    let holds = match std::fs::read_dir(store) {
        Ok(mut entries) => entries.next().is_some(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return Err(io("cannot read", store)(e)),
    };
    if holds && !force {
        return Err(BackupError::StoreExists {
            store: store.to_path_buf(),
        });
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let importing = sibling(store, &format!(".restoring-{now}-{}", std::process::id()));
    std::fs::create_dir(&importing).map_err(io("cannot create", &importing))?;
    if let Err(e) = import(file, &importing, &summary) {
        // Ours and incomplete: nothing of the operator's is in it.
        let _ = std::fs::remove_dir_all(&importing);
        return Err(e);
    }

    let aside = free_name(store, now);
    let mark = high_water_path(store);
    let mut moved_aside = None;
    let mut mark_moved_aside = None;
    if holds {
        std::fs::rename(store, &aside).map_err(io("cannot move aside", store))?;
        moved_aside = Some(aside.clone());
    } else if store.exists() {
        std::fs::remove_dir(store).map_err(io("cannot replace the empty directory", store))?;
    }
    if mark.exists() {
        let to = high_water_path(&aside);
        std::fs::rename(&mark, &to).map_err(io("cannot move aside", &mark))?;
        if !holds {
            mark_moved_aside = Some(to);
        }
    }
    std::fs::rename(&importing, store).map_err(io("cannot rename the restored store to", store))?;
    sync_parent(store)?;
    drop(_locked);

    let opened = SledStore::open(store).map_err(store_err(store))?;
    opened.accept_as_is().map_err(store_err(store))?;
    let report = opened.check_integrity().map_err(store_err(store))?;
    let records = opened.inner.trees.records.len() as u64;
    if !report.healthy() || report.revision != summary.revision || records != summary.records {
        return Err(BackupError::RestoredDamaged {
            store: store.to_path_buf(),
            report: format!(
                "revision {} (backup: {}), {records} records (backup: {}){}{}",
                report.revision,
                summary.revision,
                summary.records,
                if report.healthy() { "" } else { "\n" },
                report.describe()
            ),
        });
    }
    Ok(Restored {
        summary,
        moved_aside,
        mark_moved_aside,
        report,
    })
}

/// `store.before-restore-<now>`, or with `-2`, `-3`, ... when that is taken.
fn free_name(store: &Path, now: u64) -> PathBuf {
    let base = sibling(store, &format!(".before-restore-{now}"));
    let mut candidate = base.clone();
    let mut n = 2;
    while candidate.symlink_metadata().is_ok() || high_water_path(&candidate).exists() {
        candidate = sibling(&base, &format!("-{n}"));
        n += 1;
    }
    candidate
}

/// Writes every entry of `file` into a new sled database at `dir` and makes it durable.
fn import(file: &Path, dir: &Path, summary: &BackupSummary) -> Result<(), BackupError> {
    let sled_err = |e: sled::Error| store_err(dir)(e.into());
    let db = crate::open_raw_sled(dir).map_err(sled_err)?;
    read_frames(file, summary, |name, entries| {
        let tree = db.open_tree(name).map_err(sled_err)?;
        let mut batch = sled::Batch::default();
        for (key, value) in entries {
            batch.insert(key, value);
        }
        tree.apply_batch(batch).map_err(sled_err)
    })?;
    // The meta tree must say what the header says, or the mark set from it would lie.
    let meta = db.open_tree(TREE_META).map_err(sled_err)?;
    let revision = meta
        .get(crate::layout::META_REVISION)
        .map_err(sled_err)?
        .and_then(|raw| <[u8; 8]>::try_from(&raw[..]).ok().map(u64::from_be_bytes));
    if revision != Some(summary.revision) {
        return Err(BackupError::Invalid {
            file: file.to_path_buf(),
            what: format!(
                "its meta tree holds revision {revision:?}, its header says {}",
                summary.revision
            ),
        });
    }
    db.flush().map_err(sled_err)?;
    let log = dir.join(SLED_LOG_FILE);
    File::open(&log)
        .and_then(|f| f.sync_all())
        .map_err(io("cannot sync", &log))?;
    drop(db);
    OpenOptions::new()
        .read(true)
        .open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("cannot sync the directory", dir))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Kind, NewRecord, ObjectStore};

    fn record(kind: Kind, workspace: Option<uuid::Uuid>, name: &str) -> NewRecord {
        NewRecord {
            id: uuid::Uuid::new_v4(),
            kind,
            workspace,
            name: name.into(),
            owner: None,
            labels: Default::default(),
            created_at_ms: 1_000,
            body: vec![7; 100],
        }
    }

    async fn store_with(path: &Path, sandboxes: usize) -> u64 {
        let store = SledStore::open(path).unwrap();
        let ws = store
            .create(record(Kind::Workspace, None, "team"))
            .await
            .unwrap();
        for i in 0..sandboxes {
            store
                .create(record(Kind::Sandbox, Some(ws.id), &format!("sb-{i}")))
                .await
                .unwrap();
        }
        store.current_revision().await.unwrap()
    }

    #[tokio::test]
    async fn a_backup_round_trips_and_every_damage_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        let revision = store_with(&store, 30).await;
        let file = dir.path().join("b.sbxbak");
        let summary = backup_store(&store, &file, false).unwrap();
        assert_eq!((summary.revision, summary.records), (revision, 31));
        assert!(!sibling(&file, ".tmp").exists());
        assert_eq!(verify_backup(&file).unwrap(), summary);
        assert!(matches!(
            backup_store(&store, &file, false),
            Err(BackupError::FileExists { .. })
        ));

        let bytes = std::fs::read(&file).unwrap();
        let damaged = dir.path().join("damaged");
        let said = |content: &[u8]| {
            std::fs::write(&damaged, content).unwrap();
            verify_backup(&damaged).unwrap_err().to_string()
        };
        assert!(said(&bytes[..bytes.len() / 2]).contains("truncated"));
        assert!(said(&bytes[..10]).contains("truncated"));
        let mut altered = bytes.clone();
        altered[bytes.len() / 2] ^= 1;
        assert!(said(&altered).contains("checksum mismatch"));
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(said(&longer).contains("appended"));
        let mut version = bytes.clone();
        version[19] = 9;
        assert!(said(&version).contains("format version 9"));

        // Restore into another data dir: the same entries, the mark at the revision.
        let other = dir.path().join("other/store");
        std::fs::create_dir_all(other.parent().unwrap()).unwrap();
        let restored = restore_store(&file, &other, false).unwrap();
        assert!(restored.report.healthy());
        assert_eq!(read_high_water(&other).unwrap(), Some(revision));
        let a = SledStore::open(&store).unwrap();
        let b = SledStore::open(&other).unwrap();
        for name in a.inner.db.tree_names() {
            let left: Vec<_> = a.inner.db.open_tree(&name).unwrap().iter().collect();
            let right: Vec<_> = b.inner.db.open_tree(&name).unwrap().iter().collect();
            assert_eq!(left.len(), right.len());
            for (l, r) in left.into_iter().zip(right) {
                assert_eq!(l.unwrap(), r.unwrap());
            }
        }
        // Open: refused as in use; closed and present: refused without --force.
        assert!(matches!(
            restore_store(&file, &other, true),
            Err(BackupError::InUse { .. })
        ));
        assert!(matches!(
            backup_store(&other, &dir.path().join("c"), false),
            Err(BackupError::InUse { .. })
        ));
        drop(b);
        assert!(matches!(
            restore_store(&file, &other, false),
            Err(BackupError::StoreExists { .. })
        ));
        let again = restore_store(&file, &other, true).unwrap();
        let aside = again.moved_aside.unwrap();
        assert!(aside.join("db").exists() && high_water_path(&aside).exists());
    }
}

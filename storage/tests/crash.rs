//! Fork-and-kill crash test: a child process writes through the store and prints every
//! acknowledged write; the parent SIGKILLs it at a seeded random moment, reopens the store and
//! checks that every acknowledged write survived and that the indexes agree with the records.
//!
//! Rounds: 40 by default, `SBX_CRASH_ROUNDS` for more. Seeds: random unless
//! `SBX_CRASH_SEED` is set; a failing round prints its seed.

mod common;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::assert_fsck_clean;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sbx_storage::{Kind, ListQuery, ObjectStore, Scope, SledStore};
use uuid::Uuid;

const WRITER: &str = env!("CARGO_BIN_EXE_sbx-store-crash-writer");
/// How long the parent waits for one line before calling the writer hung.
const LINE_TIMEOUT: Duration = Duration::from_secs(20);

/// What the parent knows about one record from the writer's acknowledgements.
#[derive(Debug, Clone)]
struct Expected {
    min_version: u64,
    owner: Option<Uuid>,
    /// Deletes of this record issued and not yet answered. A count, not a flag: two tasks may
    /// delete the same record at once, and the one refused (NOT_FOUND: the other took it)
    /// answers while the other's answer may never come before the kill.
    pending_deletes: u32,
}

#[derive(Default)]
struct Model {
    live: HashMap<Uuid, Expected>,
    deleted: HashSet<Uuid>,
    max_version: u64,
}

impl Model {
    fn apply(&mut self, line: &str) -> Result<(), String> {
        let parts: Vec<&str> = line.split_whitespace().collect();
        let id = |i: usize| -> Result<Uuid, String> {
            parts
                .get(i)
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| format!("bad line {line:?}"))
        };
        let version = |i: usize| -> Result<u64, String> {
            parts
                .get(i)
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| format!("bad line {line:?}"))
        };
        match parts.first().copied() {
            Some("ready") => {}
            Some("create") => {
                let (id, v) = (id(1)?, version(2)?);
                self.max_version = self.max_version.max(v);
                let owner = match parts.get(4) {
                    Some(&"-") | None => None,
                    Some(s) => Some(s.parse().map_err(|_| format!("bad owner in {line:?}"))?),
                };
                // Lines from concurrent tasks can arrive after the delete that removed it.
                if !self.deleted.contains(&id) {
                    self.live.insert(
                        id,
                        Expected {
                            min_version: v,
                            owner,
                            pending_deletes: 0,
                        },
                    );
                }
            }
            Some("update") => {
                let (id, v) = (id(1)?, version(2)?);
                self.max_version = self.max_version.max(v);
                if let Some(e) = self.live.get_mut(&id) {
                    e.min_version = e.min_version.max(v);
                } else if !self.deleted.contains(&id) {
                    return Err(format!("update of unknown record: {line:?}"));
                }
            }
            Some("begin-delete") => {
                if let Some(e) = self.live.get_mut(&id(1)?) {
                    e.pending_deletes += 1;
                }
            }
            Some("failed") => {
                if let Some(e) = self.live.get_mut(&id(1)?) {
                    e.pending_deletes = e.pending_deletes.saturating_sub(1);
                }
            }
            Some("delete") => {
                for i in 1..parts.len() {
                    let id = id(i)?;
                    self.live.remove(&id);
                    self.deleted.insert(id);
                }
            }
            _ => return Err(format!("unknown line {line:?}")),
        }
        Ok(())
    }

    /// Whether the record may legitimately be absent: a delete of it or of an owner above it
    /// was in flight when the writer died.
    fn may_be_gone(&self, id: Uuid) -> bool {
        let mut cursor = Some(id);
        for _ in 0..64 {
            let Some(e) = cursor.and_then(|c| self.live.get(&c)) else {
                // An owner that is no longer live: it was deleted, so this one may be too.
                return cursor.is_some();
            };
            if e.pending_deletes > 0 {
                return true;
            }
            cursor = e.owner;
        }
        false
    }
}

/// One round: run the writer, kill it after a seeded number of acknowledged lines (plus a
/// seeded delay), then verify. Returns the number of acknowledged lines seen.
fn round(path: &Path, seed: u64, model: &mut Model) -> Result<usize, String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let kill_after_lines = rng.random_range(1..150usize);
    // Half the rounds kill right after the Nth acknowledgement, inside the next write.
    let extra_delay = if rng.random_bool(0.5) {
        Duration::ZERO
    } else {
        Duration::from_micros(rng.random_range(0..3_000u64))
    };
    let mut child = Command::new(WRITER)
        .arg(path)
        .arg(seed.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("spawn writer: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let (tx, rx) = mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut lines = 0;
    let mut ready = false;
    // Counted from "ready" on: on a fresh store the writer first says the workspace it made,
    // and a kill after that one line would come before it is ready (seen once in CI).
    let mut since_ready = 0;
    let mut outcome = Ok(());
    while since_ready < kill_after_lines {
        match rx.recv_timeout(LINE_TIMEOUT) {
            Ok(line) => {
                if ready {
                    since_ready += 1;
                }
                ready |= line == "ready";
                lines += 1;
                if let Err(e) = model.apply(&line) {
                    outcome = Err(e);
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                outcome = Err(format!("writer silent for {LINE_TIMEOUT:?}"));
                break;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break, // writer exited
        }
    }
    std::thread::sleep(extra_delay);
    // std's Child::kill sends SIGKILL on Unix.
    let _ = child.kill();
    let status = child.wait().map_err(|e| format!("wait: {e}"))?;
    // Lines written before the kill are acknowledged writes too: drain them.
    let _ = reader.join();
    for line in rx.try_iter() {
        lines += 1;
        ready |= line == "ready";
        model.apply(&line)?;
    }
    outcome?;
    if !ready {
        return Err(format!("writer never became ready (status {status})"));
    }
    Ok(lines)
}

fn verify(path: &Path, model: &mut Model) -> Result<(), String> {
    let store = SledStore::open(path).map_err(|e| format!("reopen: {e}"))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| e.to_string())?;
    let problems = store.verify_indexes().map_err(|e| e.to_string())?;
    if !problems.is_empty() {
        return Err(format!("fsck after crash: {problems:#?}"));
    }
    let revision = rt
        .block_on(store.current_revision())
        .map_err(|e| e.to_string())?;
    if revision < model.max_version {
        return Err(format!(
            "revision went back: {revision} < acknowledged {}",
            model.max_version
        ));
    }
    for (id, e) in &model.live {
        match rt.block_on(store.get(*id)).map_err(|e| e.to_string())? {
            Some(rec) if rec.resource_version >= e.min_version => {}
            Some(rec) => {
                return Err(format!(
                    "{id} is at version {}, acknowledged {}",
                    rec.resource_version, e.min_version
                ));
            }
            None if model.may_be_gone(*id) => {}
            None => return Err(format!("acknowledged record {id} was lost")),
        }
    }
    for id in &model.deleted {
        if rt
            .block_on(store.get(*id))
            .map_err(|e| e.to_string())?
            .is_some()
        {
            return Err(format!("acknowledged delete of {id} was undone"));
        }
    }
    // The next round starts from what is on disk now (pending deletes are resolved).
    let mut live = HashMap::new();
    for kind in [Kind::Workspace, Kind::Sandbox, Kind::Setting] {
        let page = rt
            .block_on(store.list(ListQuery::new(kind, Scope::All, 0)))
            .map_err(|e| e.to_string())?;
        for rec in page.records {
            live.insert(
                rec.id,
                Expected {
                    min_version: rec.resource_version,
                    owner: rec.owner,
                    pending_deletes: 0,
                },
            );
        }
    }
    model.live = live;
    assert_fsck_clean(&store);
    Ok(())
}

#[test]
fn acknowledged_writes_survive_sigkill() {
    let rounds: u64 = std::env::var("SBX_CRASH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let base_seed: u64 = std::env::var("SBX_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db");
    let mut model = Model::default();
    let started = Instant::now();
    let mut total_lines = 0;
    for r in 0..rounds {
        let seed = base_seed.wrapping_add(r);
        let result = round(&path, seed, &mut model).and_then(|lines| {
            total_lines += lines;
            verify(&path, &mut model)
        });
        if let Err(e) = result {
            panic!(
                "crash round {r} failed: {e}\nreproduce with SBX_CRASH_SEED={base_seed} \
                 (round seed {seed})"
            );
        }
    }
    eprintln!(
        "{rounds} crash rounds, {total_lines} acknowledged lines, {} records live, {} deleted, \
         in {:?} (base seed {base_seed})",
        model.live.len(),
        model.deleted.len(),
        started.elapsed()
    );
    assert!(
        total_lines as u64 >= rounds,
        "the writer acknowledged nothing"
    );
    assert!(!model.live.is_empty());
}

/// Two tasks delete one record at once: one's delete commits and the writer dies before it
/// says so; the other's is refused (the record is gone) and says "failed". The record may be
/// gone then — the refusal does not cancel the other delete (seen once in CI as "acknowledged
/// record … was lost").
#[test]
fn a_refused_delete_does_not_cancel_another_in_flight() {
    let id = Uuid::new_v4();
    let mut model = Model::default();
    for line in [
        format!("create {id} 2 sandbox -"),
        format!("begin-delete {id}"),
        format!("begin-delete {id}"),
        format!("failed {id}"),
    ] {
        model.apply(&line).unwrap();
    }
    assert!(model.may_be_gone(id));
    model.apply(&format!("failed {id}")).unwrap();
    assert!(
        !model.may_be_gone(id),
        "both deletes answered: it must be there"
    );
}

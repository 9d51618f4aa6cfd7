//! The child process of the fork-and-kill crash test (`storage/tests/crash.rs`).
//!
//! Usage: `sbx-store-crash-writer <store-path> <seed>`
//!
//! Opens the store and, from 4 concurrent tasks with seeded random choices, creates sandboxes
//! and settings, updates and deletes them, until killed (or after a bounded number of
//! operations). Each acknowledged (durable) write is printed as one line on stdout:
//!
//! ```text
//! ready
//! create <id> <version> <kind> <owner-id or ->
//! update <id> <version>
//! begin-delete <id>            (printed before the delete is issued)
//! delete <id> <deleted-id>...  (acknowledged; the first id is <id>)
//! failed <id>                  (a delete refused by Conflict/NotFound: nothing was deleted)
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sbx_storage::{Kind, ListQuery, NewRecord, ObjectStore, Record, Scope, SledStore, StoreError};
use uuid::Uuid;

/// Operations per task before the writer exits by itself (the test kills it long before).
const MAX_OPS_PER_TASK: usize = 20_000;
const TASKS: u64 = 4;

type Live = Arc<Mutex<BTreeMap<Uuid, Record>>>;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(path), Some(seed)) = (args.next(), args.next()) else {
        return Err("usage: sbx-store-crash-writer <store-path> <seed>".into());
    };
    let path = PathBuf::from(path);
    let seed: u64 = seed.parse()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(run(path, seed))
}

async fn run(path: PathBuf, seed: u64) -> Result<(), Box<dyn std::error::Error>> {
    let store = SledStore::open(&path)?;
    let ws = match store.get_by_name(Kind::Workspace, None, "crash").await? {
        Some(ws) => ws,
        None => {
            let ws = store
                .create(new_record(Kind::Workspace, None, None, "crash"))
                .await?;
            println!("create {} {} workspace -", ws.id, ws.resource_version);
            ws
        }
    };
    let live: Live = Arc::default();
    for kind in [Kind::Sandbox, Kind::Setting] {
        let page = store
            .list(ListQuery::new(kind, Scope::Workspace(ws.id), 0))
            .await?;
        let mut live = live.lock().map_err(|_| "poisoned")?;
        live.extend(page.records.into_iter().map(|r| (r.id, r)));
    }
    println!("ready");
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (store, live, ws) = (store.clone(), Arc::clone(&live), ws.clone());
        let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(31).wrapping_add(task));
        tasks.push(tokio::spawn(async move {
            for _ in 0..MAX_OPS_PER_TASK {
                step(&store, &live, &ws, &mut rng).await;
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    Ok(())
}

fn new_record(kind: Kind, workspace: Option<Uuid>, owner: Option<Uuid>, name: &str) -> NewRecord {
    NewRecord {
        id: Uuid::new_v4(),
        kind,
        workspace,
        name: name.to_string(),
        owner,
        labels: BTreeMap::new(),
        created_at_ms: now_ms(),
        body: Vec::new(),
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A random live record of `kind`, if any.
fn pick(live: &Live, rng: &mut StdRng, kind: Option<Kind>) -> Option<Record> {
    let live = live.lock().ok()?;
    let candidates: Vec<&Record> = live
        .values()
        .filter(|r| kind.is_none_or(|k| r.kind == k))
        .collect();
    if candidates.is_empty() {
        return None;
    }
    Some(candidates[rng.random_range(0..candidates.len())].clone())
}

async fn step(store: &SledStore, live: &Live, ws: &Record, rng: &mut StdRng) {
    let roll = rng.random_range(0..100u32);
    let name = format!("n-{:016x}", rng.random::<u64>());
    if roll < 45 {
        let mut rec = new_record(Kind::Sandbox, Some(ws.id), None, &name);
        rec.body = vec![7; rng.random_range(0..256usize)];
        if let Ok(r) = store.create(rec).await {
            println!("create {} {} sandbox -", r.id, r.resource_version);
            live_insert(live, r);
        }
    } else if roll < 65 {
        let Some(owner) = pick(live, rng, Some(Kind::Sandbox)) else {
            return;
        };
        let rec = new_record(Kind::Setting, Some(ws.id), Some(owner.id), &name);
        if let Ok(r) = store.create(rec).await {
            println!(
                "create {} {} setting {}",
                r.id, r.resource_version, owner.id
            );
            live_insert(live, r);
        }
    } else if roll < 85 {
        let Some(mut rec) = pick(live, rng, None) else {
            return;
        };
        rec.labels
            .insert("round".into(), format!("{}", rng.random::<u16>()));
        rec.body = vec![9; rng.random_range(0..256usize)];
        if let Ok(r) = store.update(rec).await {
            println!("update {} {}", r.id, r.resource_version);
            live_insert(live, r);
        }
    } else {
        let Some(rec) = pick(live, rng, Some(Kind::Sandbox)) else {
            return;
        };
        println!("begin-delete {}", rec.id);
        match store.delete(rec.id, rec.resource_version).await {
            Ok(ids) => {
                let list: Vec<String> = ids.iter().map(Uuid::to_string).collect();
                println!("delete {}", list.join(" "));
                if let Ok(mut live) = live.lock() {
                    for id in ids {
                        live.remove(&id);
                    }
                }
            }
            // Refused before anything was written: the record stays.
            Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {
                println!("failed {}", rec.id)
            }
            // Anything else may have committed without being acknowledged: stay pending.
            Err(e) => eprintln!("delete {} failed: {e}", rec.id),
        }
    }
}

fn live_insert(live: &Live, rec: Record) {
    if let Ok(mut live) = live.lock() {
        // Another task may have deleted it (or written a newer version) meanwhile.
        match live.get(&rec.id) {
            Some(old) if old.resource_version > rec.resource_version => {}
            _ => {
                live.insert(rec.id, rec);
            }
        }
    }
}

//! Storage benchmark: durable acknowledged writes per second with 1, 8 and 64 concurrent
//! writers (side by side, one run), and the time to reopen and fsck a store of N records.
//!
//! Usage: `cargo run --release -p sbx-storage --bin sbx-store-bench -- [--seconds S]
//! [--records N] [--dir PATH]` (defaults: 3 s per writer count, 100000 records, a fresh
//! directory under the system temp dir, removed afterwards).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sbx_storage::{Kind, ListQuery, NewRecord, ObjectStore, Record, Scope, SledStore};
use uuid::Uuid;

struct Args {
    seconds: f64,
    records: u64,
    dir: PathBuf,
    /// The directory was made by us and is removed at the end.
    remove_dir: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        seconds: 3.0,
        records: 100_000,
        dir: std::env::temp_dir().join(format!("sbx-store-bench-{}", Uuid::new_v4())),
        remove_dir: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--seconds" => args.seconds = value.parse().map_err(|e| format!("--seconds: {e}"))?,
            "--records" => args.records = value.parse().map_err(|e| format!("--records: {e}"))?,
            "--dir" => {
                args.dir = PathBuf::from(value);
                args.remove_dir = false;
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(args)
}

fn sandbox(ws: Uuid, n: u64) -> NewRecord {
    NewRecord {
        id: Uuid::new_v4(),
        kind: Kind::Sandbox,
        workspace: Some(ws),
        name: format!("sb-{n}"),
        owner: None,
        labels: BTreeMap::from([("bench".to_string(), "yes".to_string())]),
        created_at_ms: n,
        // About the size of a prost-encoded sandbox spec and status.
        body: vec![0x5a; 200],
    }
}

async fn workspace(store: &SledStore) -> Result<Record, Box<dyn std::error::Error>> {
    Ok(store
        .create(NewRecord {
            id: Uuid::new_v4(),
            kind: Kind::Workspace,
            workspace: None,
            name: "bench".into(),
            owner: None,
            labels: BTreeMap::new(),
            created_at_ms: 0,
            body: Vec::new(),
        })
        .await?)
}

/// `writers` tasks create sandboxes until `until` (time) or `count` creates in total.
async fn write_load(
    store: &SledStore,
    ws: Uuid,
    writers: u64,
    until: Option<Instant>,
    count: u64,
) -> Result<(u64, Duration), Box<dyn std::error::Error>> {
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..writers {
        let (store, next) = (store.clone(), Arc::clone(&next));
        tasks.push(tokio::spawn(async move {
            let mut done = 0u64;
            loop {
                if until.is_some_and(|u| Instant::now() >= u) {
                    break;
                }
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= count {
                    break;
                }
                store.create(sandbox(ws, n)).await?;
                done += 1;
            }
            Ok::<u64, sbx_storage::StoreError>(done)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok((total, started.elapsed()))
}

async fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    std::fs::create_dir_all(&args.dir)?;
    println!(
        "## sbx-store-bench ({} s per writer count, {} records for reopen)",
        args.seconds, args.records
    );
    println!();
    println!(
        "| writers | acknowledged writes | writes/s | flushes | writes per flush | mean flush | bytes per flush | mean write latency | writes/s vs 1 writer |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut single = None;
    for writers in [1u64, 8, 64] {
        let path = args.dir.join(format!("writers-{writers}"));
        let store = SledStore::open(&path)?;
        let ws = workspace(&store).await?;
        let before = store.flush_stats();
        let until = Instant::now() + Duration::from_secs_f64(args.seconds);
        let (done, took) = write_load(&store, ws.id, writers, Some(until), u64::MAX).await?;
        let after = store.flush_stats();
        let flushes = after.flushes - before.flushes;
        let flush_ms =
            (after.flush_micros - before.flush_micros) as f64 / 1e3 / flushes.max(1) as f64;
        let rate = done as f64 / took.as_secs_f64();
        let latency = took.as_secs_f64() * writers as f64 / done.max(1) as f64;
        let speedup = rate / *single.get_or_insert(rate);
        println!(
            "| {writers} | {done} | {rate:.0} | {flushes} | {:.1} | {flush_ms:.2} ms | {:.0} | {:.2} ms | {speedup:.1}x |",
            done as f64 / flushes.max(1) as f64,
            (after.flush_bytes - before.flush_bytes) as f64 / flushes.max(1) as f64,
            latency * 1e3,
        );
        drop(store);
        std::fs::remove_dir_all(&path)?;
    }
    println!();

    let path = args.dir.join("reopen");
    let store = SledStore::open(&path)?;
    let ws = workspace(&store).await?;
    let (loaded, took) = write_load(&store, ws.id, 256, None, args.records).await?;
    println!(
        "loaded {loaded} records with 256 writers in {:.2} s ({:.0} writes/s)",
        took.as_secs_f64(),
        loaded as f64 / took.as_secs_f64()
    );
    drop(store);
    let size = dir_size(&path);
    let started = Instant::now();
    let store = SledStore::open(&path)?;
    let open_time = started.elapsed();
    let started = Instant::now();
    let problems = store.verify_indexes()?;
    let fsck_time = started.elapsed();
    let started = Instant::now();
    let listed = store
        .list(ListQuery::new(Kind::Sandbox, Scope::Workspace(ws.id), 0))
        .await?;
    let list_time = started.elapsed();
    println!();
    println!("| records | on disk | reopen | fsck (verify_indexes) | problems | list all |");
    println!("|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {:.1} MiB | {:.0} ms | {:.0} ms | {} | {:.0} ms |",
        listed.records.len(),
        size as f64 / (1024.0 * 1024.0),
        open_time.as_secs_f64() * 1e3,
        fsck_time.as_secs_f64() * 1e3,
        problems.len(),
        list_time.as_secs_f64() * 1e3,
    );
    if !problems.is_empty() {
        return Err(format!(
            "fsck found {} problems: {:?}",
            problems.len(),
            &problems[..problems.len().min(5)]
        )
        .into());
    }
    if listed.records.len() as u64 != loaded {
        return Err(format!("listed {} of {loaded} records", listed.records.len()).into());
    }
    Ok(())
}

fn dir_size(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = runtime.block_on(run(&args));
    if args.remove_dir {
        let _ = std::fs::remove_dir_all(&args.dir);
    }
    result
}

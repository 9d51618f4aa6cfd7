//! The journal of a round, and its replay.
//!
//! A seed fixes what a round's clients and injector choose, not how their operations
//! interleave with each other and with the actors (issue 13: chaos seed 10 failed once and
//! passed six replays of its seed). So every client operation and every fault is journaled:
//! numbered in the order it began, with the entries that had ended since the previous one
//! began, its answer, and the id a create was given. A failing round keeps its directory (the
//! store too) and writes `journal.jsonl` there (a header line with the config and the
//! violation, then one entry per line); `SBX_CHAOS_REPLAY=FILE` runs it again.
//!
//! A replay issues exactly those operations and faults, each once, and keeps the order the
//! round observed: entry `n` begins only after entry `n - 1` began and after every entry that
//! had ended before `n` began has ended in the replay too. Ids are translated: an operation on
//! the sandbox that entry `k` created acts on the sandbox entry `k` created in the replay.
//! What it does not reproduce: overlaps (two entries that ran at once may not overlap again),
//! the interleaving inside the actor tree, and which driver calls the sim driver's seeded
//! faults hit (they are drawn per call, and the calls are not the same ones).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use uuid::Uuid;

use super::faults::apply_fault;
pub use super::{Action, Answer};
use super::{ChaosConfig, Harness, perform};

/// The format of `journal.jsonl`; a reader refuses others.
const FORMAT: u32 = 1;

/// How long a replayed entry may wait for the entries it comes after (each is bounded by the
/// gateway's request timeout, 5 s in the scenario, or a gateway restart).
const REPLAY_WAIT: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Its place in the order entries began.
    pub seq: u64,
    /// Who issued it: `client N` or `injector`.
    pub lane: String,
    pub action: Action,
    /// Entries that ended after entry `seq - 1` began and before this one began.
    pub after: Vec<u64>,
    /// `None` while it runs (or when the round stopped before it ended); a violation is
    /// `Some(Err)`.
    pub answer: Option<Result<Answer, String>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Header {
    format: u32,
    config: ChaosConfig,
    violation: Option<String>,
}

#[derive(Default)]
pub(super) struct Journal {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    entries: Vec<Entry>,
    ended_since_last_begin: Vec<u64>,
}

impl Journal {
    /// Journals `action` around its run: begins before `run` is first polled, ends with its
    /// answer.
    pub(super) async fn around(
        &self,
        lane: &str,
        action: Action,
        run: impl Future<Output = Result<Answer, String>>,
    ) -> Result<Answer, String> {
        let seq = self.begin(lane, action);
        let answer = run.await;
        self.end(seq, &answer);
        answer
    }

    /// Journals the beginning of `action`; answers its number.
    fn begin(&self, lane: &str, action: Action) -> u64 {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let seq = inner.entries.len() as u64;
        let after = std::mem::take(&mut inner.ended_since_last_begin);
        inner.entries.push(Entry {
            seq,
            lane: lane.to_string(),
            action,
            after,
            answer: None,
        });
        seq
    }

    fn end(&self, seq: u64, answer: &Result<Answer, String>) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.entries[seq as usize].answer = Some(answer.clone());
        inner.ended_since_last_begin.push(seq);
    }

    pub(super) fn entries(&self) -> Vec<Entry> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entries
            .clone()
    }

    /// Writes the journal to `path` (JSON lines: the header, then the entries).
    pub(super) fn write(
        &self,
        path: &Path,
        config: &ChaosConfig,
        violation: Option<&str>,
    ) -> Result<(), String> {
        let header = Header {
            format: FORMAT,
            config: config.clone(),
            violation: violation.map(str::to_string),
        };
        let mut text = serde_json::to_string(&header).map_err(|e| e.to_string())?;
        text.push('\n');
        for entry in self.entries() {
            text.push_str(&serde_json::to_string(&entry).map_err(|e| e.to_string())?);
            text.push('\n');
        }
        std::fs::write(path, text)
            .map_err(|e| format!("cannot write the journal {}: {e}", path.display()))
    }
}

/// A journal read back: the round's config and its entries in the order they began.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub config: ChaosConfig,
    pub violation: Option<String>,
    pub entries: Vec<Entry>,
}

/// Reads a `journal.jsonl`.
pub fn read_journal(path: &Path) -> Result<Recorded, String> {
    let what = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the journal {what}: {e}"))?;
    let mut lines = text.lines();
    let header: Header = serde_json::from_str(lines.next().unwrap_or(""))
        .map_err(|e| format!("the journal {what} has no valid header line: {e}"))?;
    if header.format != FORMAT {
        return Err(format!(
            "the journal {what} is in format {}, this build reads {FORMAT}",
            header.format
        ));
    }
    let mut entries = Vec::new();
    for (n, line) in lines.enumerate() {
        let entry: Entry = serde_json::from_str(line)
            .map_err(|e| format!("the journal {what}, line {}: {e}", n + 2))?;
        if entry.seq != entries.len() as u64 {
            return Err(format!(
                "the journal {what}, line {}: entry {} out of order (expected {})",
                n + 2,
                entry.seq,
                entries.len()
            ));
        }
        entries.push(entry);
    }
    Ok(Recorded {
        config: header.config,
        violation: header.violation,
        entries,
    })
}

/// What a replay has seen so far.
#[derive(Default)]
struct Progress {
    begun: HashSet<u64>,
    ended: HashSet<u64>,
    /// Recorded entry → the id its create was given in the replay.
    created: HashMap<u64, Uuid>,
}

/// Issues the recorded entries in their order (see the module docs); the first violation
/// ends the replay.
pub(super) async fn replay_entries(h: Arc<Harness>, entries: Vec<Entry>) -> Result<(), String> {
    // Recorded id → the entry whose create was given it, and the copy sent with it (the
    // neighbouring entry with the same action).
    let twin = |seq: u64| {
        [seq.wrapping_sub(1), seq + 1].into_iter().find(|&t| {
            entries
                .get(t as usize)
                .is_some_and(|other| other.action == entries[seq as usize].action)
        })
    };
    let origin: Arc<HashMap<Uuid, (u64, Option<u64>)>> = Arc::new(
        entries
            .iter()
            .filter_map(|e| match &e.answer {
                Some(Ok(Answer {
                    created: Some(id), ..
                })) => Some((*id, (e.seq, twin(e.seq)))),
                _ => None,
            })
            .collect(),
    );
    let progress = Arc::new(Mutex::new(Progress::default()));
    let (changed, _) = watch::channel(());
    let changed = Arc::new(changed);
    let tasks: Vec<_> = entries
        .into_iter()
        .map(|entry| {
            let (h, origin, progress, changed) = (
                Arc::clone(&h),
                Arc::clone(&origin),
                Arc::clone(&progress),
                Arc::clone(&changed),
            );
            tokio::spawn(async move { replay_one(&h, &origin, &progress, &changed, entry).await })
        })
        .collect();
    let mut first_error = None;
    for task in tasks {
        let result = task
            .await
            .map_err(|e| format!("a replayed entry panicked: {e}"))
            .and_then(|r| r);
        if let Err(e) = result {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

async fn replay_one(
    h: &Harness,
    origin: &HashMap<Uuid, (u64, Option<u64>)>,
    progress: &Mutex<Progress>,
    changed: &watch::Sender<()>,
    entry: Entry,
) -> Result<(), String> {
    let ready = |p: &Progress| {
        (entry.seq == 0 || p.begun.contains(&(entry.seq - 1)))
            && entry.after.iter().all(|j| p.ended.contains(j))
    };
    let mut wake = changed.subscribe();
    let deadline = tokio::time::Instant::now() + REPLAY_WAIT;
    loop {
        wake.borrow_and_update();
        if ready(&progress.lock().unwrap_or_else(|p| p.into_inner())) {
            break;
        }
        if tokio::time::timeout_at(deadline, wake.changed())
            .await
            .is_err()
        {
            return Err(format!(
                "replay: entry {} ({:?}) still waited for entry {} to begin and {:?} to end after {REPLAY_WAIT:?}",
                entry.seq,
                entry.action,
                entry.seq.saturating_sub(1),
                entry.after
            ));
        }
    }
    // Journaled as begun under the progress lock, so that the replay's own journal keeps the
    // recorded order too.
    let (action, seq) = {
        let mut p = progress.lock().unwrap_or_else(|p| p.into_inner());
        // Two copies of one create sent at once: either may win, so the id comes from the
        // copy that won in the replay.
        let map = |id: Uuid| {
            origin
                .get(&id)
                .and_then(|(seq, twin)| {
                    p.created
                        .get(seq)
                        .or_else(|| twin.and_then(|t| p.created.get(&t)))
                })
                .copied()
                .unwrap_or(id)
        };
        let action = match &entry.action {
            Action::Op(op) => Action::Op(op.map_id(map)),
            Action::Fault(f) => Action::Fault(f.map_id(map)),
        };
        let seq = h.journal.begin(&entry.lane, action.clone());
        p.begun.insert(entry.seq);
        (action, seq)
    };
    changed.send_replace(());
    let answer = match &action {
        Action::Op(op) => perform(h, op).await,
        Action::Fault(f) => Ok(apply_fault(h, f).await),
    };
    h.journal.end(seq, &answer);
    {
        let mut p = progress.lock().unwrap_or_else(|p| p.into_inner());
        p.ended.insert(entry.seq);
        if let Ok(Answer {
            created: Some(id), ..
        }) = &answer
        {
            p.created.insert(entry.seq, *id);
        }
    }
    changed.send_replace(());
    answer.map(|_| ())
}

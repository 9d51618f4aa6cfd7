//! A sandbox's events, as `kubectl get events` shows them: what its record's changes mean
//! (`transition`), written by the sandbox's actor (the first, `Created`, when a new sandbox's
//! actor starts) to the store as `Kind::Event` records owned by the sandbox (so they
//! survive restarts and are deleted with it), at most `Config::events_per_sandbox` per
//! sandbox (its actor drops the oldest) and `Config::events_max` in all (`sweep`).
//!
//! An event is written after the record change it tells of, by a task of its own (a lifecycle
//! step never waits on it): a gateway killed between the two loses that one event, never the
//! change.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prost::Message;
use sbx_proto::v1::{Event, Phase, Sandbox};
use sbx_storage::{Kind, NewRecord, ObjectStore, Record};
use uuid::Uuid;

use crate::config::Shared;
use crate::records::{now_ms, timestamp};

pub const NORMAL: &str = "Normal";
/// How often the gateway drops events past `Config::events_max`.
pub const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(60);
pub const WARNING: &str = "Warning";

/// What one change of a sandbox's record means: `(type, reason, message)`, or `None` for a
/// change worth no event (a step on the way, a field nobody reads as an event).
pub fn transition(before: &Sandbox, after: &Sandbox) -> Option<(&'static str, String, String)> {
    let (was, now) = (before.phase(), after.phase());
    let same = was == now && before.reason == after.reason && before.message == after.message;
    if same && before.generation == after.generation {
        return None;
    }
    let generation = after.generation;
    let said = |reason: &str| {
        if after.message.is_empty() {
            reason.to_string()
        } else {
            after.message.clone()
        }
    };
    match now {
        Phase::Ready if after.reason == "Adopted" && before.reason != "Adopted" => Some((
            NORMAL,
            "Adopted".into(),
            said("re-attached to the running workload"),
        )),
        Phase::Ready if was == Phase::Error => Some((
            NORMAL,
            "Recovered".into(),
            format!(
                "recovered from Error ({}: {}); running generation {generation}",
                before.reason, before.message
            ),
        )),
        Phase::Ready if was != Phase::Ready && before.reason == "Resuming" => Some((
            NORMAL,
            "Resumed".into(),
            format!("the saved processes run again under generation {generation}"),
        )),
        // Error → Starting: told as `Recovered` once Ready (see `Kept::note`).
        Phase::Ready if was != Phase::Ready => Some((
            NORMAL,
            "Started".into(),
            format!("running generation {generation}"),
        )),
        // Ready → Starting or Provisioning with the wish to run: the driver said the workload
        // was gone or down; the reconciler starts it again.
        Phase::Starting | Phase::Provisioning if was == Phase::Ready => Some((
            WARNING,
            "Restarted".into(),
            format!(
                "the driver no longer ran the workload; the reconciler starts it again under \
                 generation {generation}"
            ),
        )),
        Phase::Stopping if after.reason == "Restarting" && was != Phase::Stopping => Some((
            NORMAL,
            "Restarting".into(),
            "restart asked: stopping the workload to start it again".into(),
        )),
        Phase::Stopped if was != Phase::Stopped => Some((
            NORMAL,
            // Stopped by a deadline: its reason (TtlExpired, Idle).
            if after.reason.is_empty() {
                "Stopped".into()
            } else {
                after.reason.clone()
            },
            said("the workload is stopped; its files are kept"),
        )),
        Phase::Paused if was != Phase::Paused => Some((
            NORMAL,
            "Paused".into(),
            said("the workload's processes and memory are saved; nothing of it runs"),
        )),
        Phase::Completed if was != Phase::Completed => Some((
            NORMAL,
            "Completed".into(),
            said("main process exited with status 0"),
        )),
        Phase::Error if !same => Some((
            WARNING,
            if after.reason.is_empty() {
                "Error".into()
            } else {
                after.reason.clone()
            },
            said("failed"),
        )),
        _ => None,
    }
}

/// The record of an event of `sandbox` (whose record is `owner`).
fn new_event_record(sandbox: &Sandbox, kind: &str, reason: &str, message: &str) -> NewRecord {
    let id = Uuid::new_v4();
    let at = stamp();
    let workspace = Uuid::parse_str(&sandbox.workspace_id).ok();
    let owner = Uuid::parse_str(&sandbox.id).ok();
    let event = Event {
        id: id.to_string(),
        workspace_id: sandbox.workspace_id.clone(),
        sandbox_id: sandbox.id.clone(),
        sandbox_name: sandbox.name.clone(),
        time: Some(timestamp(at)),
        r#type: kind.to_string(),
        reason: reason.to_string(),
        // A message is a sentence, not a document: at most 1 KiB of it is kept.
        message: truncate(message, 1024),
        generation: sandbox.generation,
    };
    NewRecord {
        id,
        kind: Kind::Event,
        workspace,
        // Unique per sandbox: its time and the event's own id.
        name: format!("e{at}-{}", &id.simple().to_string()[..12]),
        owner,
        labels: Default::default(),
        created_at_ms: at,
        body: event.encode_to_vec(),
    }
}

fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// An event as its record holds it.
pub fn decode(record: &Record) -> Option<Event> {
    Event::decode(record.body.as_slice()).ok()
}

/// The events a sandbox actor keeps count of: its own, oldest first, by id; and
/// the Error a start under way recovers from (its reason and message).
#[derive(Debug, Default)]
pub struct Kept {
    ids: VecDeque<Uuid>,
    from_error: Option<(String, String)>,
    /// When the last `NetworkDenied` was written (they are rate-limited).
    last_denied: Option<std::time::Instant>,
    /// When the last `BudgetRefused` was written (rate-limited alike).
    last_refused: Option<std::time::Instant>,
}

/// At most one `NetworkDenied` event per sandbox this often.
pub const DENIALS_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

impl Kept {
    /// Whether the sandbox has no events (in the store when its actor started, or since).
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The `NetworkDenied` event of a sandbox whose refused connection attempts went from
    /// `before` to `now` (counted over the driver's last ten minutes), the latest refused
    /// being `last`; at most one per [`DENIALS_EVERY`].
    /// The `BudgetRefused` event of a sandbox whose refusals of what the host shares went
    /// from `before` to `now`; at most one per [`DENIALS_EVERY`], naming what grew.
    pub fn note_refusals(
        &mut self,
        before: Option<&sbx_proto::v1::BudgetRefusals>,
        now: Option<&sbx_proto::v1::BudgetRefusals>,
    ) -> Option<(&'static str, String, String)> {
        let zero = sbx_proto::v1::BudgetRefusals::default();
        let (before, now) = (before.unwrap_or(&zero), now.unwrap_or(&zero));
        let grew: Vec<String> = [
            (before.ptys, now.ptys, "terminals (its pty budget)"),
            (before.pids, now.pids, "processes (its pids limit)"),
            (
                before.dns_queries,
                now.dns_queries,
                "DNS queries (its resolver budget)",
            ),
            (
                before.connections,
                now.connections,
                "connections (its budget of tracked connections)",
            ),
        ]
        .into_iter()
        .filter(|(b, n, _)| n > b)
        .map(|(_, n, what)| format!("{n} {what}"))
        .collect();
        if grew.is_empty()
            || self
                .last_refused
                .is_some_and(|t| t.elapsed() < DENIALS_EVERY)
        {
            return None;
        }
        self.last_refused = Some(std::time::Instant::now());
        Some((
            WARNING,
            "BudgetRefused".into(),
            format!("the host refused it, past its budgets: {}", grew.join(", ")),
        ))
    }

    pub fn note_denials(
        &mut self,
        before: u64,
        now: u64,
        last: Option<&sbx_proto::v1::NetworkDenial>,
    ) -> Option<(&'static str, String, String)> {
        if now <= before
            || self
                .last_denied
                .is_some_and(|t| t.elapsed() < DENIALS_EVERY)
        {
            return None;
        }
        self.last_denied = Some(std::time::Instant::now());
        let latest = last.map_or(String::new(), |d| {
            let port = if d.port == 0 {
                String::new()
            } else {
                format!(":{}", d.port)
            };
            format!("; the latest to {}{port}/{}", d.destination, d.protocol)
        });
        Some((
            WARNING,
            "NetworkDenied".into(),
            format!(
                "its egress policy refused {now} connection attempts in the last ten minutes{latest}"
            ),
        ))
    }

    /// [`transition`], with what a start from Error recovers from remembered across the
    /// writes on the way (Error → Starting → Ready is one `Recovered`).
    pub fn note(
        &mut self,
        before: &Sandbox,
        after: &Sandbox,
    ) -> Option<(&'static str, String, String)> {
        let (was, now) = (before.phase(), after.phase());
        match now {
            Phase::Starting | Phase::Provisioning if was == Phase::Error => {
                self.from_error = Some((before.reason.clone(), before.message.clone()));
                return None;
            }
            Phase::Starting | Phase::Provisioning => {}
            Phase::Ready if was != Phase::Ready => {
                if let Some((reason, message)) = self.from_error.take() {
                    return Some((
                        NORMAL,
                        "Recovered".into(),
                        format!(
                            "recovered from Error ({reason}: {message}); running generation {}",
                            after.generation
                        ),
                    ));
                }
            }
            _ => self.from_error = None,
        }
        transition(before, after)
    }

    /// The events sandbox `owner` has in the store (read once, when its actor starts).
    pub async fn load(store: &dyn ObjectStore, owner: Uuid) -> Kept {
        let mut ids = VecDeque::new();
        let owned = match store.owned(owner).await {
            Ok(owned) => owned,
            Err(e) => {
                tracing::warn!(sandbox = %owner, "events: cannot read the sandbox's: {e}");
                return Kept::default();
            }
        };
        for id in owned {
            if let Ok(Some(r)) = store.get(id).await
                && r.kind == Kind::Event
            {
                ids.push_back(r.id);
            }
        }
        Kept {
            ids,
            ..Kept::default()
        }
    }
}

/// Writes the event `(kind, reason, message)` of `sandbox`, then drops its oldest beyond
/// `Config::events_per_sandbox`. The event is stamped now; the writes are a task of their own,
/// so a lifecycle step never waits on them (the store batches them with its other writes). A
/// store that refuses is logged, never the actor's failure.
pub fn write(
    shared: &Arc<Shared>,
    kept: &mut Kept,
    sandbox: &Sandbox,
    (kind, reason, message): (&str, &str, &str),
) {
    let bound = shared.config.events_per_sandbox;
    if bound == 0 {
        return;
    }
    let record = new_event_record(sandbox, kind, reason, message);
    kept.ids.push_back(record.id);
    let mut dropped = Vec::new();
    while kept.ids.len() > bound {
        dropped.extend(kept.ids.pop_front());
    }
    let (shared, sandbox_id, reason) = (Arc::clone(shared), sandbox.id.clone(), reason.to_string());
    shared.event_writes.fetch_add(1, Ordering::SeqCst);
    tokio::spawn(async move {
        if let Err(e) = shared.store.create(record).await {
            tracing::warn!(sandbox = %sandbox_id, reason, "event not kept: {e}");
        }
        for id in dropped {
            let dropped = match shared.store.get(id).await {
                Ok(Some(r)) => shared
                    .store
                    .delete(id, r.resource_version)
                    .await
                    .map(|_| ()),
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            };
            if let Err(e) = dropped
                && !matches!(e, sbx_storage::StoreError::NotFound { .. })
            {
                tracing::warn!(sandbox = %sandbox_id, "an old event not dropped: {e}");
            }
        }
        shared.event_writes.fetch_sub(1, Ordering::SeqCst);
    });
}

/// Now, in milliseconds since the epoch, later than every stamp this process gave before: the
/// events' times order them (the store lists by time), even two of one millisecond.
fn stamp() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let mut last = LAST.load(Ordering::Relaxed);
    loop {
        let at = now_ms().max(last + 1);
        match LAST.compare_exchange_weak(last, at, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return at,
            Err(seen) => last = seen,
        }
    }
}

/// Writes the event of a new sandbox (its actor's first, when it has none).
pub fn created(shared: &Arc<Shared>, kept: &mut Kept, sandbox: &Sandbox) {
    let what = match sandbox.spec.as_ref().map(|s| s.image.as_str()) {
        Some(image) if !image.is_empty() => format!("made from image {image}"),
        _ => "made".to_string(),
    };
    write(shared, kept, sandbox, (NORMAL, "Created", &what));
}

/// Drops the oldest events beyond `Config::events_max` in all. Run now and then by the
/// gateway; with several gateways on one store each may run it (a delete that lost the race
/// finds nothing).
pub async fn sweep(shared: &Arc<Shared>) {
    let max = shared.config.events_max;
    let everything = sbx_storage::LabelSelector::everything();
    let all = match crate::scan::all_records(
        &*shared.store,
        Kind::Event,
        sbx_storage::Scope::All,
        &everything,
    )
    .await
    {
        Ok(all) => all,
        Err(e) => {
            tracing::warn!("events: cannot count them: {e}");
            return;
        }
    };
    // Oldest first (the store's order).
    let over = all.len().saturating_sub(max);
    for r in all.into_iter().take(over) {
        if let Err(e) = shared.store.delete(r.id, r.resource_version).await
            && !matches!(e, sbx_storage::StoreError::NotFound { .. })
        {
            tracing::warn!("events: an old one not dropped: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sb(phase: Phase, reason: &str, message: &str, generation: u64) -> Sandbox {
        let mut s = Sandbox {
            reason: reason.into(),
            message: message.into(),
            generation,
            ..Default::default()
        };
        s.set_phase(phase);
        s
    }

    fn reason(before: &Sandbox, after: &Sandbox) -> Option<String> {
        transition(before, after).map(|(_, r, _)| r)
    }

    #[test]
    fn changes_are_told_as_kubectl_tells_them_and_steps_on_the_way_are_not() {
        use Phase as P;
        let ready = sb(P::Ready, "", "", 1);
        assert_eq!(
            reason(&sb(P::Provisioning, "", "", 1), &ready).as_deref(),
            Some("Started")
        );
        assert_eq!(reason(&ready, &ready), None, "no change, no event");
        let oom = sb(P::Error, "OOMKilled", "killed by the memory limit", 1);
        let (kind, r, m) = transition(&ready, &oom).unwrap();
        assert_eq!(
            (kind, r.as_str(), m.as_str()),
            (WARNING, "OOMKilled", "killed by the memory limit")
        );
        let back = sb(P::Ready, "", "", 2);
        let (kind, r, m) = transition(&oom, &back).unwrap();
        assert_eq!((kind, r.as_str()), (NORMAL, "Recovered"));
        assert!(m.contains("OOMKilled") && m.contains("generation 2"), "{m}");
        let adopted = sb(P::Ready, "Adopted", "re-attached under generation 7", 7);
        assert_eq!(reason(&back, &adopted).as_deref(), Some("Adopted"));
        assert_eq!(
            reason(&ready, &sb(P::Starting, "", "", 2)).as_deref(),
            Some("Restarted"),
            "the reconciler starting a vanished workload again"
        );
        assert_eq!(
            reason(&sb(P::Stopped, "", "", 1), &sb(P::Starting, "", "", 2)),
            None
        );
        assert_eq!(
            reason(&ready, &sb(P::Stopping, "Restarting", "", 1)).as_deref(),
            Some("Restarting")
        );
        assert_eq!(reason(&ready, &sb(P::Stopping, "", "", 1)), None);
        assert_eq!(
            reason(&sb(P::Stopping, "", "", 1), &sb(P::Stopped, "", "", 1)).as_deref(),
            Some("Stopped")
        );
        assert_eq!(
            reason(&ready, &sb(P::Error, "DriverUnavailable", "no answer", 1)).as_deref(),
            Some("DriverUnavailable")
        );
        assert_eq!(
            reason(&ready, &sb(P::Completed, "Completed", "", 1)).as_deref(),
            Some("Completed")
        );
        assert_eq!(reason(&ready, &sb(P::Deleting, "", "", 1)), None);
    }

    #[test]
    fn a_start_from_error_is_one_recovered_once_ready() {
        use Phase as P;
        let mut kept = Kept::default();
        let oom = sb(P::Error, "OOMKilled", "killed by the memory limit", 1);
        let starting = sb(P::Starting, "", "", 2);
        let ready = sb(P::Ready, "", "", 2);
        assert_eq!(kept.note(&oom, &starting), None);
        let (kind, r, m) = kept.note(&starting, &ready).unwrap();
        assert_eq!((kind, r.as_str()), (NORMAL, "Recovered"));
        assert!(m.contains("OOMKilled: killed by the memory limit"), "{m}");
        // A plain start afterwards is a start.
        let stopped = sb(P::Stopped, "", "", 2);
        assert_eq!(
            kept.note(&ready, &stopped).map(|e| e.1).as_deref(),
            Some("Stopped")
        );
        assert_eq!(kept.note(&stopped, &sb(P::Starting, "", "", 3)), None);
        let again = kept.note(&sb(P::Starting, "", "", 3), &sb(P::Ready, "", "", 3));
        assert_eq!(again.map(|e| e.1).as_deref(), Some("Started"));
        // A start from Error that fails again is the new Error, and forgets the old one.
        assert_eq!(kept.note(&oom, &starting), None);
        let failed = sb(P::Error, "DriverUnavailable", "no answer", 2);
        assert_eq!(
            kept.note(&starting, &failed).map(|e| e.1).as_deref(),
            Some("DriverUnavailable")
        );
        assert_eq!(
            kept.note(&sb(P::Starting, "", "", 3), &sb(P::Ready, "", "", 3))
                .map(|e| e.1)
                .as_deref(),
            Some("Started")
        );
    }

    #[test]
    fn network_denials_are_an_event_at_most_once_a_minute() {
        let mut kept = Kept::default();
        let last = sbx_proto::v1::NetworkDenial {
            destination: "10.9.8.7".into(),
            protocol: "tcp".into(),
            port: 443,
            packets: 3,
        };
        assert_eq!(kept.note_denials(0, 0, None), None, "nothing refused");
        // Budget refusals: an event naming what grew, then none within the minute.
        let some = sbx_proto::v1::BudgetRefusals {
            ptys: 2,
            dns_queries: 5,
            ..Default::default()
        };
        assert_eq!(kept.note_refusals(None, None), None);
        let (kind, reason, message) = kept.note_refusals(None, Some(&some)).unwrap();
        assert_eq!((kind, reason.as_str()), (WARNING, "BudgetRefused"));
        assert!(message.contains("2 terminals"), "{message}");
        assert!(message.contains("5 DNS queries"), "{message}");
        assert!(!message.contains("processes"), "{message}");
        let more = sbx_proto::v1::BudgetRefusals { ptys: 3, ..some };
        assert_eq!(
            kept.note_refusals(Some(&some), Some(&more)),
            None,
            "rate-limited"
        );
        let (kind, reason, message) = kept.note_denials(0, 3, Some(&last)).unwrap();
        assert_eq!((kind, reason.as_str()), (WARNING, "NetworkDenied"));
        assert!(
            message.contains("refused 3") && message.contains("10.9.8.7:443/tcp"),
            "{message}"
        );
        assert_eq!(
            kept.note_denials(3, 9, Some(&last)),
            None,
            "within the minute"
        );
        kept.last_denied = Some(std::time::Instant::now() - DENIALS_EVERY);
        assert!(kept.note_denials(9, 12, None).is_some(), "a minute later");
        assert_eq!(kept.note_denials(12, 12, None), None, "no new refusal");
    }

    #[test]
    fn an_event_record_is_owned_by_its_sandbox_and_its_message_bounded() {
        let ws = Uuid::new_v4();
        let id = Uuid::new_v4();
        let sandbox = Sandbox {
            id: id.to_string(),
            workspace_id: ws.to_string(),
            name: "web".into(),
            generation: 3,
            ..Default::default()
        };
        let long = "é".repeat(2000);
        let r = new_event_record(&sandbox, WARNING, "OOMKilled", &long);
        assert_eq!(
            (r.kind, r.owner, r.workspace),
            (Kind::Event, Some(id), Some(ws))
        );
        Kind::Event.validate_name(&r.name).unwrap();
        let event = Event::decode(r.body.as_slice()).unwrap();
        assert_eq!((event.reason.as_str(), event.generation), ("OOMKilled", 3));
        assert!(
            event.message.len() <= 1024 + '…'.len_utf8(),
            "{}",
            event.message.len()
        );
        assert!(event.message.ends_with('…'));
    }
}

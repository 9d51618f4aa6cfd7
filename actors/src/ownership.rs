//! Which gateway serves a workspace: a lease in the store, with a fencing token.
//!
//! Gateways that share a store take turns at each workspace: one holds its lease (a
//! `Kind::Lease` record named by the workspace's id) until `expires_at_ms`, renewing it well
//! before; another takes it only once it has expired, and taking it raises the fencing token
//! by one. Every write of a lease is a compare-and-swap on the record's version, so two
//! gateways that race for a free or expired lease cannot both win, and a holder whose renewal
//! lost a race learns it lost. The token is what nodes fence driver calls with
//! (`sbx_drivers::remote::fence`): once the new holder's token has reached a node, the former
//! holder's calls there are refused, so a gateway that was paused past its lease cannot act.
//!
//! Times are the gateways' wall clocks: a lease period (default 10 s) must be well above the
//! clock skew between them. [`hold_leases`] is the loop of a gateway: it claims and renews,
//! serves what it took, and lets go of what it lost or could not renew in time.

use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use sbx_storage::{Kind, NewRecord, ObjectStore, Record, StoreError};
use uuid::Uuid;

use crate::error::{ActorError, Result};

/// A lease's body, as stored.
#[derive(Clone, PartialEq, prost::Message)]
struct LeaseBody {
    /// The holder gateway's id.
    #[prost(string, tag = "1")]
    holder: String,
    /// Raised by one each time another gateway takes the lease.
    #[prost(uint64, tag = "2")]
    token: u64,
    /// Until when (wall clock, ms since 1970) the holder holds it.
    #[prost(uint64, tag = "3")]
    expires_at_ms: u64,
    /// Where the holder serves its API, for requests another gateway cannot serve.
    #[prost(string, tag = "4")]
    holder_address: String,
}

/// A lease this gateway holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub workspace: Uuid,
    pub token: u64,
    pub expires_at_ms: u64,
    record: Record,
}

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This gateway holds the lease (taken, or renewed).
    Held(Held),
    /// Another gateway holds it, until `expires_at_ms`.
    HeldBy {
        holder: Uuid,
        address: String,
        token: u64,
        expires_at_ms: u64,
    },
}

/// One gateway's side of the leases.
pub struct Ownership {
    store: Arc<dyn ObjectStore>,
    gateway: Uuid,
    address: String,
    pub(crate) period: Duration,
}

/// How often a claim goes round after a race it lost to another writer of the same lease.
const RACES: usize = 8;

fn decode(record: &Record) -> Result<(LeaseBody, Uuid)> {
    let body = LeaseBody::decode(record.body.as_slice()).map_err(|e| {
        ActorError::Internal(format!("lease record {} does not decode: {e}", record.id))
    })?;
    let holder = Uuid::parse_str(&body.holder)
        .map_err(|_| ActorError::Internal(format!("lease record {} names no holder", record.id)))?;
    Ok((body, holder))
}

impl Ownership {
    /// Gateway `gateway`, serving at `address`, holding each lease `period` at a time.
    pub fn new(
        store: Arc<dyn ObjectStore>,
        gateway: Uuid,
        address: String,
        period: Duration,
    ) -> Ownership {
        Ownership {
            store,
            gateway,
            address,
            period,
        }
    }

    pub fn gateway(&self) -> Uuid {
        self.gateway
    }

    fn body(&self, token: u64, now_ms: u64) -> LeaseBody {
        LeaseBody {
            holder: self.gateway.to_string(),
            token,
            expires_at_ms: now_ms + self.period.as_millis() as u64,
            holder_address: self.address.clone(),
        }
    }

    /// Takes the lease of `workspace` if it is free or expired, renews it if this gateway
    /// holds it, or says who holds it. `now_ms`: the wall clock.
    pub async fn claim(&self, workspace: Uuid, now_ms: u64) -> Result<Claim> {
        let name = workspace.to_string();
        for _ in 0..RACES {
            let Some(record) = self.store.get_by_name(Kind::Lease, None, &name).await? else {
                let body = self.body(1, now_ms);
                let new = NewRecord {
                    id: Uuid::new_v4(),
                    kind: Kind::Lease,
                    workspace: None,
                    name: name.clone(),
                    owner: None,
                    labels: Default::default(),
                    created_at_ms: now_ms,
                    body: body.encode_to_vec(),
                };
                match self.store.create(new).await {
                    Ok(record) => {
                        return Ok(Claim::Held(Held {
                            workspace,
                            token: 1,
                            expires_at_ms: body.expires_at_ms,
                            record,
                        }));
                    }
                    // Another gateway made it first: look again.
                    Err(StoreError::AlreadyExists { .. }) => continue,
                    Err(e) => return Err(e.into()),
                }
            };
            let (stored, holder) = decode(&record)?;
            let token = if holder == self.gateway {
                stored.token
            } else if stored.expires_at_ms <= now_ms {
                stored.token + 1
            } else {
                return Ok(Claim::HeldBy {
                    holder,
                    address: stored.holder_address,
                    token: stored.token,
                    expires_at_ms: stored.expires_at_ms,
                });
            };
            let body = self.body(token, now_ms);
            let mut update = record.clone();
            update.body = body.encode_to_vec();
            update.updated_at_ms = now_ms;
            match self.store.update(update).await {
                Ok(record) => {
                    return Ok(Claim::Held(Held {
                        workspace,
                        token,
                        expires_at_ms: body.expires_at_ms,
                        record,
                    }));
                }
                // Somebody wrote it since we read it (a renewal, a takeover): look again.
                Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ActorError::Unavailable(format!(
            "the lease of workspace {workspace} kept changing under {RACES} claims"
        )))
    }

    /// Lets go of a held lease at once (a clean shutdown): it stays this gateway's token,
    /// expired, so the next claim by any gateway takes it (with the next token) without
    /// waiting out the period. False when it was no longer this gateway's to let go.
    pub async fn release(&self, held: &Held, now_ms: u64) -> Result<bool> {
        let (mut body, holder) = decode(&held.record)?;
        if holder != self.gateway {
            return Ok(false);
        }
        body.expires_at_ms = now_ms.saturating_sub(1);
        let mut update = held.record.clone();
        update.body = body.encode_to_vec();
        update.updated_at_ms = now_ms;
        match self.store.update(update).await {
            Ok(_) => Ok(true),
            Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}

/// Who holds the lease of `workspace` (its gateway id and address), if anyone does and it has
/// not expired.
/// Until when (this process's monotonic clock) a gateway may act under `lease`: its expiry
/// less `margin_ms`, the same margin the lease loop lets a lease go at.
pub fn valid_until(lease: &Held, margin_ms: u64) -> std::time::Instant {
    let left = lease
        .expires_at_ms
        .saturating_sub(crate::records::now_ms().saturating_add(margin_ms));
    std::time::Instant::now() + Duration::from_millis(left)
}

pub async fn holder_of(store: &dyn ObjectStore, workspace: Uuid) -> Result<Option<(Uuid, String)>> {
    let Some(record) = store
        .get_by_name(Kind::Lease, None, &workspace.to_string())
        .await?
    else {
        return Ok(None);
    };
    let (body, holder) = decode(&record)?;
    Ok((body.expires_at_ms > crate::records::now_ms()).then_some((holder, body.holder_address)))
}

/// The lease loop of a gateway sharing its store, every third of the lease period:
/// 1. it lets go of every workspace whose lease it could not renew in time (so that a gateway
///    that was paused or cut off stops acting before, or as soon as, another can take over),
///    and gives back the leases it let go of last round to spread the load;
/// 2. it renews its membership: a lease named by its own id, by which the others count the
///    live gateways;
/// 3. it renews what it holds and takes free or expired leases while it holds fewer than its
///    share (the workspaces divided by the live gateways, rounded up): one it takes is served
///    (`RootMsg::Hold`, its token set for the calls to nodes), one another gateway holds is
///    let go (`RootMsg::LetGo`);
/// 4. holding more than its share while other gateways live, it lets the excess go: their
///    actors stop now, their leases are given back next round, and the others take them.
pub async fn hold_leases(
    ownership: Arc<Ownership>,
    store: Arc<dyn ObjectStore>,
    nodes: Arc<crate::nodes::Nodes>,
    root: ractor::ActorRef<crate::protocol::RootMsg>,
    first_round: tokio::sync::oneshot::Sender<()>,
) {
    let mut first_round = Some(first_round);
    use std::collections::{BTreeMap, HashSet};

    use crate::protocol::RootMsg;
    let every = ownership.period / 3;
    let me = ownership.gateway;
    let mut held: BTreeMap<Uuid, Held> = BTreeMap::new();
    // Let go of last round to spread the load: given back this round.
    let mut giving_back: Vec<Held> = Vec::new();
    let let_go = |held: &mut BTreeMap<Uuid, Held>, ws: Uuid, why: &str| -> Option<Held> {
        let lease = held.remove(&ws)?;
        tracing::warn!(workspace = %ws, "letting the workspace go: {why}");
        nodes.set_fence(ws, None);
        let _ = root.cast(RootMsg::LetGo(ws));
        Some(lease)
    };
    loop {
        let now = crate::records::now_ms();
        let margin = every.as_millis() as u64;
        let late: Vec<Uuid> = held
            .iter()
            .filter(|(_, lease)| lease.expires_at_ms <= now + margin)
            .map(|(ws, _)| *ws)
            .collect();
        for ws in late {
            let_go(&mut held, ws, "its lease could not be renewed in time");
        }
        // A node refused a call under its token (a sandbox actor said so): a newer holder
        // exists. Let it go, and give the lease back in case it is still this gateway's.
        let overtaken: Vec<Uuid> = held
            .keys()
            .filter(|ws| nodes.fence_of(**ws).is_none())
            .copied()
            .collect();
        for ws in overtaken {
            if let Some(lease) = let_go(&mut held, ws, "a node refused its token") {
                giving_back.push(lease);
            }
        }
        for lease in giving_back.drain(..) {
            if let Err(e) = ownership.release(&lease, now).await {
                tracing::warn!(workspace = %lease.workspace, "cannot give the lease back: {e}");
            }
        }
        if let Err(e) = ownership.claim(me, now).await {
            tracing::warn!("cannot renew this gateway's membership: {e}");
        }
        let listed = async {
            let everything = sbx_storage::LabelSelector::everything();
            let scope = sbx_storage::Scope::All;
            let workspaces =
                crate::scan::all_records(&*store, Kind::Workspace, scope, &everything).await?;
            let leases = crate::scan::all_records(&*store, Kind::Lease, scope, &everything).await?;
            Ok::<_, ActorError>((workspaces, leases))
        };
        let (workspaces, leases) = match listed.await {
            Ok(listed) => listed,
            Err(e) => {
                tracing::warn!("cannot list the workspaces and leases: {e}");
                tokio::time::sleep(every).await;
                continue;
            }
        };
        let now = crate::records::now_ms();
        let mut holders: BTreeMap<String, (Uuid, u64)> = BTreeMap::new();
        let mut live: HashSet<Uuid> = HashSet::from([me]);
        for record in &leases {
            if let Ok((body, holder)) = decode(record) {
                if record.name == holder.to_string() && body.expires_at_ms > now {
                    live.insert(holder);
                }
                holders.insert(record.name.clone(), (holder, body.expires_at_ms));
            }
        }
        let share = workspaces.len().div_ceil(live.len());
        for ws in workspaces.iter().map(|r| r.id) {
            let mine = held.contains_key(&ws);
            let taken_by_another = holders
                .get(&ws.to_string())
                .is_some_and(|(holder, ends)| *holder != me && *ends > now);
            if taken_by_another {
                let_go(&mut held, ws, "another gateway holds its lease");
                continue;
            }
            if !mine && held.len() >= share {
                continue;
            }
            match ownership.claim(ws, crate::records::now_ms()).await {
                Ok(Claim::Held(lease)) => {
                    let token = lease.token;
                    let until = valid_until(&lease, margin);
                    if held.insert(ws, lease).is_none() {
                        nodes.set_fence(ws, Some(token));
                        nodes.hold_until(ws, until);
                        let _ = root.cast(RootMsg::Hold(ws));
                    } else {
                        nodes.hold_until(ws, until);
                    }
                }
                Ok(Claim::HeldBy { holder, .. }) => {
                    let_go(&mut held, ws, &format!("gateway {holder} holds its lease"));
                }
                Err(e) => {
                    tracing::warn!(workspace = %ws, "cannot claim the workspace's lease: {e}")
                }
            }
        }
        if live.len() > 1 && held.len() > share {
            let excess: Vec<Uuid> = held
                .keys()
                .rev()
                .take(held.len() - share)
                .copied()
                .collect();
            for ws in excess {
                if let Some(lease) = let_go(&mut held, ws, "spreading the workspaces") {
                    giving_back.push(lease);
                }
            }
        }
        if let Some(done) = first_round.take() {
            // The root handles messages in order: once it answers this, it has spawned the
            // supervisor of every workspace taken in this round.
            let _ = root
                .call(RootMsg::Reconciler, Some(Duration::from_secs(10)))
                .await;
            let _ = done.send(());
        }
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gateways(n: usize) -> (tempfile::TempDir, Vec<Arc<Ownership>>) {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn ObjectStore> =
            Arc::new(sbx_storage::SledStore::open(&dir.path().join("store")).unwrap());
        let all = (0..n)
            .map(|i| {
                Arc::new(Ownership::new(
                    Arc::clone(&store),
                    Uuid::new_v4(),
                    format!("127.0.0.1:{}", 7000 + i),
                    Duration::from_secs(10),
                ))
            })
            .collect();
        (dir, all)
    }

    fn held(claim: Claim) -> Held {
        match claim {
            Claim::Held(h) => h,
            other => panic!("not held: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_lease_is_held_renewed_taken_after_expiry_with_a_higher_token_and_released() {
        let (_dir, g) = gateways(2);
        let ws = Uuid::new_v4();
        let t0 = 1_000_000;
        let a = held(g[0].claim(ws, t0).await.unwrap());
        assert_eq!((a.token, a.expires_at_ms), (1, t0 + 10_000));
        // B sees A's, with A's address, until it expires.
        match g[1].claim(ws, t0 + 5_000).await.unwrap() {
            Claim::HeldBy {
                holder,
                address,
                token,
                ..
            } => {
                assert_eq!(holder, g[0].gateway());
                assert_eq!(address, "127.0.0.1:7000");
                assert_eq!(token, 1);
            }
            other => panic!("{other:?}"),
        }
        // A renews: same token, later expiry.
        let a = held(g[0].claim(ws, t0 + 5_000).await.unwrap());
        assert_eq!((a.token, a.expires_at_ms), (1, t0 + 15_000));
        // A stops renewing; past the expiry B takes it, one token up.
        let b = held(g[1].claim(ws, t0 + 15_000).await.unwrap());
        assert_eq!(b.token, 2);
        // A, back, finds it taken: it has lost the workspace.
        assert!(matches!(
            g[0].claim(ws, t0 + 15_001).await.unwrap(),
            Claim::HeldBy { token: 2, .. }
        ));
        // A release of what A no longer holds does nothing.
        assert!(!g[0].release(&a, t0 + 15_002).await.unwrap());
        // B lets go: A takes it at once, token 3.
        assert!(g[1].release(&b, t0 + 16_000).await.unwrap());
        let a = held(g[0].claim(ws, t0 + 16_001).await.unwrap());
        assert_eq!(a.token, 3);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn of_gateways_racing_for_a_lease_exactly_one_wins_each_round() {
        let (_dir, g) = gateways(8);
        let ws = Uuid::new_v4();
        let mut last: Option<(usize, u64)> = None;
        for round in 0..5u64 {
            // Each round starts past the previous holder's expiry.
            let now = 1_000_000 + round * 20_000;
            let claims = futures::future::join_all(
                g.iter()
                    .map(|o| {
                        let o = Arc::clone(o);
                        tokio::spawn(async move { o.claim(ws, now).await.unwrap() })
                    })
                    .collect::<Vec<_>>(),
            )
            .await;
            let winners: Vec<(usize, Held)> = claims
                .into_iter()
                .map(|c| c.unwrap())
                .enumerate()
                .filter_map(|(i, c)| match c {
                    Claim::Held(h) => Some((i, h)),
                    Claim::HeldBy { .. } => None,
                })
                .collect();
            assert_eq!(winners.len(), 1, "round {round}: {winners:?}");
            let (who, won) = &winners[0];
            // One token up for a new holder; the same for the holder that renews its own
            // (expired, untaken) lease.
            let want = match last {
                None => 1,
                Some((prev, token)) if prev == *who => token,
                Some((_, token)) => token + 1,
            };
            assert_eq!(won.token, want, "round {round}");
            last = Some((*who, won.token));
        }
    }
}

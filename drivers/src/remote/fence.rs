//! Fencing: a node refuses driver calls from a gateway that no longer holds the workspace.
//!
//! Gateways that share a store take turns at each workspace under a lease whose fencing token
//! grows with every new holder. Every driver call a gateway makes for a workspace carries
//! `sbx-fence: <workspace id>/<token>` ([`FENCE_HEADER`]); the node keeps, per workspace, the
//! highest token it has seen, on its disk (`STATE_DIR/fences/<workspace id>`, written and
//! synced before the call that raised it runs), and refuses a call with a lower one. So a gateway that was paused or cut off past its
//! lease cannot act on a sandbox once a newer holder has reached the node — not even after
//! the node restarts. A call without the header (one gateway, no leases) is not fenced. The
//! refusal is the driver contract's `FailedPrecondition`, its message starting `fenced:`.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tonic::Status;
use tonic::metadata::MetadataMap;
use uuid::Uuid;

/// The request header a fenced call carries.
pub const FENCE_HEADER: &str = "sbx-fence";

/// The header naming the gateway a fenced call comes from (its id), beside [`FENCE_HEADER`].
pub const FENCE_HOLDER_HEADER: &str = "sbx-fence-holder";

/// `<workspace id>/<token>`, the header's value.
pub fn fence_value(workspace: Uuid, token: u64) -> String {
    format!("{workspace}/{token}")
}

/// The workspace and token of a header value; `None` when malformed.
pub fn parse_fence(value: &str) -> Option<(Uuid, u64)> {
    let (ws, token) = value.split_once('/')?;
    Some((Uuid::parse_str(ws).ok()?, token.parse().ok()?))
}

/// The highest token seen per workspace, kept in a directory.
#[derive(Debug)]
pub struct Fences {
    dir: PathBuf,
    highest: Mutex<HashMap<Uuid, u64>>,
    refused: AtomicU64,
    /// Per workspace, the newest token admitted and the gateway that called under it.
    holders: Mutex<HashMap<Uuid, (u64, Uuid)>>,
    /// Calls admitted under a workspace's token from a gateway other than the first that
    /// called under it: what leases must never allow.
    conflicts: AtomicU64,
}

impl Fences {
    /// The fences kept in `dir` (made if missing): every file read now. A malformed file is
    /// an error naming it, never taken as token 0 (that would unfence its workspace).
    pub fn open(dir: &Path) -> std::io::Result<Arc<Fences>> {
        std::fs::create_dir_all(dir)?;
        let mut highest = HashMap::new();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().to_string();
            if name.ends_with(".tmp") {
                continue;
            }
            let bad = |why: &str| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("fence file {}: {why}", entry.path().display()),
                )
            };
            let ws = Uuid::parse_str(&name).map_err(|_| bad("not named by a workspace id"))?;
            let text = std::fs::read_to_string(entry.path())?;
            let token = text.trim().parse().map_err(|_| bad("not a token"))?;
            highest.insert(ws, token);
        }
        Ok(Arc::new(Fences {
            dir: dir.to_path_buf(),
            highest: Mutex::new(highest),
            refused: AtomicU64::new(0),
            holders: Mutex::new(HashMap::new()),
            conflicts: AtomicU64::new(0),
        }))
    }

    /// How many calls were refused since the node started.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// How many admitted calls came under a token another gateway had called under first,
    /// since the node started (0 unless two gateways held one lease at once).
    pub fn conflicts(&self) -> u64 {
        self.conflicts.load(Ordering::Relaxed)
    }

    /// Notes that `gateway` called for `workspace` under `token` (admitted).
    fn note_holder(&self, workspace: Uuid, token: u64, gateway: Uuid) {
        // Token 0: calls of gateways that never held the workspace; no holder to conflict.
        if token == 0 {
            return;
        }
        let mut holders = self.holders.lock().unwrap_or_else(|p| p.into_inner());
        match holders.get(&workspace) {
            Some((seen, first)) if *seen == token && *first != gateway => {
                self.conflicts.fetch_add(1, Ordering::Relaxed);
                tracing::error!(%workspace, token, first = %first, second = %gateway, "two gateways called under one fencing token");
            }
            Some((seen, _)) if *seen >= token => {}
            _ => {
                holders.insert(workspace, (token, gateway));
            }
        }
    }

    /// The highest token seen for `workspace`.
    pub fn highest(&self, workspace: Uuid) -> Option<u64> {
        self.highest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&workspace)
            .copied()
    }

    /// Admits a call of `workspace` under `token`, or refuses it. A higher token is on disk
    /// before the call is admitted.
    pub fn admit(&self, workspace: Uuid, token: u64) -> Result<(), Status> {
        let mut highest = self.highest.lock().unwrap_or_else(|p| p.into_inner());
        let seen = highest.get(&workspace).copied().unwrap_or(0);
        if token < seen {
            self.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%workspace, token, highest = seen, "refused a call from a former holder");
            return Err(fenced(workspace, token, seen));
        }
        if token > seen {
            self.persist(workspace, token).map_err(|e| {
                Status::unavailable(format!(
                    "the node cannot record the fence of {workspace}: {e}"
                ))
            })?;
            highest.insert(workspace, token);
        }
        Ok(())
    }

    fn persist(&self, workspace: Uuid, token: u64) -> std::io::Result<()> {
        let path = self.dir.join(workspace.to_string());
        let tmp = self.dir.join(format!("{workspace}.tmp"));
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(format!("{token}\n").as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(&self.dir)?.sync_all()
    }

    /// The check of one request's metadata: admitted without the header; refused (a
    /// `FailedPrecondition` saying `fenced:`) under an old token; `INVALID_ARGUMENT` for a
    /// malformed header.
    pub fn check(&self, metadata: &MetadataMap) -> Result<(), Status> {
        let Some(value) = metadata.get(FENCE_HEADER) else {
            return Ok(());
        };
        let text = value
            .to_str()
            .map_err(|_| Status::invalid_argument("the sbx-fence header is not text"))?;
        let (workspace, token) = parse_fence(text).ok_or_else(|| {
            Status::invalid_argument(format!(
                "the sbx-fence header {text:?} is not WORKSPACE_ID/TOKEN"
            ))
        })?;
        let holder = match metadata.get(FENCE_HOLDER_HEADER) {
            None => None,
            Some(value) => Some(
                value
                    .to_str()
                    .ok()
                    .and_then(|v| Uuid::parse_str(v).ok())
                    .ok_or_else(|| {
                        Status::invalid_argument("the sbx-fence-holder header is not a gateway id")
                    })?,
            ),
        };
        self.admit(workspace, token)?;
        if let Some(holder) = holder {
            self.note_holder(workspace, token, holder);
        }
        Ok(())
    }
}

fn fenced(workspace: Uuid, token: u64, highest: u64) -> Status {
    let message = format!(
        "fenced: the calls of workspace {workspace} come under token {highest} now, this one \
         under {token} (another gateway holds the workspace)"
    );
    super::status::driver_error_to_status(&crate::DriverError::FailedPrecondition(message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_token_is_refused_and_the_newest_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let ws = Uuid::new_v4();
        let other = Uuid::new_v4();
        let fences = Fences::open(dir.path()).unwrap();
        fences.admit(ws, 1).unwrap();
        fences.admit(ws, 1).unwrap();
        fences.admit(ws, 3).unwrap();
        let err = fences.admit(ws, 2).unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        assert!(err.message().contains("under token 3"), "{}", err.message());
        assert_eq!(fences.refused(), 1);
        // Another workspace has its own fence.
        fences.admit(other, 1).unwrap();
        drop(fences);
        let again = Fences::open(dir.path()).unwrap();
        assert_eq!(again.highest(ws), Some(3));
        assert!(again.admit(ws, 2).is_err());
        again.admit(ws, 4).unwrap();
        assert_eq!(again.highest(other), Some(1));
    }

    #[test]
    fn headers_are_checked_and_a_malformed_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let fences = Fences::open(dir.path()).unwrap();
        let ws = Uuid::new_v4();
        let mut md = MetadataMap::new();
        assert!(fences.check(&md).is_ok(), "no header: not fenced");
        md.insert(FENCE_HEADER, fence_value(ws, 5).parse().unwrap());
        assert!(fences.check(&md).is_ok());
        md.insert(FENCE_HEADER, fence_value(ws, 4).parse().unwrap());
        assert_eq!(
            fences.check(&md).unwrap_err().code(),
            tonic::Code::FailedPrecondition
        );
        // Two gateways under one token: admitted (the node cannot tell which is right) but
        // counted; a newer token from another gateway is no conflict.
        let (g1, g2) = (Uuid::new_v4(), Uuid::new_v4());
        md.insert(FENCE_HEADER, fence_value(ws, 6).parse().unwrap());
        md.insert(FENCE_HOLDER_HEADER, g1.to_string().parse().unwrap());
        fences.check(&md).unwrap();
        fences.check(&md).unwrap();
        assert_eq!(fences.conflicts(), 0);
        md.insert(FENCE_HOLDER_HEADER, g2.to_string().parse().unwrap());
        fences.check(&md).unwrap();
        assert_eq!(fences.conflicts(), 1);
        md.insert(FENCE_HEADER, fence_value(ws, 7).parse().unwrap());
        fences.check(&md).unwrap();
        assert_eq!(fences.conflicts(), 1);
        md.insert(FENCE_HOLDER_HEADER, "nonsense".parse().unwrap());
        assert_eq!(
            fences.check(&md).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        md.remove(FENCE_HOLDER_HEADER);
        md.insert(FENCE_HEADER, "nonsense".parse().unwrap());
        assert_eq!(
            fences.check(&md).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        std::fs::write(dir.path().join(Uuid::new_v4().to_string()), "x\n").unwrap();
        let err = Fences::open(dir.path()).unwrap_err();
        assert!(err.to_string().contains("not a token"), "{err}");
    }
}

//! Watching a directory in a sandbox for the E2B SDK's `files.watch_dir`: `WatchDir` (a
//! stream, the async SDK's) and `CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher` (the sync
//! SDK's).
//!
//! There is no inotify on this side of the wall: nothing new listens inside a sandbox. A
//! watcher compares listings of the directory instead — each a script of the sandbox's own
//! `find` and `stat`, run as an exec, as the other file calls are — and reports what changed
//! between two: a name that appeared (`CREATE`, and `WRITE` too for a file with content),
//! went (`REMOVE`), or whose file changed size or modification second (`WRITE`). So a rename is a `REMOVE` and a `CREATE`, changes that
//! cancel out between two listings are not seen, and a write that keeps a file's size within
//! the same second is not either. `GetWatcherEvents` lists at each call; `WatchDir` lists
//! every [`POLL`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use hyper::{Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use uuid::Uuid;

use super::connect::{async_stream, code_of, connect_error, frame, stream_error, stream_response};
use super::files::{FACTS, refused, script};
use super::{Body, E2b};

/// How often a `WatchDir` stream lists its directory.
pub const POLL: Duration = Duration::from_millis(500);

/// The most watchers one sandbox holds at once (`CreateWatcher`).
const MAX_PER_SANDBOX: usize = 32;

/// How deep a recursive watch looks.
const MAX_DEPTH: u32 = 64;

/// A listing: each entry's name under the watched directory, and its kind, size and mtime.
type Listing = BTreeMap<String, (String, String, String)>;

/// The sync SDK's watchers, by id.
#[derive(Default)]
pub struct Watchers {
    inner: Mutex<HashMap<String, Watch>>,
}

#[derive(Clone)]
struct Watch {
    sandbox: Uuid,
    path: String,
    depth: u32,
    seen: Listing,
}

/// Lists `path` (at most `depth` deep) in the sandbox: the directory's absolute path, and
/// its listing; or the refusal to answer.
async fn list(
    e2b: &E2b,
    uuid: Uuid,
    path: &str,
    depth: u32,
) -> Result<(String, Listing), Response<Body>> {
    const BODY: &str = r#"[ -e "$p" ] || exit 44; [ -d "$p" ] || exit 45
printf '%s\n' "$p"
find "$p" -mindepth 1 -maxdepth "$2" | while IFS= read -r f; do printf '%s|' "$f"; stat -c '%F|%s|%Y' -- "$f"; done"#;
    let ran = script(
        e2b,
        uuid,
        "",
        BODY,
        &[path, &depth.to_string()],
        None,
        FACTS,
    )
    .await
    .map_err(|e| connect_error(code_of(&e), e.to_string()))?;
    if ran.code != 0 {
        return Err(refused(&ran, path));
    }
    let text = String::from_utf8_lossy(&ran.stdout);
    let mut lines = text.lines();
    let root = lines
        .next()
        .unwrap_or_default()
        .trim_end_matches('/')
        .to_string();
    Ok((root.clone(), parse(&root, lines)))
}

/// The lines `PATH|KIND|SIZE|MTIME` as a listing by name under `root` (split from the right:
/// a name may hold `|`).
fn parse<'a>(root: &str, lines: impl Iterator<Item = &'a str>) -> Listing {
    let prefix = format!("{root}/");
    lines
        .filter_map(|line| {
            let mut fields: Vec<&str> = line.rsplitn(4, '|').collect();
            if fields.len() != 4 {
                return None;
            }
            fields.reverse();
            let name = fields[0].strip_prefix(&prefix)?;
            Some((
                name.to_string(),
                (
                    fields[1].to_string(),
                    fields[2].to_string(),
                    fields[3].to_string(),
                ),
            ))
        })
        .collect()
}

/// What changed from `before` to `after`, in E2B's `FilesystemEvent` form, by name.
fn changes(before: &Listing, after: &Listing) -> Vec<Value> {
    let event = |name: &str, kind: &str| json!({"name": name, "type": kind});
    let mut out = Vec::new();
    for (name, was) in before {
        match after.get(name) {
            None => out.push(event(name, "EVENT_TYPE_REMOVE")),
            Some(now) if now.0 != was.0 => {
                out.push(event(name, "EVENT_TYPE_REMOVE"));
                out.push(event(name, "EVENT_TYPE_CREATE"));
            }
            // A directory's own size and time move with its entries: those are reported.
            Some(now) if now != was && now.0 != "directory" => {
                out.push(event(name, "EVENT_TYPE_WRITE"))
            }
            Some(_) => {}
        }
    }
    for (name, now) in after.iter().filter(|(n, _)| !before.contains_key(*n)) {
        out.push(event(name, "EVENT_TYPE_CREATE"));
        // A file that came with content was written too (inotify says both).
        if now.0 == "regular file" {
            out.push(event(name, "EVENT_TYPE_WRITE"));
        }
    }
    out
}

fn depth_of(message: &Value) -> u32 {
    if message["recursive"].as_bool().unwrap_or(false) {
        MAX_DEPTH
    } else {
        1
    }
}

/// `CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher`.
pub async fn unary(e2b: &E2b, uuid: Uuid, rpc: &str, message: &Value) -> Response<Body> {
    let ok = |v: Value| super::json_response(StatusCode::OK, &v);
    match rpc {
        "/filesystem.Filesystem/CreateWatcher" => {
            let path = message["path"].as_str().unwrap_or("").to_string();
            if path.is_empty() {
                return connect_error("invalid_argument", "a path is required");
            }
            let held = locked(e2b).values().filter(|w| w.sandbox == uuid).count();
            if held >= MAX_PER_SANDBOX {
                return connect_error(
                    "resource_exhausted",
                    format!("this sandbox holds {held} watchers already: remove one first"),
                );
            }
            let depth = depth_of(message);
            let (root, seen) = match list(e2b, uuid, &path, depth).await {
                Ok(l) => l,
                Err(refusal) => return refusal,
            };
            let id = Uuid::new_v4().to_string();
            locked(e2b).insert(
                id.clone(),
                Watch {
                    sandbox: uuid,
                    path: root,
                    depth,
                    seen,
                },
            );
            ok(json!({"watcherId": id}))
        }
        "/filesystem.Filesystem/GetWatcherEvents" => {
            let id = message["watcherId"].as_str().unwrap_or("");
            let Some(watch) = locked(e2b).get(id).filter(|w| w.sandbox == uuid).cloned() else {
                return connect_error("not_found", format!("no watcher {id:?} in this sandbox"));
            };
            let (_, now) = match list(e2b, uuid, &watch.path, watch.depth).await {
                Ok(l) => l,
                Err(refusal) => {
                    locked(e2b).remove(id);
                    return refusal;
                }
            };
            let events = changes(&watch.seen, &now);
            if let Some(w) = locked(e2b).get_mut(id) {
                w.seen = now;
            }
            ok(json!({"events": events}))
        }
        _ => {
            let id = message["watcherId"].as_str().unwrap_or("");
            let mut watchers = locked(e2b);
            match watchers.get(id) {
                Some(w) if w.sandbox == uuid => {
                    watchers.remove(id);
                    ok(json!({}))
                }
                _ => connect_error("not_found", format!("no watcher {id:?} in this sandbox")),
            }
        }
    }
}

fn locked(e2b: &E2b) -> std::sync::MutexGuard<'_, HashMap<String, Watch>> {
    sbx_drivers::locked(&e2b.watchers.inner)
}

/// `WatchDir` (its events are the response's own oneof: `start`, `filesystem`, `keepalive`):
/// a `start` event once the directory is listed, then each change as it is seen,
/// keepalives at `keepalive`; ends with an error when the directory or the sandbox goes, and
/// when the client leaves.
pub async fn stream(
    e2b: &E2b,
    uuid: Uuid,
    message: &Value,
    keepalive: Option<Duration>,
) -> Response<Body> {
    let path = message["path"].as_str().unwrap_or("").to_string();
    if path.is_empty() {
        return stream_error("invalid_argument", "a path is required");
    }
    let depth = depth_of(message);
    let (root, mut seen) = match list(e2b, uuid, &path, depth).await {
        Ok(l) => l,
        Err(refusal) => return in_band(refusal).await,
    };
    let e2b = e2b.clone();
    let frames = async_stream(move |tx: mpsc::Sender<hyper::body::Bytes>| async move {
        if tx.send(frame(0, &json!({"start": {}}))).await.is_err() {
            return;
        }
        let mut poll = tokio::time::interval(POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut alive = keepalive
            .map(|every| tokio::time::interval_at(tokio::time::Instant::now() + every, every));
        loop {
            tokio::select! {
                _ = tx.closed() => return,
                _ = async {
                    match alive.as_mut() {
                        Some(t) => t.tick().await,
                        None => std::future::pending().await,
                    }
                } => {
                    if tx.send(frame(0, &json!({"keepalive": {}}))).await.is_err() {
                        return;
                    }
                }
                _ = poll.tick() => {
                    let now = match list(&e2b, uuid, &root, depth).await {
                        Ok((_, now)) => now,
                        Err(refusal) => {
                            let _ = tx.send(frame(0x02, &error_of(refusal).await)).await;
                            return;
                        }
                    };
                    for event in changes(&seen, &now) {
                        if tx.send(frame(0, &json!({"filesystem": event}))).await.is_err() {
                            return;
                        }
                    }
                    seen = now;
                }
            }
        }
    });
    stream_response(frames)
}

/// A unary refusal's `{code, message}`, as a stream's end-of-stream error.
async fn error_of(refusal: Response<Body>) -> Value {
    use http_body_util::BodyExt;
    let bytes = refusal
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let value: Value = serde_json::from_slice(&bytes).unwrap_or_else(|_| json!({}));
    json!({"error": {
        "code": value["code"].as_str().unwrap_or("internal"),
        "message": value["message"].as_str().unwrap_or("the watch ended"),
    }})
}

/// A unary refusal answered in band, as a stream.
async fn in_band(refusal: Response<Body>) -> Response<Body> {
    let error = error_of(refusal).await;
    stream_error(
        error["error"]["code"].as_str().unwrap_or("internal"),
        error["error"]["message"].as_str().unwrap_or(""),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listings_read_and_compare_as_events() {
        let root = "/home/w";
        let before = parse(
            root,
            [
                "/home/w/a.txt|regular file|5|100",
                "/home/w/odd|name.txt|regular file|1|100",
                "/home/w/gone|regular empty file|0|100",
                "/home/w/sub|directory|4096|100",
                "/home/w/turns|regular file|1|100",
                "not under the root|regular file|1|1",
                "truncated|line",
            ]
            .into_iter(),
        );
        assert_eq!(before.len(), 5, "{before:?}");
        assert!(before.contains_key("odd|name.txt"));
        let after = parse(
            root,
            [
                "/home/w/a.txt|regular file|9|101",
                "/home/w/odd|name.txt|regular file|1|100",
                "/home/w/sub|directory|4096|105",
                "/home/w/sub/new|regular file|3|105",
                "/home/w/turns|directory|4096|105",
            ]
            .into_iter(),
        );
        let events: Vec<(String, String)> = changes(&before, &after)
            .iter()
            .map(|e| {
                (
                    e["name"].as_str().unwrap().to_string(),
                    e["type"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let want = [
            ("a.txt", "EVENT_TYPE_WRITE"),
            ("gone", "EVENT_TYPE_REMOVE"),
            ("turns", "EVENT_TYPE_REMOVE"),
            ("turns", "EVENT_TYPE_CREATE"),
            ("sub/new", "EVENT_TYPE_CREATE"),
            ("sub/new", "EVENT_TYPE_WRITE"),
        ];
        assert_eq!(
            events,
            want.map(|(n, t)| (n.to_string(), t.to_string())).to_vec()
        );
        assert!(changes(&after, &after).is_empty());
    }
}

//! The E2B API's control plane: the REST calls the SDKs make to create, find, list, time out,
//! pause, resume and kill sandboxes (see the module docs of `e2b` for what each means).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime};

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use sbx_actors::{SandboxFilter, SandboxSelector};
use sbx_proto::v1::{Lifetime, LifetimeAction, Phase, Sandbox, SandboxSpec};
use serde::Deserialize;
use serde_json::{Value, json};
use uuid::Uuid;

use super::{Body, E2b, Failure, e2b_id, e2b_id_to_uuid, empty, form_pairs, json_response, prove};
use crate::auth::{Caller, Role};
use crate::frontdoor::{Call, Suspend};

/// The largest request body the control plane reads (a create's metadata and variables).
const MAX_BODY: usize = 1 << 20;

/// A sandbox's lifetime when the create gives no `timeout`: E2B's default.
const DEFAULT_TIMEOUT_SECONDS: u64 = 300;

/// The in-sandbox daemon's version the sandboxes report: what the SDKs gate the features
/// served here on (commands with `stdin: false` from 0.3.0, the default user from 0.4.0,
/// `close_stdin` from 0.5.2, file uploads as octet streams, gzip too, from 0.5.7; file
/// metadata would need 0.6.2, watch events with entries 0.6.3).
const ENVD_VERSION: &str = "0.5.7";

/// The caller the request's `X-API-KEY` names (an sbx token). Grants `sbxd token create`
/// wrote since the identities were last read are bound first, as for a gRPC call.
async fn caller(e2b: &E2b, req: &Request<Incoming>) -> Result<(Caller, Option<String>), Failure> {
    if e2b.auth.has_unbound() {
        e2b.auth.bind_unbound().await;
    }
    let key = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty());
    // The key is checked as a bearer token is, by the same authenticator.
    let mut probe = hyper::Request::new(());
    if let Some(key) = key.filter(|_| !e2b.auth.none) {
        let value = format!("Bearer {key}")
            .parse()
            .map_err(|_| Failure::new(StatusCode::UNAUTHORIZED, "the API key is not text"))?;
        probe
            .headers_mut()
            .insert(hyper::header::AUTHORIZATION, value);
    } else if key.is_none() && !e2b.auth.none {
        return Err(Failure::new(
            StatusCode::UNAUTHORIZED,
            "no API key: give an sbx token (sbxd token create) as the X-API-KEY header \
             (E2B_API_KEY)",
        ));
    }
    let caller = e2b
        .auth
        .authenticate(&probe)
        .map_err(|status| Failure::new(StatusCode::UNAUTHORIZED, status.message().to_string()))?;
    prove(req);
    let key = key.filter(|_| !e2b.auth.none).map(str::to_string);
    if let Some(key) = &key {
        e2b.keys.remember(&caller, key);
    }
    Ok((caller, key))
}

/// The workspace a caller's new sandboxes go to: its one granted workspace, else `default`.
fn workspace_of(caller: &Caller) -> Result<Option<String>, Failure> {
    match &caller.grants {
        None => Ok(None),
        Some(grants) if grants.len() == 1 => Ok(grants.values().next().cloned()),
        Some(_) => Err(Failure::new(
            StatusCode::BAD_REQUEST,
            format!(
                "the key of {} holds several workspaces: give it one (an E2B key names where its \
                 sandboxes go)",
                caller.name
            ),
        )),
    }
}

/// The sandbox an E2B id names, if the caller may act on it as `role` (the front door's
/// check: a sandbox of a workspace the caller does not see is answered as absent).
async fn sandbox_of(e2b: &E2b, caller: &Caller, id: &str, role: Role) -> Result<Sandbox, Failure> {
    let not_found = || Failure::new(StatusCode::NOT_FOUND, format!("sandbox {id} was not found"));
    let uuid = e2b_id_to_uuid(id).ok_or_else(not_found)?;
    Ok(e2b
        .front
        .sandbox(caller, &SandboxSelector::Id(uuid), role)
        .await?)
}

async fn body_json<T: for<'de> Deserialize<'de> + Default>(
    req: Request<Incoming>,
) -> Result<T, Failure> {
    let bytes = super::read_body(req.into_body(), MAX_BODY)
        .await
        .map_err(|e| Failure::new(StatusCode::PAYLOAD_TOO_LARGE, e))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        Failure::new(
            StatusCode::BAD_REQUEST,
            format!("the request body is not the JSON asked: {e}"),
        )
    })
}

/// A pause's body: `memory` false keeps the filesystem only (E2B's default: everything).
#[derive(Debug, Default, Deserialize)]
struct Pause {
    memory: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<u64>,
    #[serde(default)]
    metadata: HashMap<String, String>,
    #[serde(default)]
    env_vars: HashMap<String, String>,
    #[serde(default)]
    auto_pause: bool,
    auto_resume: Option<AutoResume>,
}

#[derive(Debug, Default, Deserialize)]
struct AutoResume {
    #[serde(default)]
    enabled: bool,
}

#[derive(Debug, Default, Deserialize)]
struct Timeout {
    timeout: Option<u64>,
}

/// One control-plane call (no `E2b-Sandbox-Id`): the caller its key names, then the route.
pub(super) async fn handle(e2b: &E2b, req: Request<Incoming>) -> Result<Response<Body>, Failure> {
    let (caller, key) = caller(e2b, &req).await?;
    let call = Call {
        caller: &caller,
        bearer: key.as_deref(),
    };
    let path = req.uri().path().trim_end_matches('/').to_string();
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let method = req.method().clone();
    route(e2b, call, method, &parts, &path, req).await
}

/// One control-plane call of `caller`, by method and path parts.
async fn route(
    e2b: &E2b,
    call: Call<'_>,
    method: Method,
    parts: &[&str],
    path: &str,
    req: Request<Incoming>,
) -> Result<Response<Body>, Failure> {
    let caller = call.caller;
    match (method, parts) {
        (Method::POST, ["sandboxes"] | ["v2", "sandboxes"]) => create(e2b, call, req).await,
        (Method::GET, ["v2", "sandboxes"] | ["sandboxes"]) => list(e2b, caller, &req).await,
        (Method::GET, ["sandboxes", id, "metrics"]) => {
            let sandbox = sandbox_of(e2b, caller, id, Role::Viewer).await?;
            metrics(e2b, caller, &sandbox, req.uri().query().unwrap_or("")).await
        }
        (Method::GET, ["sandboxes", id]) => {
            let sandbox = sandbox_of(e2b, caller, id, Role::Viewer).await?;
            Ok(json_response(StatusCode::OK, &detail(&sandbox)))
        }
        (Method::DELETE, ["sandboxes", id]) => {
            let sel = id_selector(id)?;
            e2b.front
                .delete_sandbox(call, &sel, "e2b kill sandbox")
                .await?;
            Ok(empty(StatusCode::NO_CONTENT))
        }
        (Method::POST, ["sandboxes", id, "timeout"]) => {
            let sel = id_selector(id)?;
            let body: Timeout = body_json(req).await?;
            let seconds = body
                .timeout
                .ok_or_else(|| Failure::new(StatusCode::BAD_REQUEST, "timeout is required"))?;
            e2b.front
                .set_sandbox_ttl(call, &sel, seconds.max(1), "e2b set sandbox timeout")
                .await?;
            Ok(empty(StatusCode::NO_CONTENT))
        }
        (Method::POST, ["sandboxes", id, "pause"]) => {
            let sandbox = sandbox_of(e2b, caller, id, Role::Editor).await?;
            let body: Pause = body_json(req).await?;
            if matches!(sandbox.phase(), Phase::Paused | Phase::Stopped) {
                return Err(Failure::new(
                    StatusCode::CONFLICT,
                    format!("sandbox {id} is already paused"),
                ));
            }
            // `memory: false` (the SDK's `pause(keep_memory=False)`, `mode="filesystem"`):
            // its files only — the workload is stopped, and a connect starts it again.
            let change = match body.memory {
                Some(false) => Suspend::Stop,
                _ => Suspend::Pause,
            };
            e2b.front
                .suspend_or_wake(call, &selector(&sandbox)?, change, "e2b pause sandbox")
                .await?;
            Ok(empty(StatusCode::NO_CONTENT))
        }
        (Method::POST, ["sandboxes", id, "connect"] | ["v2", "sandboxes", id, "connect"]) => {
            connect(e2b, call, id, req).await
        }
        (method, _) => Err(Failure::new(
            StatusCode::NOT_FOUND,
            format!("no E2B call {method} {path} here"),
        )),
    }
}

/// The selector of an E2B id (one that names no sandbox is not found).
fn id_selector(id: &str) -> Result<SandboxSelector, Failure> {
    e2b_id_to_uuid(id)
        .map(SandboxSelector::Id)
        .ok_or_else(|| Failure::new(StatusCode::NOT_FOUND, format!("sandbox {id} was not found")))
}

fn selector(sandbox: &Sandbox) -> Result<SandboxSelector, Failure> {
    Uuid::parse_str(&sandbox.id)
        .map(SandboxSelector::Id)
        .map_err(|_| Failure::new(StatusCode::INTERNAL_SERVER_ERROR, "a sandbox without an id"))
}

/// `POST /v2/sandboxes`: made, started, answered once Ready (201).
async fn create(
    e2b: &E2b,
    call: Call<'_>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Failure> {
    let caller = call.caller;
    let idempotency = req
        .headers()
        .get("idempotency-key")
        .map(|v| v.as_bytes().to_vec())
        .filter(|k| !k.is_empty());
    // Who may create is known from the key alone: checked before a byte of the body is read.
    let workspace = workspace_of(caller)?;
    let ws_name = workspace.clone().unwrap_or_else(|| "default".to_string());
    e2b.front.may_create_in(caller, &ws_name).await?;
    let new: NewSandbox = body_json(req).await?;
    let template = new.template_id.unwrap_or_else(|| "base".to_string());
    let image = match e2b.templates.get(&template) {
        Some(image) => image.clone(),
        None if template == "base" => String::new(),
        None => template.clone(),
    };
    let timeout = new.timeout.unwrap_or(DEFAULT_TIMEOUT_SECONDS).max(1);
    let mut labels: HashMap<String, String> = new.metadata;
    labels.insert("e2b.template".into(), template_label(&template));
    let spec = SandboxSpec {
        command: vec!["sleep".into(), "infinity".into()],
        env: new.env_vars,
        labels,
        image,
        lifetime: Some(Lifetime {
            ttl_seconds: timeout,
            on_ttl: if new.auto_pause {
                LifetimeAction::Pause
            } else {
                LifetimeAction::Delete
            } as i32,
            auto_resume: new.auto_resume.map(|a| a.enabled),
            ..Default::default()
        }),
        ..Default::default()
    };
    // A create with an Idempotency-Key (the SDKs retry creates on 429 and 5xx) is named by the
    // key and the caller: a retry meets the name the first one took, in the workspace's own
    // supervisor, and is answered that sandbox instead of making a second.
    let name = match &idempotency {
        Some(key) => idempotent_name(&caller.name, key),
        None => format!("e2b-{}", &Uuid::new_v4().simple().to_string()[..12]),
    };
    let made = e2b
        .front
        .create_sandbox(call, Some(&ws_name), &name, spec, "e2b create sandbox")
        .await;
    let created = match made {
        Ok(created) => created,
        Err(f) if f.reason == "NAME_TAKEN" && idempotency.is_some() => {
            let sel = SandboxSelector::Name {
                workspace: Some(ws_name.clone()),
                name: name.clone(),
            };
            e2b.front.sandbox(caller, &sel, Role::Editor).await?
        }
        Err(f) => return Err(f.into()),
    };
    let ready = e2b.front.wait_ready(caller, created, READY_WITHIN).await?;
    let mut answer = sandbox_answer(e2b, caller, &ready, &template);
    answer["alias"] = json!(template);
    Ok(json_response(StatusCode::CREATED, &answer))
}

/// The name of the sandbox a create with Idempotency-Key `key` from `caller` makes: the same
/// for the same pair, and no other pair's (a SHA-256 of both, 20 hex digits).
fn idempotent_name(caller: &str, key: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(caller.as_bytes());
    h.update([0u8]);
    h.update(key);
    format!("e2b-idem-{}", &hex::encode(h.finalize())[..20])
}

/// A label value for a template name (an image reference holds `/`, `:` and `@`).
fn template_label(template: &str) -> String {
    let cleaned: String = template
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(63)
        .collect();
    cleaned
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_string()
}

/// How long a create waits for its sandbox to be Ready.
const READY_WITHIN: Duration = Duration::from_secs(120);

fn template_of(sandbox: &Sandbox) -> String {
    let spec = sandbox.spec.clone().unwrap_or_default();
    spec.labels.get("e2b.template").cloned().unwrap_or_else(|| {
        if spec.image.is_empty() {
            "base".into()
        } else {
            spec.image
        }
    })
}

/// What create and connect answer (E2B's `Sandbox`).
fn sandbox_answer(e2b: &E2b, caller: &Caller, sandbox: &Sandbox, template: &str) -> Value {
    // One token for both: it is what the sandbox's ports take too (`e2b-traffic-access-token`
    // or `X-Access-Token`); a sandbox's ports are never public.
    let token = super::token::mint(e2b, caller, &sandbox.id);
    json!({
        "templateID": template,
        "sandboxID": e2b_id(&sandbox.id),
        "clientID": "sbx",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token,
        "trafficAccessToken": token,
        "domain": null,
    })
}

fn rfc3339(t: Option<&sbx_proto::Timestamp>) -> String {
    let at = t
        .and_then(|t| SystemTime::try_from(*t).ok())
        .unwrap_or(SystemTime::UNIX_EPOCH);
    sbx_proto::time::rfc3339_nanos(at)
}

/// E2B's `SandboxDetail` / `ListedSandbox` of a sandbox.
fn detail(sandbox: &Sandbox) -> Value {
    let spec = sandbox.spec.clone().unwrap_or_default();
    let resources = spec.resources.unwrap_or_default();
    let state = match sandbox.phase() {
        Phase::Paused | Phase::Pausing | Phase::Stopped | Phase::Completed => "paused",
        _ => "running",
    };
    // No deadline: the furthest a ttl may go (shown as a time the SDKs can parse).
    let end = sandbox
        .expires_at
        .as_ref()
        .map(|t| rfc3339(Some(t)))
        .unwrap_or_else(|| {
            sbx_proto::time::rfc3339_nanos(SystemTime::now() + Duration::from_secs(30 * 86_400))
        });
    let metadata: BTreeMap<String, String> = spec
        .labels
        .iter()
        .filter(|(k, _)| *k != "e2b.template")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    json!({
        "templateID": template_of(sandbox),
        "sandboxID": e2b_id(&sandbox.id),
        "clientID": "sbx",
        "alias": template_of(sandbox),
        "startedAt": rfc3339(sandbox.created_at.as_ref()),
        "endAt": end,
        "envdVersion": ENVD_VERSION,
        "cpuCount": resources.cpu_millis.div_ceil(1000).max(1),
        "memoryMB": resources.memory_bytes >> 20,
        "diskSizeMB": resources.disk_bytes >> 20,
        "state": state,
        "metadata": metadata,
    })
}

/// `GET /sandboxes/{id}/metrics?start=&end=` (unix seconds): the samples the gateway kept of
/// the sandbox's usage (`sbxd serve --stats-interval`, as `sbx sandbox stats --history`) and
/// one read now, those between `start` and `end`, oldest first, in E2B's `SandboxMetric`
/// form. CPU is counted against the sandbox's CPU limit, else the machine's cores; memory
/// against its limit, else the machine's memory. Page cache is not read (`memCache` 0).
async fn metrics(
    e2b: &E2b,
    caller: &Caller,
    sandbox: &Sandbox,
    query: &str,
) -> Result<Response<Body>, Failure> {
    let pairs: HashMap<String, String> = form_pairs(query).into_iter().collect();
    let bound = |name: &str| -> Result<Option<u64>, Failure> {
        pairs
            .get(name)
            .map(|v| {
                v.parse::<u64>().map_err(|_| {
                    Failure::new(
                        StatusCode::BAD_REQUEST,
                        format!("{name} is a time in unix seconds, not {v:?}"),
                    )
                })
            })
            .transpose()
    };
    let (start, end) = (bound("start")?, bound("end")?);
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    // Everything kept unless a start says how far back.
    let history = Duration::from_secs(start.map_or(7 * 86_400, |s| now.saturating_sub(s) + 1));
    let stats = e2b
        .front
        .sandbox_stats(caller, &selector(sandbox)?, history)
        .await?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    let memory = host_memory_bytes();
    let samples: Vec<Value> = stats
        .history
        .iter()
        .chain(stats.current.iter())
        .filter_map(|s| {
            let at = s.time.as_ref()?;
            let secs = u64::try_from(at.seconds).ok()?;
            if start.is_some_and(|b| secs < b) || end.is_some_and(|b| secs > b) {
                return None;
            }
            let cpu_count = if s.cpu_limit_cores > 0.0 {
                s.cpu_limit_cores.ceil() as u64
            } else {
                cores
            };
            let mem_total = if s.memory_limit_bytes > 0 {
                s.memory_limit_bytes
            } else {
                memory
            };
            Some(json!({
                "timestamp": rfc3339(Some(at)),
                "timestampUnix": secs,
                "cpuCount": cpu_count,
                "cpuUsedPct": (s.cpu_cores / cpu_count as f64 * 100.0).clamp(0.0, 100.0),
                "memUsed": s.memory_bytes,
                "memTotal": mem_total,
                "memCache": 0,
                "diskUsed": s.disk_used_bytes,
                "diskTotal": s.disk_limit_bytes,
            }))
        })
        .collect();
    Ok(json_response(StatusCode::OK, &Value::Array(samples)))
}

/// The machine's memory (`MemTotal` of /proc/meminfo), 0 when it cannot be read.
fn host_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// The most sandboxes one listing looks through (ten store pages).
const MAX_LISTED: usize = 10_000;

/// `GET /v2/sandboxes`: the caller's sandboxes, by `metadata` (`k=v&k2=v2`, each part
/// percent-encoded), `state` (`running,paused`), `template` (its id or alias) and
/// `startedAfter` (RFC 3339), newest first unless `order=asc`; `limit` a page, `nextToken`
/// the next (a cursor: the start time and id of the page's last sandbox, so a page never
/// repeats or skips one as sandboxes come and go).
async fn list(
    e2b: &E2b,
    caller: &Caller,
    req: &Request<Incoming>,
) -> Result<Response<Body>, Failure> {
    let query: HashMap<String, String> = req
        .uri()
        .query()
        .map(|q| form_pairs(q).into_iter().collect())
        .unwrap_or_default();
    let bad = |what: String| Failure::new(StatusCode::BAD_REQUEST, what);
    let mut selector = Vec::new();
    if let Some(metadata) = query.get("metadata") {
        for (k, v) in form_pairs(metadata) {
            selector.push(format!("{k}={v}"));
        }
    }
    let states: Vec<String> = query
        .get("state")
        .map(|s| s.split(',').map(|p| p.trim().to_string()).collect())
        .unwrap_or_default();
    let limit: usize = query
        .get("limit")
        .and_then(|l| l.parse().ok())
        .unwrap_or(100)
        .clamp(1, 1000);
    let ascending = match query.get("order").map(String::as_str) {
        None | Some("" | "desc") => false,
        Some("asc") => true,
        Some(other) => return Err(bad(format!("order is asc or desc, not {other:?}"))),
    };
    let started_after = match query.get("startedAfter").filter(|t| !t.is_empty()) {
        None => None,
        Some(text) => Some(
            key_time(text)
                .ok_or_else(|| bad(format!("startedAfter is an RFC 3339 time, not {text:?}")))?,
        ),
    };
    let cursor = match query.get("nextToken").filter(|t| !t.is_empty()) {
        None => None,
        Some(token) => Some(
            parse_cursor(token)
                .ok_or_else(|| bad(format!("nextToken {token:?} is not one this listing gave")))?,
        ),
    };
    let filter = SandboxFilter {
        workspace: workspace_of(caller)?,
        all_workspaces: caller.grants.is_none() && workspace_of(caller)?.is_none(),
        label_selector: selector.join(","),
    };
    let mut all = Vec::new();
    let mut token = String::new();
    loop {
        let page = e2b
            .front
            .list_sandboxes(caller, &filter, 1000, &token)
            .await?;
        all.extend(page.items);
        token = page.next_page_token;
        if token.is_empty() || all.len() >= MAX_LISTED {
            break;
        }
    }
    let template = query.get("template").filter(|t| !t.is_empty());
    let mut keyed: Vec<((i64, i32, String), &Sandbox)> = all
        .iter()
        .filter(|s| template.is_none_or(|t| template_of(s) == template_label(t)))
        .map(|s| (sort_key(s), s))
        .filter(|(key, _)| started_after.is_none_or(|after| (key.0, key.1) >= after))
        .filter(|(key, _)| match &cursor {
            None => true,
            Some(c) if ascending => key > c,
            Some(c) => key < c,
        })
        .collect();
    keyed.sort_by(|a, b| a.0.cmp(&b.0));
    if !ascending {
        keyed.reverse();
    }
    let mut listed = Vec::new();
    let mut last = None;
    let mut more = false;
    for (key, sandbox) in keyed {
        let d = detail(sandbox);
        if !states.is_empty() && !states.iter().any(|w| d["state"] == json!(w)) {
            continue;
        }
        if listed.len() == limit {
            more = true;
            break;
        }
        listed.push(d);
        last = Some(key);
    }
    let mut response = json_response(StatusCode::OK, &Value::Array(listed));
    if more
        && let Some((secs, nanos, id)) = last
        && let Ok(token) = format!("{secs}.{nanos:09}.{id}").parse()
    {
        response.headers_mut().insert("x-next-token", token);
    }
    Ok(response)
}

/// A sandbox's place in a listing: its start (creation) time, then its id.
fn sort_key(sandbox: &Sandbox) -> (i64, i32, String) {
    let at = sandbox.created_at.unwrap_or_default();
    (at.seconds, at.nanos, sandbox.id.clone())
}

/// A `nextToken`: `SECONDS.NANOS.ID`.
fn parse_cursor(token: &str) -> Option<(i64, i32, String)> {
    let mut parts = token.splitn(3, '.');
    let secs = parts.next()?.parse().ok()?;
    let nanos = parts.next()?.parse().ok()?;
    let id = parts.next()?.to_string();
    Uuid::parse_str(&id).ok()?;
    Some((secs, nanos, id))
}

/// An RFC 3339 time (one without an offset is taken as UTC) as (seconds, nanos).
fn key_time(text: &str) -> Option<(i64, i32)> {
    let parsed = text
        .parse::<sbx_proto::Timestamp>()
        .or_else(|_| format!("{text}Z").parse::<sbx_proto::Timestamp>())
        .ok()?;
    Some((parsed.seconds, parsed.nanos))
}

/// `POST /v2/sandboxes/{id}/connect`: a paused sandbox is resumed (201); a running one is
/// answered as it is (200), its deadline moved to now + `timeout` only when that is later.
async fn connect(
    e2b: &E2b,
    call: Call<'_>,
    id: &str,
    req: Request<Incoming>,
) -> Result<Response<Body>, Failure> {
    let sel = id_selector(id)?;
    let body: Timeout = body_json(req).await?;
    let (sandbox, resumed) = e2b
        .front
        .connect_sandbox(call, &sel, body.timeout, "e2b connect sandbox")
        .await?;
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok(json_response(
        status,
        &sandbox_answer(e2b, call.caller, &sandbox, &template_of(&sandbox)),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_and_times_read_back() {
        let id = Uuid::new_v4().to_string();
        let token = format!("{}.{:09}.{id}", 1_796_400_000, 5);
        assert_eq!(parse_cursor(&token), Some((1_796_400_000, 5, id.clone())));
        for bad in ["", "1.2", "1.2.not-an-id", "x.0.{id}"] {
            assert_eq!(parse_cursor(bad), None, "{bad}");
        }
        assert_eq!(key_time("2026-12-04T19:20:00Z"), Some((1_796_412_000, 0)));
        assert_eq!(
            key_time("2026-12-04T20:20:00.5+01:00"),
            Some((1_796_412_000, 500_000_000))
        );
        assert_eq!(key_time("2026-12-04T19:20:00"), Some((1_796_412_000, 0)));
        assert_eq!(key_time("yesterday"), None);
    }

    #[test]
    fn template_labels_are_label_values() {
        assert_eq!(template_label("base"), "base");
        assert_eq!(
            template_label("docker.io/library/debian:bookworm"),
            "docker.io_library_debian_bookworm"
        );
        assert_eq!(template_label("@@"), "");
    }

    use http_body_util::BodyExt;

    /// The body of an answer, as JSON.
    fn answer_json(response: Response<Body>) -> (u16, Value) {
        let status = response.status().as_u16();
        let body = futures::executor::block_on(response.into_body().collect())
            .expect("a full body")
            .to_bytes();
        (status, serde_json::from_slice(&body).expect("a JSON body"))
    }

    /// The same failure reaches a gRPC client and an E2B client (control plane and in-sandbox
    /// API) as the same class, for every actor error: the gRPC code read back from the
    /// headers as a client reads them, the HTTP status and `reason` of the control plane's
    /// answer, the Connect code of the in-sandbox API's.
    #[test]
    fn every_actor_error_reaches_every_transport_as_one_class() {
        use crate::grpc::status::{class_of, code_name, status_of};
        for err in crate::frontdoor::error::every_actor_error() {
            let failure = crate::frontdoor::Failure::from(&err);
            let class = failure.class;
            let mut headers = tonic::codegen::http::HeaderMap::new();
            status_of(&failure).add_header(&mut headers).unwrap();
            let grpc = tonic::Status::from_header_map(&headers).expect("a status");
            let info = tonic_types::StatusExt::get_details_error_info(&grpc).expect("ErrorInfo");
            let grpc_class = class_of(grpc.code());
            let seen_as = |c| {
                if c == crate::frontdoor::Class::Elsewhere {
                    crate::frontdoor::Class::Unavailable
                } else {
                    c
                }
            };
            assert_eq!(grpc_class, seen_as(class), "gRPC: {err:?}");
            let (http, body) = answer_json(Failure::from(err.clone()).response());
            assert_eq!(http, class.http_status(), "E2B control plane: {err:?}");
            assert_eq!(body["code"], json!(http), "{err:?}");
            assert_eq!(body["reason"], json!(info.reason), "{err:?}");
            let code = crate::e2b::connect::code_of(&crate::frontdoor::Failure::from(&err));
            let (envd_http, envd) = answer_json(crate::e2b::connect::connect_error(code, "m"));
            assert_eq!(envd_http, class.http_status(), "E2B envd: {err:?}");
            let want = match code_name(grpc.code()) {
                "CANCELLED" => "canceled".to_string(),
                name => name.to_ascii_lowercase(),
            };
            assert_eq!(envd["code"], json!(want), "E2B envd: {err:?}");
        }
    }
}

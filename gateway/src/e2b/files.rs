//! The in-sandbox API's files (`filesystem.Filesystem`'s `Stat`, `ListDir`, `MakeDir`, `Move`,
//! `Remove`, and `/files` downloads and uploads, multipart or octet-stream, plain or gzip):
//! each a short script run as an exec
//! of the sandbox (nothing new listens inside it), its output bounded ([`Bounds`]) because the
//! sandbox writes it. Transfers are bounded per key and per gateway ([`Transfers`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use futures::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use sbx_actors::ExecOptions;
use sbx_proto::v1::{exec_input, exec_output};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use uuid::Uuid;

use super::connect::*;
use super::{Body, E2b};
use crate::frontdoor::Failure;

/// The largest upload one `/files` POST takes (the SDK sends a file in one request).
pub(super) const MAX_UPLOAD: u64 = 1 << 30;

/// File transfers (`/files`) one key may have at once…
pub const PER_CALLER: usize = 8;
/// …and the gateway in all.
pub const PER_GATEWAY: usize = 64;

/// The file transfers under way, in all and by key.
#[derive(Debug, Default)]
pub struct Transfers {
    by_caller: Mutex<HashMap<String, usize>>,
}

/// A transfer's turn, given back when it ends (a download's when its last byte is sent).
pub struct Turn {
    transfers: Arc<Transfers>,
    caller: String,
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut by = sbx_drivers::locked(&self.transfers.by_caller);
        if let Some(n) = by.get_mut(&self.caller) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                by.remove(&self.caller);
            }
        }
    }
}

impl Transfers {
    /// A turn for `caller`, unless it or the gateway has as many transfers as it may.
    pub fn enter(self: &Arc<Self>, caller: &str) -> Option<Turn> {
        let mut by = sbx_drivers::locked(&self.by_caller);
        let all: usize = by.values().sum();
        let mine = by.get(caller).copied().unwrap_or(0);
        if mine >= PER_CALLER || all >= PER_GATEWAY {
            return None;
        }
        *by.entry(caller.to_string()).or_insert(0) += 1;
        Some(Turn {
            transfers: Arc::clone(self),
            caller: caller.to_string(),
        })
    }
}

/// The exit statuses the scripts use: not found, not a directory (or a directory where a
/// file is wanted), already exists.
pub(super) const NOT_FOUND: i32 = 44;
pub(super) const NOT_A_DIRECTORY: i32 = 45;
pub(super) const EXISTS: i32 = 46;
pub(super) const NOT_A_FILE: i32 = 47;

/// Every script's start: `$p` is `$1` made absolute against `$HOME` (or `/`); `entry PATH`
/// prints `PATH|TYPE|SIZE|MODE|PERMISSIONS|OWNER|GROUP|MTIME`.
pub(super) const PRELUDE: &str = r#"cd "$HOME" 2>/dev/null || cd /
abs() { case "$1" in /*) printf '%s' "$1";; *) printf '%s/%s' "${PWD%/}" "$1";; esac; }
p=$(abs "$1")
entry() { printf '%s|' "$1"; stat -c '%F|%s|%a|%A|%U|%G|%Y' -- "$1" | tr -d '\n'
  if [ -L "$1" ]; then t=$(readlink -f "$1"); [ -e "$t" ] || t=
    printf '|L|%s|%s\n' "$(stat -L -c '%F|%a' -- "$1" 2>/dev/null || printf '|')" \
      "$(printf '%s' "$t" | base64 -w 0)"
  else printf '|-\n'; fi; }
"#;

/// What a script answered: exit status, stdout, stderr.
pub(super) struct Ran {
    pub(super) code: i32,
    pub(super) stdout: Vec<u8>,
    pub(super) stderr: String,
}

/// How much of a script's output the gateway holds, and for how long the script may run: the
/// sandbox writes that output (its own `stat`, `find`, `cat`), so neither may be its to set.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bounds {
    pub(super) stdout: usize,
    pub(super) seconds: u32,
}

/// A listing or a file's facts: 16 MiB of output, a minute.
pub(super) const FACTS: Bounds = Bounds {
    stdout: 16 << 20,
    seconds: 60,
};

/// How long a file's bytes may take in or out (they stream: nothing of them is gathered).
pub(super) const CONTENT_SECONDS: u32 = 600;

/// What an upload's script answers (the path it wrote): a line.
pub(super) const WRITTEN: Bounds = Bounds {
    stdout: 64 << 10,
    seconds: CONTENT_SECONDS,
};

/// What a script's stderr keeps (it only goes into messages).
pub(super) const MAX_STDERR: usize = 64 << 10;

/// The output of a script started by [`start_script`].
pub(super) type ScriptOutput = std::pin::Pin<
    Box<dyn futures::Stream<Item = Result<sbx_proto::v1::ExecOutput, Failure>> + Send>,
>;

/// Starts `body` (after [`PRELUDE`]) with `args` in the sandbox for at most `seconds`; with
/// `stdin`, what that channel carries is its input (a `CloseStdin` ends it). Its output as it
/// comes, for the caller to pace (an exec's output is bounded end to end: the sandbox waits
/// while the caller does not read).
pub(super) async fn start_script(
    e2b: &E2b,
    uuid: Uuid,
    user: &str,
    body: &str,
    args: &[&str],
    stdin: Option<mpsc::Receiver<exec_input::Input>>,
    seconds: u32,
) -> Result<ScriptOutput, Failure> {
    let mut command = vec![
        "sh".to_string(),
        "-c".to_string(),
        format!("{PRELUDE}{body}"),
        "sh".to_string(),
    ];
    command.extend(args.iter().map(|a| a.to_string()));
    let feeding = stdin.is_some();
    let rx = stdin.unwrap_or_else(|| mpsc::channel(1).1);
    let opts = ExecOptions {
        stdin: feeding,
        timeout_seconds: seconds,
        user: user.to_string(),
        ..Default::default()
    };
    let input = Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx));
    e2b.exec(uuid, command, opts, input).await
}

/// Runs `body` (after [`PRELUDE`]) with `args` in the sandbox, `stdin` as its input, within
/// `bounds`: output past them ends the script, refused as `FailedPrecondition`.
pub(super) async fn script(
    e2b: &E2b,
    uuid: Uuid,
    user: &str,
    body: &str,
    args: &[&str],
    stdin: Option<Bytes>,
    bounds: Bounds,
) -> Result<Ran, Failure> {
    let input = stdin.map(|data| {
        let (tx, rx) = mpsc::channel::<exec_input::Input>(8);
        tokio::spawn(async move {
            for piece in data.chunks(64 * 1024) {
                if tx
                    .send(exec_input::Input::Stdin(piece.to_vec()))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            let _ = tx.send(exec_input::Input::CloseStdin(true)).await;
        });
        rx
    });
    let mut output = start_script(e2b, uuid, user, body, args, input, bounds.seconds).await?;
    collect(&mut output, bounds).await
}

/// What a script said until it ended, within `bounds`.
pub(super) async fn collect(output: &mut ScriptOutput, bounds: Bounds) -> Result<Ran, Failure> {
    let (mut stdout, mut stderr, mut code) = (Vec::new(), Vec::new(), -1);
    while let Some(chunk) = output.next().await {
        match chunk?.chunk {
            Some(exec_output::Chunk::Stdout(b)) => {
                if stdout.len() + b.len() > bounds.stdout {
                    // Dropping the stream ends the exec.
                    return Err(Failure::failed_precondition(format!(
                        "the answer is larger than the {} bytes the gateway takes",
                        bounds.stdout
                    )));
                }
                stdout.extend(b)
            }
            Some(exec_output::Chunk::Stderr(b)) => {
                let room = MAX_STDERR.saturating_sub(stderr.len());
                stderr.extend(&b[..b.len().min(room)]);
            }
            Some(exec_output::Chunk::Exit(exit)) if exit.timed_out => {
                return Err(Failure::failed_precondition(format!(
                    "the sandbox did not answer within {} s",
                    bounds.seconds
                )));
            }
            Some(exec_output::Chunk::Exit(exit)) => code = exit.code,
            None => {}
        }
    }
    Ok(Ran {
        code,
        stdout,
        stderr: String::from_utf8_lossy(&stderr).trim().to_string(),
    })
}

/// An `entry` line as an `EntryInfo` (the path may hold `|`: the fields are split from the
/// right). A line ends `|-`, or for a symlink `|L|TYPE|MODE|TARGET` (its target's type and
/// permissions, the target resolved, base64; empty when it leads nowhere): as envd answers,
/// a symlink is the type and mode of what it leads to, with its `symlinkTarget`, and a
/// dangling one is of no type.
pub(super) fn entry_info(line: &str) -> Option<Value> {
    let (line, link) = match line.strip_suffix("|-") {
        Some(rest) => (rest, None),
        None => {
            let mut ext = line.rsplitn(5, '|');
            let (target, mode, kind) = (ext.next()?, ext.next()?, ext.next()?);
            if ext.next()? != "L" {
                return None;
            }
            let target = B64
                .decode(target)
                .ok()
                .and_then(|t| String::from_utf8(t).ok())?;
            (ext.next()?, Some((kind, mode, target)))
        }
    };
    let mut fields: Vec<&str> = line.rsplitn(8, '|').collect();
    if fields.len() != 8 {
        return None;
    }
    fields.reverse();
    let path = fields[0];
    let type_of = |t: &str| match t {
        "directory" => "FILE_TYPE_DIRECTORY",
        t if t.contains("file") => "FILE_TYPE_FILE",
        _ => "FILE_TYPE_UNSPECIFIED",
    };
    let mode_of = |m: &str| u32::from_str_radix(m, 8).unwrap_or(0);
    let (kind, mode, target) = match link {
        Some((kind, mode, target)) if !target.is_empty() => {
            (type_of(kind), mode_of(mode), Some(target))
        }
        Some(_) => ("FILE_TYPE_UNSPECIFIED", mode_of(fields[3]), None),
        None => (type_of(fields[1]), mode_of(fields[3]), None),
    };
    let mtime: u64 = fields[7].trim().parse().unwrap_or(0);
    let name = path.rsplit('/').next().unwrap_or(path);
    let mut entry = json!({
        "name": name,
        "type": kind,
        "path": path,
        "size": fields[2],
        "mode": mode,
        "permissions": fields[4],
        "owner": fields[5],
        "group": fields[6],
        // The sandbox's `stat` says it: a time past what the clock holds is none.
        "modifiedTime": sbx_proto::time::rfc3339_nanos(
            std::time::UNIX_EPOCH
                .checked_add(std::time::Duration::from_secs(mtime))
                .unwrap_or(std::time::UNIX_EPOCH)
        ),
    });
    if let Some(target) = target {
        entry["symlinkTarget"] = json!(target);
    }
    Some(entry)
}

/// A script's refusal as a Connect error.
pub(super) fn refused(ran: &Ran, path: &str) -> Response<Body> {
    match ran.code {
        NOT_FOUND => connect_error("not_found", format!("path '{path}' does not exist")),
        NOT_A_DIRECTORY => connect_error(
            "invalid_argument",
            format!("path '{path}' is not a directory"),
        ),
        EXISTS => connect_error("already_exists", format!("path '{path}' already exists")),
        _ => connect_error("internal", format!("{path}: {}", ran.stderr)),
    }
}

/// Stat, ListDir, MakeDir, Move, Remove.
pub(super) async fn filesystem(
    e2b: &E2b,
    uuid: Uuid,
    user: &str,
    rpc: &str,
    message: &Value,
) -> Response<Body> {
    let text = |field: &str| message[field].as_str().unwrap_or("").to_string();
    let (body, args, key): (&str, Vec<String>, &str) = match rpc {
        "/filesystem.Filesystem/Stat" => (
            r#"[ -e "$p" ] || [ -L "$p" ] || exit 44; entry "$p""#,
            vec![text("path")],
            "entry",
        ),
        "/filesystem.Filesystem/ListDir" => {
            let depth = message["depth"].as_u64().unwrap_or(1).clamp(1, 64);
            (
                r#"[ -e "$p" ] || exit 44; [ -d "$p" ] || exit 45
find "$p" -mindepth 1 -maxdepth "$2" | while IFS= read -r f; do entry "$f"; done"#,
                vec![text("path"), depth.to_string()],
                "entries",
            )
        }
        "/filesystem.Filesystem/MakeDir" => (
            r#"[ -e "$p" ] && exit 46; mkdir -p -- "$p" && entry "$p""#,
            vec![text("path")],
            "entry",
        ),
        "/filesystem.Filesystem/Move" => (
            r#"[ -e "$p" ] || [ -L "$p" ] || exit 44; d=$(abs "$2")
mkdir -p -- "$(dirname -- "$d")" && mv -- "$p" "$d" && entry "$d""#,
            vec![text("source"), text("destination")],
            "entry",
        ),
        // Removing what is not there succeeds, as envd's does.
        _ => (r#"rm -rf -- "$p""#, vec![text("path")], ""),
    };
    if args.iter().any(String::is_empty) {
        return connect_error("invalid_argument", "a path is required");
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let ran = match script(e2b, uuid, user, body, &refs, None, FACTS).await {
        Ok(r) => r,
        Err(e) => return connect_error(code_of(&e), e.to_string()),
    };
    if ran.code != 0 {
        return refused(&ran, &args[0]);
    }
    let out = String::from_utf8_lossy(&ran.stdout);
    let mut entries: Vec<Value> = out.lines().filter_map(entry_info).collect();
    // By path, as envd lists (`find` answers in the directory's own order).
    entries.sort_by(|a, b| a["path"].as_str().cmp(&b["path"].as_str()));
    let answer = match key {
        "entries" => json!({"entries": entries}),
        "entry" => match entries.into_iter().next() {
            Some(e) => json!({"entry": e}),
            None => return connect_error("internal", format!("no entry for {}", args[0])),
        },
        _ => json!({}),
    };
    super::json_response(StatusCode::OK, &answer)
}

/// A `/files` refusal: JSON `{code, message}` with its HTTP status.
pub(super) fn file_error(status: StatusCode, message: String) -> Response<Body> {
    super::json_response(
        status,
        &json!({"code": status.as_u16(), "message": message}),
    )
}

/// `GET /files?path=P` (the file's bytes) and `POST /files[?path=P]` (multipart: each `file`
/// part written to its path, the query's or the part's filename; `application/octet-stream`,
/// envd 0.5.7's: the body is the file at P, `Content-Encoding: gzip` unpacked as it comes).
pub(super) async fn files(
    e2b: &E2b,
    uuid: Uuid,
    req: Request<Incoming>,
    turn: Turn,
) -> Response<Body> {
    let query: HashMap<String, String> = req
        .uri()
        .query()
        .map(|q| super::form_pairs(q).into_iter().collect())
        .unwrap_or_default();
    let path = query.get("path").cloned().unwrap_or_default();
    // Who reads or writes (`username`, as the SDK names it): a relative path is under that
    // user's home, a written file is that user's; none is the sandbox's default user.
    let user = query.get("username").cloned().unwrap_or_default();
    if req.method() == hyper::Method::GET {
        return download(e2b, uuid, &user, &path, turn).await;
    }
    let octets = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.trim().starts_with("application/octet-stream"));
    if octets {
        return octet_upload(e2b, uuid, &user, &path, req).await;
    }
    let boundary = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|c| multer::parse_boundary(c).ok());
    let Some(boundary) = boundary else {
        return file_error(
            StatusCode::BAD_REQUEST,
            "an upload is multipart/form-data with `file` parts".into(),
        );
    };
    let stream = http_body_util::BodyStream::new(req.into_body()).filter_map(|frame| async move {
        match frame {
            Ok(f) => f.into_data().ok().map(Ok::<Bytes, hyper::Error>),
            Err(e) => Some(Err(e)),
        }
    });
    let constraints =
        multer::Constraints::new().size_limit(multer::SizeLimit::new().whole_stream(MAX_UPLOAD));
    let mut multipart = multer::Multipart::with_constraints(stream, boundary, constraints);
    let mut written = Vec::new();
    loop {
        let field = match multipart.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => return file_error(StatusCode::BAD_REQUEST, format!("the upload: {e}")),
        };
        let target = if path.is_empty() {
            field.file_name().unwrap_or("").to_string()
        } else {
            path.clone()
        };
        if target.is_empty() {
            return file_error(StatusCode::BAD_REQUEST, "a file part names no path".into());
        }
        let chunks = Box::pin(futures::TryStreamExt::map_err(field, |e| {
            format!("the upload: {e}")
        }));
        let ran = match upload(e2b, uuid, &user, &target, chunks).await {
            Ok(r) => r,
            Err(response) => return response,
        };
        match written_entry(&target, &ran) {
            Ok(entry) => written.push(entry),
            Err(why) => return file_error(StatusCode::BAD_REQUEST, why),
        }
    }
    if written.is_empty() {
        return file_error(
            StatusCode::BAD_REQUEST,
            "the upload holds no file part".into(),
        );
    }
    super::json_response(StatusCode::OK, &Value::Array(written))
}

/// What an upload's script said, as the SDK reads a written file (`WriteInfo`), or why not
/// (the caller's error: a path that cannot be written).
fn written_entry(target: &str, ran: &Ran) -> Result<Value, String> {
    if ran.code != 0 {
        return Err(format!("cannot write '{target}': {}", ran.stderr));
    }
    let full = String::from_utf8_lossy(&ran.stdout).to_string();
    let name = full.rsplit('/').next().unwrap_or(&full).to_string();
    Ok(json!({"path": full, "name": name, "type": "file"}))
}

/// `POST /files?path=P` with an `application/octet-stream` body: the body is the file,
/// unpacked as it comes when its `Content-Encoding` is gzip, at most [`MAX_UPLOAD`] bytes as
/// written (a gzip that unpacks past it is refused when it gets there).
async fn octet_upload(
    e2b: &E2b,
    uuid: Uuid,
    user: &str,
    path: &str,
    req: Request<Incoming>,
) -> Response<Body> {
    if path.is_empty() {
        return file_error(
            StatusCode::BAD_REQUEST,
            "an octet-stream upload names its file: ?path=".into(),
        );
    }
    let encoding = req
        .headers()
        .get(hyper::header::CONTENT_ENCODING)
        .map(|v| v.to_str().unwrap_or("?").trim().to_ascii_lowercase());
    let gzip = match encoding.as_deref() {
        None | Some("") | Some("identity") => false,
        Some("gzip") => true,
        Some(other) => {
            return file_error(
                StatusCode::BAD_REQUEST,
                format!("Content-Encoding {other:?} is not taken: gzip or none"),
            );
        }
    };
    let body = http_body_util::BodyStream::new(req.into_body()).filter_map(|frame| async move {
        match frame {
            Ok(f) => f.into_data().ok().map(Ok),
            Err(e) => Some(Err(format!("the upload: {e}"))),
        }
    });
    let body: Chunks<'_> = Box::pin(body);
    let chunks = capped(if gzip { gunzip(body) } else { body }, MAX_UPLOAD);
    let ran = match upload(e2b, uuid, user, path, chunks).await {
        Ok(r) => r,
        Err(response) => return response,
    };
    match written_entry(path, &ran) {
        Ok(entry) => super::json_response(StatusCode::OK, &Value::Array(vec![entry])),
        Err(why) => file_error(StatusCode::BAD_REQUEST, why),
    }
}

/// An upload's bytes as they come, or why they stopped.
pub(super) type Chunks<'a> =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<Bytes, String>> + Send + 'a>>;

/// `chunks`, ended with an error once they pass `max` bytes.
fn capped(chunks: Chunks<'_>, max: u64) -> Chunks<'_> {
    let mut seen = 0u64;
    Box::pin(chunks.map(move |chunk| {
        let chunk = chunk?;
        seen = seen.saturating_add(chunk.len() as u64);
        if seen > max {
            return Err(format!("the upload is larger than {max} bytes"));
        }
        Ok(chunk)
    }))
}

/// How much of a gzip body is unpacked at a time: deflate makes at most ~1,032 bytes of one,
/// so a piece's output stays near 1 MiB however the body was packed.
const GUNZIP_PIECE: usize = 1024;

/// `chunks` (a gzip stream) unpacked as they come, a piece at a time ([`GUNZIP_PIECE`]); a
/// stream cut short or not gzip ends with an error.
pub(super) fn gunzip(chunks: Chunks<'_>) -> Chunks<'_> {
    use std::io::Write;
    let decoder = flate2::write::GzDecoder::new(Vec::new());
    let state = Some((chunks, decoder, Bytes::new()));
    Box::pin(futures::stream::unfold(state, |state| async move {
        let (mut chunks, mut decoder, mut pending) = state?;
        loop {
            if !pending.is_empty() {
                let piece = pending.split_to(pending.len().min(GUNZIP_PIECE));
                if let Err(e) = decoder.write_all(&piece) {
                    return Some((Err(format!("the gzip body: {e}")), None));
                }
                let out = std::mem::take(decoder.get_mut());
                if !out.is_empty() {
                    return Some((Ok(Bytes::from(out)), Some((chunks, decoder, pending))));
                }
                continue;
            }
            match chunks.next().await {
                Some(Ok(bytes)) => pending = bytes,
                Some(Err(e)) => return Some((Err(e), None)),
                None => {
                    return match decoder.try_finish() {
                        Err(e) => Some((Err(format!("the gzip body: {e}")), None)),
                        Ok(()) => {
                            let out = std::mem::take(decoder.get_mut());
                            (!out.is_empty()).then(|| (Ok(Bytes::from(out)), None))
                        }
                    };
                }
            }
        }
    }))
}

/// One file part of an upload written to `target` as it arrives: its chunks are the input of
/// the sandbox's `cat` (a bounded channel: the client's upload waits while the sandbox
/// writes), so no file is held whole in the gateway. Like envd, it writes in place: an upload
/// cut short leaves what arrived. The script's answer, or the response that says why not.
pub(super) async fn upload(
    e2b: &E2b,
    uuid: Uuid,
    user: &str,
    target: &str,
    mut chunks: Chunks<'_>,
) -> Result<Ran, Response<Body>> {
    let (tx, rx) = mpsc::channel::<exec_input::Input>(4);
    let mut output = start_script(
        e2b,
        uuid,
        user,
        r#"[ -d "$p" ] && exit 45; mkdir -p -- "$(dirname -- "$p")" && cat > "$p" && printf '%s' "$p""#,
        &[target],
        Some(rx),
        CONTENT_SECONDS,
    )
    .await
    .map_err(|e| file_error(StatusCode::BAD_GATEWAY, e.to_string()))?;
    let feed = async move {
        loop {
            match chunks.next().await.transpose() {
                Ok(Some(bytes)) => {
                    for piece in bytes.chunks(64 * 1024) {
                        if tx
                            .send(exec_input::Input::Stdin(piece.to_vec()))
                            .await
                            .is_err()
                        {
                            // The script ended early; what it said tells why.
                            return Ok(());
                        }
                    }
                }
                Ok(None) => {
                    let _ = tx.send(exec_input::Input::CloseStdin(true)).await;
                    return Ok(());
                }
                Err(e) => {
                    return Err(file_error(StatusCode::BAD_REQUEST, e));
                }
            }
        }
    };
    let ran = async {
        collect(&mut output, WRITTEN)
            .await
            .map_err(|e| file_error(StatusCode::BAD_GATEWAY, e.to_string()))
    };
    // A broken upload ends the script (its output stream, dropped, ends the exec).
    let ((), ran) = futures::future::try_join(feed, ran).await?;
    Ok(ran)
}

/// `GET /files?path=P`: the file's bytes as the sandbox's `cat` writes them, streamed (the
/// sandbox waits while the client does not read: nothing of the file is held whole), or why
/// not. A file that fails part-way (removed, unreadable) ends the body with an error, so the
/// client sees a broken transfer, never a short file as a whole one.
pub(super) async fn download(
    e2b: &E2b,
    uuid: Uuid,
    user: &str,
    path: &str,
    turn: Turn,
) -> Response<Body> {
    if path.is_empty() {
        return file_error(StatusCode::BAD_REQUEST, "path is required".into());
    }
    let ran = match script(
        e2b,
        uuid,
        user,
        // A regular file only (through links): a device or a FIFO is no file's bytes.
        r#"[ -e "$p" ] || exit 44; [ -d "$p" ] && exit 45; [ -f "$p" ] || exit 47; printf ok"#,
        &[path],
        None,
        FACTS,
    )
    .await
    {
        Ok(r) => r,
        Err(e) => return file_error(StatusCode::BAD_GATEWAY, e.to_string()),
    };
    match ran.code {
        0 => {
            let output = match start_script(
                e2b,
                uuid,
                user,
                r#"exec cat -- "$p""#,
                &[path],
                None,
                CONTENT_SECONDS,
            )
            .await
            {
                Ok(o) => o,
                Err(e) => return file_error(StatusCode::BAD_GATEWAY, e.to_string()),
            };
            type Error = Box<dyn std::error::Error + Send + Sync>;
            let frames = output.filter_map(|item| async move {
                match item.map(|o| o.chunk) {
                    Ok(Some(exec_output::Chunk::Stdout(b))) => {
                        Some(Ok::<_, Error>(Frame::data(Bytes::from(b))))
                    }
                    Ok(Some(exec_output::Chunk::Exit(exit))) if exit.code == 0 => None,
                    Ok(Some(exec_output::Chunk::Exit(exit))) => Some(Err(format!(
                        "the file's read ended with status {}{}",
                        exit.code,
                        if exit.timed_out { " (timed out)" } else { "" }
                    )
                    .into())),
                    Ok(_) => None,
                    Err(e) => Some(Err(e.to_string().into())),
                }
            });
            // Through a channel of two chunks (a body must be Sync; the exec's stream is not):
            // the pace is still the client's, and a client gone ends the exec.
            let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, Error>>(2);
            tokio::spawn(async move {
                // The transfer's turn lasts as long as its bytes flow.
                let _turn = turn;
                let mut frames = std::pin::pin!(frames);
                while let Some(frame) = frames.next().await {
                    if tx.send(frame).await.is_err() {
                        return;
                    }
                }
            });
            let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
            let mut r = Response::new(BodyExt::boxed(body));
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                "application/octet-stream".parse().expect("a header value"),
            );
            r
        }
        NOT_FOUND => file_error(
            StatusCode::NOT_FOUND,
            format!("path '{path}' does not exist"),
        ),
        NOT_A_DIRECTORY => file_error(
            StatusCode::BAD_REQUEST,
            format!("path '{path}' is a directory"),
        ),
        NOT_A_FILE => file_error(
            StatusCode::BAD_REQUEST,
            format!("path '{path}' is not a regular file"),
        ),
        _ => file_error(StatusCode::INTERNAL_SERVER_ERROR, ran.stderr),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key has at most PER_CALLER transfers at once, the gateway PER_GATEWAY; a turn
    /// ended is given back.
    #[test]
    fn file_transfers_are_bounded_per_key_and_in_all() {
        let transfers = Arc::new(Transfers::default());
        let mine: Vec<Turn> = (0..PER_CALLER)
            .map(|_| transfers.enter("a").expect("a turn"))
            .collect();
        assert!(transfers.enter("a").is_none(), "past the key's bound");
        let mut others = Vec::new();
        for i in 0..(PER_GATEWAY - PER_CALLER) {
            others.push(
                transfers
                    .enter(&format!("k{}", i % 7))
                    .expect("another key's turn"),
            );
        }
        assert!(transfers.enter("b").is_none(), "past the gateway's bound");
        drop(mine);
        assert!(transfers.enter("a").is_some(), "a turn given back");
    }
    #[test]
    fn entries_read_as_envd_says_them() {
        let e = entry_info("/home/a|b.txt|regular file|12|644|-rw-r--r--|root|root|0|-").unwrap();
        assert_eq!(e["path"], "/home/a|b.txt");
        assert_eq!(e["name"], "a|b.txt");
        assert_eq!(e["type"], "FILE_TYPE_FILE");
        assert_eq!(
            (e["size"].clone(), e["mode"].clone()),
            (json!("12"), json!(420))
        );
        let d = entry_info("/d|directory|4096|755|drwxr-xr-x|u|g|5|-").unwrap();
        assert_eq!(d["type"], "FILE_TYPE_DIRECTORY");
        assert_eq!(d.get("symlinkTarget"), None);
        assert_eq!(entry_info("garbage"), None);
        // A symlink is what it leads to, with its target; a dangling one is of no type.
        let l = "/l|symbolic link|4|777|lrwxrwxrwx|u|g|5|L|directory|750|L3R8ZA==";
        let l = entry_info(l).unwrap();
        assert_eq!(
            (
                l["type"].clone(),
                l["mode"].clone(),
                l["symlinkTarget"].clone()
            ),
            (json!("FILE_TYPE_DIRECTORY"), json!(0o750), json!("/t|d"))
        );
        assert_eq!(l["permissions"], "lrwxrwxrwx");
        let gone = entry_info("/g|symbolic link|4|777|lrwxrwxrwx|u|g|5|L|||").unwrap();
        assert_eq!(gone["type"], "FILE_TYPE_UNSPECIFIED");
        assert_eq!(gone.get("symlinkTarget"), None);
        assert_eq!(
            entry_info("/x|symbolic link|4|777|lrwxrwxrwx|u|g|5|Q|a|1|"),
            None
        );
    }
}

#[cfg(test)]
mod upload_tests {
    use std::io::Write;

    use super::*;

    fn packed(data: &[u8]) -> Vec<u8> {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(data).unwrap();
        gz.finish().unwrap()
    }

    fn in_chunks(bytes: Vec<u8>, size: usize) -> Chunks<'static> {
        let chunks: Vec<Result<Bytes, String>> = bytes
            .chunks(size)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        Box::pin(futures::stream::iter(chunks))
    }

    async fn all(chunks: Chunks<'_>) -> (Vec<Bytes>, Option<String>) {
        let mut out = Vec::new();
        let mut chunks = chunks;
        while let Some(c) = chunks.next().await {
            match c {
                Ok(b) => out.push(b),
                Err(e) => return (out, Some(e)),
            }
        }
        (out, None)
    }

    #[tokio::test]
    async fn a_gzip_body_unpacks_whole_from_chunks_of_any_size() {
        let data: Vec<u8> = (0..300_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect();
        for size in [1, 7, 1024, 65_536, 10 << 20] {
            let (out, error) = all(gunzip(in_chunks(packed(&data), size))).await;
            assert_eq!(error, None, "chunks of {size}");
            assert_eq!(out.concat(), data, "chunks of {size}");
        }
    }

    #[tokio::test]
    async fn a_gzip_bomb_unpacks_a_piece_at_a_time() {
        // 256 MiB of zeros packs into ~250 KiB: each piece of it unpacks to about 1 MiB.
        let zeros = vec![0u8; 256 << 20];
        let bomb = packed(&zeros);
        drop(zeros);
        assert!(bomb.len() < 1 << 20, "{}", bomb.len());
        let mut chunks = gunzip(in_chunks(bomb, 1 << 20));
        let (mut total, mut largest) = (0usize, 0usize);
        while let Some(c) = chunks.next().await {
            let c = c.unwrap();
            total += c.len();
            largest = largest.max(c.len());
        }
        assert_eq!(total, 256 << 20);
        assert!(largest <= 1_100_000, "a piece unpacked to {largest} bytes");
    }

    #[tokio::test]
    async fn a_cut_or_foreign_gzip_body_ends_with_an_error() {
        let packed = packed(b"hello, sandbox");
        let cut = packed[..packed.len() - 4].to_vec();
        let (_, error) = all(gunzip(in_chunks(cut, 5))).await;
        assert!(error.is_some_and(|e| e.contains("gzip")));
        let (_, error) = all(gunzip(in_chunks(b"not gzip at all".to_vec(), 4))).await;
        assert!(error.is_some_and(|e| e.contains("gzip")));
    }

    #[tokio::test]
    async fn an_upload_past_its_cap_ends_with_an_error_when_it_gets_there() {
        let (out, error) = all(capped(in_chunks(vec![1u8; 100], 30), 64)).await;
        assert_eq!(out.iter().map(Bytes::len).sum::<usize>(), 60);
        assert!(error.is_some_and(|e| e.contains("larger than 64 bytes")));
        let (out, error) = all(capped(in_chunks(vec![1u8; 64], 30), 64)).await;
        assert_eq!((out.concat().len(), error), (64, None));
    }
}

//! `sbx sandbox cp`: files and directory trees into and out of a sandbox, as a tar stream
//! over gRPC (`CopyToSandbox`, `CopyFromSandbox`), named as `docker cp` names them: into DEST
//! when it is an existing directory, else as DEST.
//!
//! Constant memory both ways: the local side packs or unpacks on a blocking thread
//! ([`sbx_archive`], the same code as inside the sandbox) connected to the gRPC
//! stream by a bounded channel of 64 KiB chunks. A download refuses entries that would leave
//! the local destination (`..`, absolute paths, paths through symlinks), so a hostile
//! sandbox cannot write outside it, and is unpacked as an untrusted archive
//! ([`sbx_archive::unpack_untrusted`]): no setuid-root program, device node, FIFO or hard
//! link to a file outside the copy, however `sbx` runs (root, in the README's tour).

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use clap::Args;
use futures::StreamExt;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    CopyFromSandboxRequest, CopyToSandboxInput, CopyToSandboxStart, SandboxRef,
    copy_to_sandbox_input,
};
use tokio::sync::mpsc;

use crate::CliError;
use crate::args::parse_name;
use crate::connect::{Channel, Target, connect};

#[derive(Debug, Clone, Args)]
pub struct SandboxCpArgs {
    /// The workspace of the sandbox named in NAME:/path (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// What to copy: a local path, or NAME:/path (absolute) in a sandbox.
    #[arg(value_name = "SRC", value_parser = parse_location)]
    pub src: Location,
    /// Where to: a local path, or NAME:/path in a sandbox (the other side of SRC).
    #[arg(value_name = "DST", value_parser = parse_location)]
    pub dst: Location,
    /// On a copy out, keep the modes the sandbox sent (sticky bits too, your umask not
    /// applied), as `tar --same-permissions` does; but setuid and setgid are dropped whenever
    /// you are root (euid or egid 0), so a copy out never makes a setuid-root program.
    /// Owners are never taken from the sandbox. A copy in keeps every mode bit anyway.
    #[arg(long)]
    pub preserve: bool,
}

/// `sbx sandbox cp`.
pub async fn run_cp(target: &Target, args: SandboxCpArgs) -> Result<u8, CliError> {
    let mut client = SandboxServiceClient::new(connect(target).await?);
    let modes = if args.preserve {
        sbx_archive::Modes::Preserve
    } else {
        sbx_archive::Modes::Umask
    };
    copy(&mut client, args.workspace, args.src, args.dst, modes).await
}

/// The chunk size of the local side of a copy.
const CHUNK: usize = 64 * 1024;

/// One side of a `cp`: a local path or `NAME:PATH` in a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    Local(PathBuf),
    Sandbox { name: String, path: String },
}

/// Parses a `cp` argument: `NAME:/path` is in a sandbox (the name as sandbox names are
/// written), anything else is local (`./a:b` is the local file `a:b`).
pub fn parse_location(arg: &str) -> Result<Location, CliError> {
    if let Some((name, path)) = arg.split_once(':')
        && !name.contains('/')
        && !name.is_empty()
    {
        sbx_proto::names::validate_name(name).map_err(|source| CliError::InvalidName { source })?;
        if !path.starts_with('/') {
            return Err(CliError::Usage(format!(
                "{arg}: the path in the sandbox must be absolute ({name}:/{path})"
            )));
        }
        return Ok(Location::Sandbox {
            name: name.to_string(),
            path: path.to_string(),
        });
    }
    Ok(Location::Local(PathBuf::from(arg)))
}

/// What `sbx sandbox create --upload LOCAL[:DEST]` copies in before the first start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upload {
    pub local: PathBuf,
    pub dest: String,
}

/// Where an upload goes when `--upload` names no destination.
pub const DEFAULT_UPLOAD_DEST: &str = "/sandbox";

/// Parses `--upload LOCAL[:DEST]`: DEST is what follows the last `:/` (an absolute path in
/// the sandbox), so a local name with a colon elsewhere (`./a:b`) stays whole.
pub fn parse_upload(arg: &str) -> Result<Upload, String> {
    let (local, dest) = match arg.rfind(":/") {
        Some(at) => (&arg[..at], &arg[at + 1..]),
        None => (arg, DEFAULT_UPLOAD_DEST),
    };
    if local.is_empty() {
        return Err(format!("{arg:?}: no local path before the ':'"));
    }
    Ok(Upload {
        local: PathBuf::from(local),
        dest: dest.to_string(),
    })
}

/// Copies `src` to `dst` (exactly one of them in a sandbox of `workspace`); a copy out keeps
/// modes as `modes` says.
pub async fn copy(
    client: &mut SandboxServiceClient<Channel>,
    workspace: Option<String>,
    src: Location,
    dst: Location,
    modes: sbx_archive::Modes,
) -> Result<u8, CliError> {
    let sandbox = |name: String| SandboxRef {
        id: String::new(),
        workspace: workspace.clone().unwrap_or_default(),
        name,
    };
    match (src, dst) {
        (Location::Local(from), Location::Sandbox { name, path }) => {
            upload(client, sandbox(name), &from, path).await
        }
        (Location::Sandbox { name, path }, Location::Local(to)) => {
            let from = format!("{name}:{path}");
            let done = download(client, sandbox(name), path, &to, modes).await?;
            if let Some(skipped) = done.skipped() {
                eprintln!(
                    "sbx: skipped {skipped} in {from}: a copy out makes no device node or FIFO"
                );
            }
            Ok(0)
        }
        (Location::Local(_), Location::Local(_)) => Err(CliError::Usage(
            "one side of a copy must be in a sandbox (NAME:/path)".into(),
        )),
        (Location::Sandbox { .. }, Location::Sandbox { .. }) => Err(CliError::Usage(
            "copying from one sandbox to another is not supported: copy through a local path"
                .into(),
        )),
    }
}

/// Bytes written, sent as chunks down a bounded channel (the blocking side of an upload).
struct ChannelWriter {
    tx: mpsc::Sender<Vec<u8>>,
    buf: Vec<u8>,
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = data.len().min(CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == CHUNK {
            self.flush()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
            self.tx
                .blocking_send(chunk)
                .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the copy was ended"))?;
        }
        Ok(())
    }
}

/// Copies local `from` into `sandbox` at `path`.
pub async fn upload(
    client: &mut SandboxServiceClient<Channel>,
    sandbox: SandboxRef,
    from: &Path,
    path: String,
) -> Result<u8, CliError> {
    std::fs::symlink_metadata(from).map_err(|e| CliError::LocalPath {
        path: from.to_path_buf(),
        source: e,
    })?;
    let (tx, rx) = mpsc::channel::<Vec<u8>>(8);
    let packing = {
        let from = from.to_path_buf();
        tokio::task::spawn_blocking(move || {
            let mut out = ChannelWriter {
                tx,
                buf: Vec::with_capacity(CHUNK),
            };
            sbx_archive::pack(&from, &mut out).and_then(|()| out.flush())
        })
    };
    let start = CopyToSandboxInput {
        input: Some(copy_to_sandbox_input::Input::Start(CopyToSandboxStart {
            sandbox: Some(sandbox),
            path,
        })),
    };
    let data = tokio_stream::wrappers::ReceiverStream::new(rx).map(|chunk| CopyToSandboxInput {
        input: Some(copy_to_sandbox_input::Input::Data(chunk)),
    });
    let messages = futures::stream::iter([start]).chain(data);
    let answer = client.copy_to_sandbox(messages).await;
    let packed = packing
        .await
        .map_err(|e| CliError::Internal(format!("the packing thread failed: {e}")))?;
    answer?;
    packed.map_err(|e| CliError::LocalPath {
        path: from.to_path_buf(),
        source: e,
    })?;
    Ok(0)
}

/// Chunks received from a bounded channel, as a byte stream (the blocking side of a
/// download).
struct ChannelReader {
    rx: mpsc::Receiver<Vec<u8>>,
    pending: Vec<u8>,
    at: usize,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.at == self.pending.len() {
            match self.rx.blocking_recv() {
                Some(chunk) => {
                    self.pending = chunk;
                    self.at = 0;
                }
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.pending.len() - self.at);
        buf[..n].copy_from_slice(&self.pending[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// Copies `path` in `sandbox` to local `to`, unpacked as an untrusted archive with `modes`.
async fn download(
    client: &mut SandboxServiceClient<Channel>,
    sandbox: SandboxRef,
    path: String,
    to: &Path,
    modes: sbx_archive::Modes,
) -> Result<sbx_archive::Unpacked, CliError> {
    let mut stream = client
        .copy_from_sandbox(CopyFromSandboxRequest {
            sandbox: Some(sandbox),
            path,
        })
        .await?
        .into_inner();
    let (tx, rx) = mpsc::channel::<Vec<u8>>(8);
    let unpacking = {
        let to = to.to_path_buf();
        tokio::task::spawn_blocking(move || {
            let input = ChannelReader {
                rx,
                pending: Vec::new(),
                at: 0,
            };
            sbx_archive::unpack_untrusted(input, &to, modes)
        })
    };
    let mut failed = None;
    loop {
        match stream.message().await {
            Ok(Some(chunk)) => {
                if tx.send(chunk.data).await.is_err() {
                    // The unpacking stopped (it refused an entry): its error says why.
                    break;
                }
            }
            Ok(None) => break,
            Err(status) => {
                failed = Some(status);
                break;
            }
        }
    }
    drop(tx);
    let unpacked = unpacking
        .await
        .map_err(|e| CliError::Internal(format!("the unpacking thread failed: {e}")))?;
    if let Some(status) = failed {
        return Err(CliError::Rpc(status));
    }
    unpacked.map_err(|e| CliError::LocalPath {
        path: to.to_path_buf(),
        source: e,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse_as_docker_cp_reads_them() {
        assert_eq!(
            parse_location("box:/sandbox/x").unwrap(),
            Location::Sandbox {
                name: "box".into(),
                path: "/sandbox/x".into()
            }
        );
        assert_eq!(
            parse_location("./a:b").unwrap(),
            Location::Local(PathBuf::from("./a:b"))
        );
        assert_eq!(
            parse_location("/tmp/x").unwrap(),
            Location::Local(PathBuf::from("/tmp/x"))
        );
        assert!(parse_location("box:relative").is_err());
        assert!(parse_location("Bad_Name:/x").is_err());
    }

    #[test]
    fn uploads_split_at_the_last_colon_before_an_absolute_path() {
        let up = |local: &str, dest: &str| Upload {
            local: PathBuf::from(local),
            dest: dest.to_string(),
        };
        assert_eq!(parse_upload("./app"), Ok(up("./app", "/sandbox")));
        assert_eq!(parse_upload("app:/srv/app"), Ok(up("app", "/srv/app")));
        assert_eq!(parse_upload("./a:b"), Ok(up("./a:b", "/sandbox")));
        assert_eq!(parse_upload("a:b:/x"), Ok(up("a:b", "/x")));
        assert!(parse_upload(":/x").is_err());
    }
}

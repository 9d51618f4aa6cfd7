//! Builders of image archives for tests (this crate's and its integration tests): layer tars
//! with any entry (hostile ones too), OCI image layouts and `docker save` archives, written the
//! way their tools write them.

use std::io::Write;
use std::path::Path;

use flate2::Compression as Level;
use serde_json::json;

use super::spec;

/// One tar entry, with its path and link target as raw bytes (so `..` and absolute paths can
/// be written, which `tar::Builder` refuses).
#[derive(Debug, Clone)]
pub struct TarEntry {
    pub path: Vec<u8>,
    pub kind: tar::EntryType,
    pub data: Vec<u8>,
    pub link: Vec<u8>,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub mtime: u64,
}

impl TarEntry {
    fn new(path: &str, kind: tar::EntryType, mode: u32) -> Self {
        TarEntry {
            path: path.as_bytes().to_vec(),
            kind,
            data: Vec::new(),
            link: Vec::new(),
            mode,
            uid: 0,
            gid: 0,
            mtime: 1_700_000_000,
        }
    }

    pub fn file(path: &str, data: &[u8]) -> Self {
        TarEntry {
            data: data.to_vec(),
            ..Self::new(path, tar::EntryType::Regular, 0o644)
        }
    }

    pub fn dir(path: &str) -> Self {
        Self::new(path, tar::EntryType::Directory, 0o755)
    }

    pub fn symlink(path: &str, target: &str) -> Self {
        TarEntry {
            link: target.as_bytes().to_vec(),
            ..Self::new(path, tar::EntryType::Symlink, 0o777)
        }
    }

    pub fn hardlink(path: &str, target: &str) -> Self {
        TarEntry {
            link: target.as_bytes().to_vec(),
            ..Self::new(path, tar::EntryType::Link, 0o644)
        }
    }

    pub fn special(path: &str, kind: tar::EntryType) -> Self {
        Self::new(path, kind, 0o644)
    }

    pub fn owner(mut self, uid: u64, gid: u64) -> Self {
        (self.uid, self.gid) = (uid, gid);
        self
    }

    pub fn mode(mut self, mode: u32) -> Self {
        self.mode = mode;
        self
    }
}

/// A tar of these entries, in this order.
pub fn tar_bytes(entries: &[TarEntry]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        {
            let gnu = h.as_gnu_mut().expect("a GNU header");
            gnu.name[..e.path.len()].copy_from_slice(&e.path);
            gnu.linkname[..e.link.len()].copy_from_slice(&e.link);
        }
        h.set_entry_type(e.kind);
        h.set_mode(e.mode);
        h.set_uid(e.uid);
        h.set_gid(e.gid);
        h.set_mtime(e.mtime);
        h.set_size(e.data.len() as u64);
        h.set_cksum();
        b.append(&h, &e.data[..]).expect("append to a Vec");
    }
    b.into_inner().expect("finish a Vec")
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), Level::default());
    e.write_all(bytes).expect("gzip to a Vec");
    e.finish().expect("gzip to a Vec")
}

pub fn zstd(bytes: &[u8]) -> Vec<u8> {
    zstd::stream::encode_all(bytes, 3).expect("zstd to a Vec")
}

pub fn sha256(bytes: &[u8]) -> String {
    spec::sha256_digest(bytes)
}

/// The image config of these uncompressed layers, with this `Cmd`.
pub fn config_json(layer_tars: &[Vec<u8>], cmd: &[&str]) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Env": [spec::DEFAULT_PATH], "Cmd": cmd, "Labels": { "fixture": "yes" } },
        "rootfs": { "type": "layers", "diff_ids": layer_tars.iter().map(|t| sha256(t)).collect::<Vec<_>>() },
    }))
    .expect("encode a config")
}

/// Writes an OCI image layout at `dir` holding one image of these layers (gzip-compressed
/// blobs), named `ref_name` in index.json. Returns the manifest digest.
pub fn write_oci_layout(dir: &Path, layer_tars: &[Vec<u8>], ref_name: &str) -> String {
    write_layout(dir, layer_tars, ref_name, true)
}

/// [`write_oci_layout`] with uncompressed layer blobs (which `skopeo copy` compresses in the
/// format it is told, where it keeps compressed ones as they are).
pub fn write_oci_layout_uncompressed(dir: &Path, layer_tars: &[Vec<u8>], ref_name: &str) -> String {
    write_layout(dir, layer_tars, ref_name, false)
}

/// [`write_oci_layout`] with the image config's `config` object given (Env, Cmd, WorkingDir,
/// User, …) instead of the fixture's `Cmd ["sh"]`.
pub fn write_oci_layout_with_config(
    dir: &Path,
    layer_tars: &[Vec<u8>],
    ref_name: &str,
    config: serde_json::Value,
) -> String {
    let bytes = serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": { "type": "layers", "diff_ids": layer_tars.iter().map(|t| sha256(t)).collect::<Vec<_>>() },
    }))
    .expect("encode a config");
    write_layout_of(dir, layer_tars, ref_name, true, &bytes)
}

fn write_layout(dir: &Path, layer_tars: &[Vec<u8>], ref_name: &str, gzipped: bool) -> String {
    write_layout_of(
        dir,
        layer_tars,
        ref_name,
        gzipped,
        &config_json(layer_tars, &["sh"]),
    )
}

fn write_layout_of(
    dir: &Path,
    layer_tars: &[Vec<u8>],
    ref_name: &str,
    gzipped: bool,
    config: &[u8],
) -> String {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).expect("create blobs/");
    let put = |bytes: &[u8]| {
        let digest = sha256(bytes);
        std::fs::write(blobs.join(&digest["sha256:".len()..]), bytes).expect("write a blob");
        (digest, bytes.len())
    };
    let (config_digest, config_size) = put(config);
    let layers: Vec<_> = layer_tars
        .iter()
        .map(|t| {
            let (media, (digest, size)) = if gzipped {
                (spec::LAYER_GZIP, put(&gzip(t)))
            } else {
                (spec::LAYER_TAR, put(t))
            };
            json!({ "mediaType": media, "digest": digest, "size": size })
        })
        .collect();
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": spec::OCI_MANIFEST,
        "config": { "mediaType": spec::OCI_CONFIG, "digest": config_digest, "size": config_size },
        "layers": layers,
    }))
    .expect("encode a manifest");
    let (manifest_digest, manifest_size) = put(&manifest);
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": spec::OCI_MANIFEST,
            "digest": manifest_digest,
            "size": manifest_size,
            "annotations": { spec::REF_NAME: ref_name },
        }],
    });
    std::fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&index).expect("encode index"),
    )
    .expect("write index.json");
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)
        .expect("write oci-layout");
    manifest_digest
}

/// A `docker save` archive (Docker before 25: `manifest.json`, `<id>.json`, `<id>/layer.tar`)
/// of one image of these (uncompressed) layers, tagged `tag`.
pub fn docker_archive(layer_tars: &[Vec<u8>], tag: &str) -> Vec<u8> {
    let config = config_json(layer_tars, &["sh"]);
    let config_name = format!("{}.json", &sha256(&config)["sha256:".len()..]);
    let mut files: Vec<(String, Vec<u8>)> = vec![(config_name.clone(), config)];
    let mut layer_paths = Vec::new();
    for (i, t) in layer_tars.iter().enumerate() {
        let path = format!("{:064x}/layer.tar", i + 1);
        files.push((path.clone(), t.clone()));
        layer_paths.push(path);
    }
    let manifest = json!([{ "Config": config_name, "RepoTags": [tag], "Layers": layer_paths }]);
    files.push((
        "manifest.json".into(),
        serde_json::to_vec(&manifest).expect("encode"),
    ));
    let entries: Vec<TarEntry> = files.iter().map(|(p, d)| TarEntry::file(p, d)).collect();
    tar_bytes(&entries)
}

/// A tar of the directory tree at `dir` (as `tar -C dir -cf - .` writes it).
pub fn tar_dir(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.append_dir_all(".", dir).expect("tar a directory");
    b.into_inner().expect("finish a Vec")
}

/// Writes an OCI image layout at `dir` of one image whose one gzip layer holds the file
/// `path`: `size` zero bytes, streamed (the tar is never held whole), so a few hundred KiB of
/// blob unpack to `size`. Returns the manifest digest.
pub fn write_oci_layout_of_zeros(dir: &Path, path: &str, size: u64, ref_name: &str) -> String {
    use sha2::{Digest as _, Sha256};
    /// Hashes what passes to the file, and counts it.
    struct Hashing<W> {
        inner: W,
        hasher: Sha256,
        len: u64,
    }
    impl<W: Write> Write for Hashing<W> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let n = self.inner.write(buf)?;
            self.hasher.update(&buf[..n]);
            self.len += n as u64;
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.inner.flush()
        }
    }
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).expect("create blobs/");
    let spooled = dir.join("layer.tmp");
    let file = std::fs::File::create(&spooled).expect("create the layer blob");
    let gz = flate2::write::GzEncoder::new(
        Hashing {
            inner: std::io::BufWriter::new(file),
            hasher: Sha256::new(),
            len: 0,
        },
        Level::default(),
    );
    let mut tar = Hashing {
        inner: gz,
        hasher: Sha256::new(),
        len: 0,
    };
    let mut header = tar::Header::new_gnu();
    header.set_path(path).expect("a tar path");
    header.set_size(size);
    header.set_mode(0o644);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    header.set_entry_type(tar::EntryType::Regular);
    header.set_cksum();
    tar.write_all(header.as_bytes()).expect("write the layer");
    let zeros = vec![0u8; 1 << 20];
    let mut left = size;
    while left > 0 {
        let n = left.min(zeros.len() as u64) as usize;
        tar.write_all(&zeros[..n]).expect("write the layer");
        left -= n as u64;
    }
    let pad = (512 - size % 512) % 512 + 1024;
    tar.write_all(&vec![0u8; pad as usize])
        .expect("write the layer");
    let diff_id = format!("sha256:{}", hex::encode(tar.hasher.finalize()));
    let mut blob = tar.inner.finish().expect("finish the gzip");
    blob.flush().expect("flush the layer blob");
    let layer_digest = format!("sha256:{}", hex::encode(blob.hasher.finalize()));
    std::fs::rename(&spooled, blobs.join(&layer_digest["sha256:".len()..]))
        .expect("rename the layer blob");
    let put = |bytes: &[u8]| {
        let digest = sha256(bytes);
        std::fs::write(blobs.join(&digest["sha256:".len()..]), bytes).expect("write a blob");
        (digest, bytes.len())
    };
    let config = serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Env": [spec::DEFAULT_PATH], "Cmd": ["sh"] },
        "rootfs": { "type": "layers", "diff_ids": [diff_id] },
    }))
    .expect("encode a config");
    let (config_digest, config_size) = put(&config);
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": spec::OCI_MANIFEST,
        "config": { "mediaType": spec::OCI_CONFIG, "digest": config_digest, "size": config_size },
        "layers": [{ "mediaType": spec::LAYER_GZIP, "digest": layer_digest, "size": blob.len }],
    }))
    .expect("encode a manifest");
    let (manifest_digest, manifest_size) = put(&manifest);
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": spec::OCI_MANIFEST,
            "digest": manifest_digest,
            "size": manifest_size,
            "annotations": { spec::REF_NAME: ref_name },
        }],
    });
    std::fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&index).expect("encode index"),
    )
    .expect("write index.json");
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)
        .expect("write oci-layout");
    manifest_digest
}

/// Debian's `docker-registry` (distribution 2.8) serving on 127.0.0.1 at a free port, with its
/// storage in a temp dir, for pull tests; filled with [`LocalRegistry::push`] (skopeo). Ended,
/// by its pid, when dropped.
#[derive(Debug)]
pub struct LocalRegistry {
    child: std::process::Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
}

impl Drop for LocalRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `program` is on PATH.
pub fn have(program: &str) -> bool {
    std::process::Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl LocalRegistry {
    /// Whether the tools are here: `docker-registry` and `skopeo`. Under CI (`CI` set) their
    /// absence is a failure, not a skip: CI installs them.
    pub fn available(test: &str) -> bool {
        let there = have("docker-registry") && have("skopeo");
        if !there {
            assert!(
                std::env::var_os("CI").is_none(),
                "{test}: CI must install the Debian packages docker-registry and skopeo"
            );
            println!("SKIP {test}: install the Debian packages docker-registry and skopeo");
        }
        there
    }

    /// Starts a registry keeping its files under `dir`; waits (at most 20 s) until it listens.
    pub fn start(dir: &Path) -> LocalRegistry {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let addr = format!("127.0.0.1:{port}");
        let storage = dir.join("storage");
        std::fs::create_dir_all(&storage).expect("registry storage");
        let config = dir.join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
                storage.display()
            ),
        )
        .expect("registry config");
        let log = std::fs::File::create(dir.join("registry.log")).expect("registry log");
        let child = std::process::Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(log.try_clone().expect("registry log"))
            .stderr(log)
            .spawn()
            .expect("docker-registry starts");
        let registry = LocalRegistry { child, addr };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::net::TcpStream::connect(&registry.addr).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "docker-registry did not listen on {} within 20 s: {}",
                registry.addr,
                std::fs::read_to_string(dir.join("registry.log")).unwrap_or_default()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        registry
    }

    /// `skopeo copy` of the OCI layout at `layout` (tag `v1`) to `dest` (`ADDR/NAME:TAG`),
    /// with `extra` skopeo flags.
    pub fn push(&self, layout: &Path, dest: &str, extra: &[&str]) {
        let out = std::process::Command::new("skopeo")
            .args(["--insecure-policy", "copy", "--dest-tls-verify=false"])
            .args(extra)
            .arg(format!("oci:{}:v1", layout.display()))
            .arg(format!("docker://{dest}"))
            .output()
            .expect("skopeo runs");
        assert!(out.status.success(), "skopeo copy to {dest}: {out:?}");
    }
}

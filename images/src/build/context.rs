//! COPY and ADD: a layer made from the build context (a tar the client sent, spooled to a
//! file), without running anything. The entries a source names are written under the
//! destination as Docker places them: a directory's contents into the destination, a file as
//! the destination (or into it, when it ends in `/` or several sources are copied). Owners are
//! root's unless `--chown` names numeric ids; `--chmod` sets the mode of every entry copied.
//! Sources are paths inside the context (`..` cannot leave it); `*`, `?` and `[…]` match
//! within one path component.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{BuildError, Result};

/// A directory on the destination's way, as the parent image has it (None: it has none).
pub type ParentDir = Option<crate::MergedEntry>;

/// One COPY, its words expanded.
#[derive(Debug, Clone)]
pub struct CopySpec {
    pub sources: Vec<String>,
    /// Absolute (a relative one is joined to WORKDIR by the caller).
    pub dest: String,
    pub uid: u32,
    pub gid: u32,
    pub mode: Option<u32>,
}

/// Parses `--chown=UID[:GID]` (numeric: names would need the image's /etc/passwd).
pub fn chown(value: &str) -> Result<(u32, u32)> {
    let (u, g) = value.split_once(':').unwrap_or((value, value));
    match (u.parse(), g.parse()) {
        (Ok(u), Ok(g)) => Ok((u, g)),
        _ => Err(BuildError::Invalid(format!(
            "--chown={value}: give numeric ids (UID[:GID]); names are not looked up"
        ))),
    }
}

/// Parses `--chmod=OCTAL`.
pub fn chmod(value: &str) -> Result<u32> {
    u32::from_str_radix(value, 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| {
            BuildError::Invalid(format!("--chmod={value}: give an octal mode such as 755"))
        })
}

/// A path inside the context as components (`.` and empty ones dropped); None when it
/// leaves the context.
fn context_path(given: &str) -> Option<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    for c in Path::new(given.trim_start_matches('/')).components() {
        match c {
            Component::Normal(p) => out.push(p.to_string_lossy().into_owned()),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir => {
                out.pop()?;
            }
            Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// One piece of a component's pattern.
enum Tok {
    Char(char),
    Any,
    Star,
    Class(Vec<(char, char)>, bool),
}

fn tokens(pattern: &[char]) -> Vec<Tok> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < pattern.len() {
        match pattern[i] {
            '*' => out.push(Tok::Star),
            '?' => out.push(Tok::Any),
            '[' => match pattern[i + 1..].iter().position(|p| *p == ']') {
                Some(len) if len > 0 => {
                    let set = &pattern[i + 1..i + 1 + len];
                    let (negate, set) = match set.first() {
                        Some('!' | '^') => (true, &set[1..]),
                        _ => (false, set),
                    };
                    let mut ranges = Vec::new();
                    let mut j = 0;
                    while j < set.len() {
                        if j + 2 < set.len() && set[j + 1] == '-' {
                            ranges.push((set[j], set[j + 2]));
                            j += 3;
                        } else {
                            ranges.push((set[j], set[j]));
                            j += 1;
                        }
                    }
                    out.push(Tok::Class(ranges, negate));
                    i += len + 1;
                }
                _ => out.push(Tok::Char('[')),
            },
            c => out.push(Tok::Char(c)),
        }
        i += 1;
    }
    out
}

/// `*`, `?` and `[…]` within one component, matched in linear passes (the last `*` is the
/// only point a mismatch goes back to: no pattern makes it exponential).
fn glob(pattern: &[char], name: &[char]) -> bool {
    let toks = tokens(pattern);
    let one = |t: &Tok, c: char| match t {
        Tok::Char(p) => *p == c,
        Tok::Any => true,
        Tok::Class(ranges, negate) => ranges.iter().any(|(a, b)| *a <= c && c <= *b) != *negate,
        Tok::Star => false,
    };
    let (mut t, mut n) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        if t < toks.len() && matches!(toks[t], Tok::Star) {
            star = Some((t, n));
            t += 1;
        } else if t < toks.len() && one(&toks[t], name[n]) {
            t += 1;
            n += 1;
        } else if let Some((st, sn)) = star {
            t = st + 1;
            n = sn + 1;
            star = Some((st, sn + 1));
        } else {
            return false;
        }
    }
    toks[t..].iter().all(|t| matches!(t, Tok::Star))
}

fn matches(pattern: &[String], path: &[String]) -> bool {
    pattern.len() <= path.len()
        && pattern.iter().zip(path).all(|(p, n)| {
            let p: Vec<char> = p.chars().collect();
            let n: Vec<char> = n.chars().collect();
            glob(&p, &n)
        })
}

/// What the context holds: every entry's path and whether it is a directory (read once).
pub struct Context {
    path: PathBuf,
    entries: Vec<(Vec<String>, bool)>,
}

/// An entry's path in the context tar, as text.
fn entry_name<R: Read>(entry: &tar::Entry<'_, R>) -> Result<String> {
    Ok(entry
        .path()
        .map_err(bad_context)?
        .to_string_lossy()
        .into_owned())
}

fn bad_context(e: impl std::fmt::Display) -> BuildError {
    BuildError::Invalid(format!("the build context is not a readable tar: {e}"))
}

impl Context {
    pub fn index(path: &Path) -> Result<Context> {
        let file = File::open(path).map_err(bad_context)?;
        let mut archive = tar::Archive::new(std::io::BufReader::new(file));
        let mut entries = Vec::new();
        for entry in archive.entries().map_err(bad_context)? {
            let entry = entry.map_err(bad_context)?;
            let name = entry_name(&entry)?;
            let Some(parts) = context_path(&name) else {
                return Err(bad_context(format!("{name:?} leaves the context")));
            };
            if parts.is_empty() {
                continue;
            }
            entries.push((parts, entry.header().entry_type().is_dir()));
        }
        Ok(Context {
            path: path.to_path_buf(),
            entries,
        })
    }

    /// An empty context (no COPY can find anything).
    pub fn empty() -> Context {
        Context {
            path: PathBuf::new(),
            entries: Vec::new(),
        }
    }

    /// Writes the layer of `copy` to `out`. `parent_dir` says what each ancestor of the
    /// destination is in the parent image, so the layer keeps them as they are. Answers the
    /// digest of what the layer holds, without times: a fresh checkout of the same files keeps
    /// the cache (Docker's rule).
    pub fn copy_layer(
        &self,
        copy: &CopySpec,
        parent_dir: &dyn Fn(&str) -> Result<ParentDir>,
        out: &Path,
    ) -> Result<String> {
        let roots = self.roots(copy)?;
        // `/dst/`, `.` (WORKDIR), `/dst/.` and a directory the image has name a directory, as
        // they do for Docker.
        let names_dir = copy.dest.ends_with('/') || copy.dest.ends_with("/.") || copy.dest == ".";
        // Normal form (no trailing `/`, no `.`): the lookups and the written set agree.
        let dest: PathBuf = Path::new(&copy.dest).components().collect();
        let is_dir = dest != Path::new("/")
            && parent_dir(&dest.to_string_lossy())?.is_some_and(|e| e.is_dir);
        let into_dir = names_dir || is_dir || roots.len() > 1 || roots.iter().any(|r| r.1);
        let placing = Placing {
            roots,
            dest,
            into_dir,
        };

        refuse_whiteout_name(&placing.dest)?;
        let file = File::create_new(out)
            .map_err(|e| BuildError::Internal(format!("creating the COPY layer: {e}")))?;
        let mut tar = tar::Builder::new(BufWriter::new(file));
        let mut written = dest_dirs(&mut tar, copy, &placing, parent_dir)?;
        let content = self.copy_entries(&mut tar, copy, &placing, &mut written)?;
        tar.into_inner()
            .and_then(|mut w| w.flush().map(|_| w))
            .and_then(|w| w.into_inner().map_err(|e| e.into_error()))
            .and_then(|f| f.sync_all())
            .map_err(io)?;
        // The directories written first are the parent image's: its digest is in the key.
        Ok(hex::encode(content.finalize()))
    }

    /// Which context paths each source names (a pattern may name several), and whether each
    /// is a directory.
    fn roots(&self, copy: &CopySpec) -> Result<Vec<(Vec<String>, bool)>> {
        let mut roots: Vec<(Vec<String>, bool)> = Vec::new();
        for source in &copy.sources {
            let Some(pattern) = context_path(source) else {
                return Err(BuildError::Invalid(format!(
                    "COPY {source}: the source leaves the build context"
                )));
            };
            let before = roots.len();
            if pattern.is_empty() {
                roots.push((Vec::new(), true));
            } else {
                for (path, is_dir) in &self.entries {
                    if path.len() == pattern.len() && matches(&pattern, path) {
                        roots.push((path.clone(), *is_dir));
                    }
                }
                // A directory the tar only implies (its entries, but no entry of its own).
                if roots.len() == before
                    && self
                        .entries
                        .iter()
                        .any(|(p, _)| p.len() > pattern.len() && matches(&pattern, p))
                {
                    roots.push((pattern.clone(), true));
                }
            }
            if roots.len() == before {
                return Err(BuildError::Invalid(format!(
                    "COPY {source}: no such file or directory in the build context"
                )));
            }
        }
        Ok(roots)
    }

    /// Each entry of the context a source names, written where it lands (once per path);
    /// the digest of what was written.
    fn copy_entries<W: Write>(
        &self,
        tar: &mut tar::Builder<W>,
        copy: &CopySpec,
        placing: &Placing,
        written: &mut BTreeSet<PathBuf>,
    ) -> Result<Sha256> {
        let source = File::open(&self.path).map_err(bad_context)?;
        let mut archive = tar::Archive::new(std::io::BufReader::new(source));
        // Each entry: its path, kind, mode, owner, then its bytes.
        let mut content = Sha256::new();
        for entry in archive.entries().map_err(bad_context)? {
            let mut entry = entry.map_err(bad_context)?;
            let name = entry_name(&entry)?;
            let Some(parts) = context_path(&name) else {
                continue;
            };
            let Some(target) = placing.place(&parts) else {
                continue;
            };
            // The destination directory itself is written above; a path twice, once.
            if target == Path::new("/") || !written.insert(target.clone()) {
                continue;
            }
            refuse_whiteout_name(&target)?;
            copy_entry(tar, copy, &mut entry, &name, &target, &mut content)?;
        }
        Ok(content)
    }
}

/// Where a COPY's sources land.
struct Placing {
    /// The context paths the sources name, and whether each is a directory.
    roots: Vec<(Vec<String>, bool)>,
    /// The destination, in normal form.
    dest: PathBuf,
    /// Whether the sources go into the destination (else a single file becomes it).
    into_dir: bool,
}

impl Placing {
    /// Where a context path lands (None: not copied).
    fn place(&self, path: &[String]) -> Option<PathBuf> {
        for (root, is_dir) in &self.roots {
            if path.len() >= root.len() && path[..root.len()] == root[..] {
                let rest = &path[root.len()..];
                return Some(match (is_dir, self.into_dir) {
                    (true, _) => rest.iter().fold(self.dest.clone(), |d, p| d.join(p)),
                    (false, true) => self.dest.join(root.last().map_or("", |s| s.as_str())),
                    (false, false) => self.dest.clone(),
                });
            }
        }
        None
    }
}

/// A failed write of the layer.
fn io(e: std::io::Error) -> BuildError {
    BuildError::Internal(format!("writing the COPY layer: {e}"))
}

/// The destination's ancestors (and itself when it is a directory), as the parent image has
/// them, or root's 0755 where it has none; the paths written.
fn dest_dirs<W: Write>(
    tar: &mut tar::Builder<W>,
    copy: &CopySpec,
    placing: &Placing,
    parent_dir: &dyn Fn(&str) -> Result<ParentDir>,
) -> Result<BTreeSet<PathBuf>> {
    let mut written: BTreeSet<PathBuf> = BTreeSet::new();
    let mut dirs: Vec<PathBuf> = placing.dest.ancestors().map(Path::to_path_buf).collect();
    dirs.reverse();
    if !placing.into_dir {
        dirs.pop();
    }
    for dir in dirs.into_iter().filter(|d| d != Path::new("/")) {
        let shown = dir.to_string_lossy().into_owned();
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_size(0);
        match parent_dir(&shown)? {
            Some(e) if !e.is_dir => {
                return Err(BuildError::Invalid(format!(
                    "COPY to {}: {shown} is a file in the image, not a directory",
                    copy.dest
                )));
            }
            Some(e) => {
                h.set_mode(e.mode);
                h.set_uid(e.uid.into());
                h.set_gid(e.gid.into());
                h.set_mtime(e.mtime.max(0) as u64);
            }
            None => {
                h.set_mode(0o755);
                h.set_uid(0);
                h.set_gid(0);
                h.set_mtime(0);
            }
        }
        tar.append_data(&mut h, relative(&dir), std::io::empty())
            .map_err(io)?;
        written.insert(dir);
    }
    Ok(written)
}

/// One context entry written at `target` with the COPY's owner and mode, and noted in
/// `content`: a directory, a regular file (its bytes hashed as they are copied) or a
/// symlink; any other kind is refused.
fn copy_entry<W: Write, R: Read>(
    tar: &mut tar::Builder<W>,
    copy: &CopySpec,
    entry: &mut tar::Entry<'_, R>,
    name: &str,
    target: &Path,
    content: &mut Sha256,
) -> Result<()> {
    let kind = entry.header().entry_type();
    let mut h = tar::Header::new_gnu();
    h.set_uid(copy.uid.into());
    h.set_gid(copy.gid.into());
    h.set_mtime(entry.header().mtime().unwrap_or(0));
    let mode = entry.header().mode().unwrap_or(0o644) & 0o7777;
    h.set_mode(copy.mode.unwrap_or(mode));
    note(
        content,
        &[
            target.to_string_lossy().as_bytes(),
            &[kind.as_byte()],
            &copy.mode.unwrap_or(mode).to_be_bytes(),
            &copy.uid.to_be_bytes(),
            &copy.gid.to_be_bytes(),
        ],
    );
    match kind {
        tar::EntryType::Directory => {
            h.set_entry_type(tar::EntryType::Directory);
            h.set_size(0);
            tar.append_data(&mut h, relative(target), std::io::empty())
                .map_err(io)?;
        }
        tar::EntryType::Regular | tar::EntryType::Continuous => {
            let size = entry.header().size().map_err(bad_context)?;
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(size);
            content.update(size.to_be_bytes());
            let data = Hashing {
                inner: entry.take(size),
                ctx: content,
            };
            tar.append_data(&mut h, relative(target), data)
                .map_err(io)?;
        }
        tar::EntryType::Symlink => {
            let link = entry
                .link_name_bytes()
                .ok_or_else(|| bad_context(format!("symlink {name:?} has no target")))?
                .into_owned();
            note(content, &[&link]);
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            h.set_mode(0o777);
            // Byte for byte (`append_link` would make `/` into `//`); a long target through
            // the GNU long-link entry.
            if link.len() <= 100 {
                h.set_link_name_literal(&link).map_err(io)?;
                tar.append_data(&mut h, relative(target), std::io::empty())
            } else {
                use std::os::unix::ffi::OsStrExt;
                let link = Path::new(std::ffi::OsStr::from_bytes(&link));
                tar.append_link(&mut h, relative(target), link)
            }
            .map_err(io)?;
        }
        other => {
            return Err(BuildError::Invalid(format!(
                "COPY: {name:?} in the build context is a {other:?} entry; only files, \
                 directories and symlinks are copied"
            )));
        }
    }
    Ok(())
}

/// Refuses a path with a component a layer reads as a deletion: `.wh.NAME` deletes NAME,
/// `.wh..wh..opq` hides a directory's lower contents (the OCI layer format; a RUN's changes
/// are refused alike by the oci driver).
fn refuse_whiteout_name(path: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    match path.components().any(|c| match c {
        Component::Normal(n) => n.as_bytes().starts_with(b".wh."),
        _ => false,
    }) {
        true => Err(BuildError::Invalid(format!(
            "COPY to {}: a name beginning with .wh. is how a layer says a file was deleted, \
             so a layer cannot hold it (rename it)",
            path.display()
        ))),
        false => Ok(()),
    }
}

/// Adds `parts` to a digest, each after its length (no two lists hash alike).
fn note(ctx: &mut Sha256, parts: &[&[u8]]) {
    for p in parts {
        ctx.update((p.len() as u64).to_be_bytes());
        ctx.update(p);
    }
}

/// A reader that adds what it reads to a digest.
struct Hashing<'a, R> {
    inner: R,
    ctx: &'a mut Sha256,
}

impl<R: Read> Read for Hashing<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.ctx.update(&buf[..n]);
        Ok(n)
    }
}

fn relative(path: &Path) -> PathBuf {
    path.strip_prefix("/").unwrap_or(path).to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar_of(entries: &[(&str, Option<&[u8]>)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, data) in entries {
            let mut h = tar::Header::new_gnu();
            match data {
                Some(d) => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(d.len() as u64);
                    h.set_mode(0o640);
                    b.append_data(&mut h, path, *d).unwrap();
                }
                None => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    h.set_mode(0o750);
                    b.append_data(&mut h, path, std::io::empty()).unwrap();
                }
            }
        }
        b.into_inner().unwrap()
    }

    /// (path, is_dir, mode, uid) of every entry of a layer.
    fn listing(layer: &Path) -> Vec<(String, bool, u32, u64)> {
        let mut a = tar::Archive::new(File::open(layer).unwrap());
        a.entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.path().unwrap().to_string_lossy().into_owned(),
                    e.header().entry_type().is_dir(),
                    e.header().mode().unwrap(),
                    e.header().uid().unwrap(),
                )
            })
            .collect()
    }

    fn layer(
        entries: &[(&str, Option<&[u8]>)],
        copy: CopySpec,
    ) -> Result<Vec<(String, bool, u32, u64)>> {
        let dir = tempfile::tempdir().unwrap();
        let ctx = dir.path().join("ctx.tar");
        std::fs::write(&ctx, tar_of(entries)).unwrap();
        let context = Context::index(&ctx)?;
        let out = dir.path().join("layer.tar");
        let tmp_exists = |p: &str| -> Result<ParentDir> {
            Ok((p == "/tmp").then_some(crate::MergedEntry {
                is_dir: true,
                mode: 0o1777,
                uid: 0,
                gid: 0,
                mtime: 1,
            }))
        };
        context.copy_layer(&copy, &tmp_exists, &out)?;
        Ok(listing(&out))
    }

    fn spec(sources: &[&str], dest: &str) -> CopySpec {
        CopySpec {
            sources: sources.iter().map(|s| s.to_string()).collect(),
            dest: dest.into(),
            uid: 0,
            gid: 0,
            mode: None,
        }
    }

    #[test]
    fn a_file_lands_as_the_destination_or_in_it() {
        let ctx = [
            ("app.py", Some(&b"print(1)"[..])),
            ("lib/", None),
            ("lib/x.py", Some(b"x")),
        ];
        let got = layer(&ctx, spec(&["app.py"], "/srv/main.py")).unwrap();
        assert_eq!(
            got.iter().map(|e| e.0.as_str()).collect::<Vec<_>>(),
            ["srv", "srv/main.py"]
        );
        // `.` after WORKDIR is the directory itself.
        let got = layer(&ctx, spec(&["app.py"], "/srv/.")).unwrap();
        assert_eq!(
            got.iter().map(|e| e.0.as_str()).collect::<Vec<_>>(),
            ["srv", "srv/app.py"]
        );
        let got = layer(&ctx, spec(&["app.py"], "/tmp/")).unwrap();
        // The parent image's /tmp is kept as it is (1777), not made 0755.
        assert_eq!(got[0], ("tmp".into(), true, 0o1777, 0));
        assert_eq!(got[1].0, "tmp/app.py");
        assert_eq!(got[1].2, 0o640);
    }

    #[test]
    fn a_directory_copies_its_contents_and_patterns_match_one_component() {
        let ctx = [
            ("app.py", Some(&b"1"[..])),
            ("b.py", Some(b"2")),
            ("lib/", None),
            ("lib/x.py", Some(b"x")),
            ("README", Some(b"r")),
        ];
        let got = layer(&ctx, spec(&["lib"], "/opt/lib")).unwrap();
        let names: Vec<_> = got.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(names, ["opt", "opt/lib", "opt/lib/x.py"]);
        let got = layer(&ctx, spec(&["*.py"], "/app")).unwrap();
        let names: Vec<_> = got.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(names, ["app", "app/app.py", "app/b.py"]);
        let mut copy = spec(&["."], "/w");
        copy.uid = 1000;
        copy.mode = Some(0o700);
        let got = layer(&ctx, copy).unwrap();
        assert!(
            got.iter()
                .any(|e| e.0 == "w/lib/x.py" && e.3 == 1000 && e.2 == 0o700)
        );
    }

    #[test]
    fn a_destination_the_image_has_as_a_directory_is_copied_into() {
        // `/tmp` is a directory in the parent image: `COPY app.py /tmp` puts it inside.
        let ctx = [("app.py", Some(&b"1"[..]))];
        let got = layer(&ctx, spec(&["app.py"], "/tmp")).unwrap();
        assert_eq!(
            got.iter().map(|e| e.0.as_str()).collect::<Vec<_>>(),
            ["tmp", "tmp/app.py"]
        );
    }

    #[test]
    fn patterns_match_in_linear_time_with_classes() {
        let g = |p: &str, n: &str| {
            glob(
                &p.chars().collect::<Vec<_>>(),
                &n.chars().collect::<Vec<_>>(),
            )
        };
        assert!(g("*.py", "app.py") && !g("*.py", "app.pyc"));
        assert!(g("a?c", "abc") && !g("a?c", "ac"));
        assert!(g("[a-c]x", "bx") && !g("[!a-c]x", "bx") && g("[^a-c]x", "dx"));
        assert!(g("*", "") && g("**", "x") && !g("?", ""));
        assert!(g("[x", "[x"), "an unclosed class is a plain bracket");
        // What backtracking at every star would take ages over.
        let name = "a".repeat(5000);
        let started = std::time::Instant::now();
        assert!(!g("*a*a*a*a*a*a*a*a*a*a*b", &name));
        assert!(
            started.elapsed() < std::time::Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_name_a_layer_reads_as_a_deletion_is_not_copied() {
        let ctx = [
            ("a", Some(&b"1"[..])),
            (".wh.passwd", Some(&b""[..])),
            ("conf/", None),
            ("conf/.wh..wh..opq", Some(&b""[..])),
        ];
        for (sources, dest, named) in [
            (&[".wh.passwd"][..], "/etc/", "/etc/.wh.passwd"),
            (&["conf"][..], "/etc/", "/etc/.wh..wh..opq"),
            (&["a"][..], "/etc/.wh.group", "/etc/.wh.group"),
            (&["a"][..], "/.wh.etc/x", "/.wh.etc/x"),
        ] {
            let e = layer(&ctx, spec(sources, dest)).unwrap_err().to_string();
            assert!(
                e.contains(&format!("COPY to {named}: a name beginning with .wh.")),
                "{sources:?} to {dest}: {e}"
            );
        }
        // A name that only holds `.wh.` further on is a name like any other.
        let got = layer(&ctx, spec(&["a"], "/etc/a.wh.b")).unwrap();
        assert_eq!(got.last().map(|e| e.0.as_str()), Some("etc/a.wh.b"));
    }

    #[test]
    fn sources_outside_or_missing_are_refused() {
        let ctx = [("a", Some(&b"1"[..]))];
        let e = layer(&ctx, spec(&["../etc/passwd"], "/x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("leaves the build context"), "{e}");
        let e = layer(&ctx, spec(&["nope"], "/x")).unwrap_err().to_string();
        assert!(
            e.contains("no such file or directory in the build context"),
            "{e}"
        );
        assert!(chown("app").is_err());
        assert_eq!(chown("1:2").unwrap(), (1, 2));
        assert_eq!(chmod("0755").unwrap(), 0o755);
        assert!(chmod("9").is_err());
    }
}

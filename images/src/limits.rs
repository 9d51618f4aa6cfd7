//! How large an image the store takes. A pull or import is hostile input: a gzip layer of a few
//! megabytes can expand to tens of gigabytes, a layer can hold millions of empty files, a
//! manifest can claim any size and any number of layers. Each is checked before the store
//! writes what it would cost: the manifest's layer count and claimed sizes before anything is
//! fetched, the bytes a registry sends against what the manifest claimed, and each entry of
//! each layer — its bytes and one 4 KiB block for the entry itself, so empty files count — as
//! it is unpacked, against one budget for the whole image. What was refused is removed (the
//! actors collect the blobs an add left once it failed).
//!
//! A layer an image build writes (a RUN's changes, streamed from the driver) is paid for the
//! same way before it reaches the disk: [`LayerMeter`] reads each tar header as the stream
//! passes and takes the entry's size from the image's budget before any byte of its data is
//! written. A sparse file is its apparent size there (`truncate -s 20G` costs the sandbox
//! nothing and is 20 GiB of zeros in a tar), so it is refused from its header alone. Every
//! unpack reads its layer through a meter too (an unlimited one: the unpack pays per entry
//! itself), for the bound on extension entries the `tar` crate would read whole into memory.
//!
//! **Free disk.** The limits bound one image; the store's filesystem bounds them all. Every
//! add — a blob downloaded or copied, an entry unpacked, a build's layer written, an upload
//! spooled — takes what it is about to write from a [`Room`] first, which refuses it
//! ([`ImageError::NoRoom`], naming the free space, the entry and the flag) when it would leave
//! less than `--image-min-free` ([`MinFree`]: by default 10% of the filesystem or 2 GiB,
//! whichever is smaller) free. A 5 MB gzip that says "5 GiB of zeros" is refused from its
//! tar header, before its data is written; the store's other writes (its records, the next
//! image, a sandbox's layer) go on. The free space is read (`statvfs`, about a microsecond)
//! every 8 MiB or 256 entries an add writes, and at every write once it is within 64 MiB of
//! the line, so concurrent adds overshoot it by at most that much each.

use std::path::PathBuf;

use tokio_util::sync::CancellationToken;

use super::ImageError;

/// What one image may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// The most layers (`sbxd serve --image-max-layers`; Docker's limit is 127).
    pub max_layers: usize,
    /// The most bytes its layers unpack to, and its manifest may claim (`--image-max-size`).
    pub max_size: u64,
    /// The most entries (files, directories, links) its layers hold (`--image-max-files`).
    pub max_files: u64,
    /// What every add leaves free on the store's filesystem (`--image-min-free`).
    pub min_free: MinFree,
}

impl Default for ImageLimits {
    fn default() -> Self {
        ImageLimits {
            max_layers: 127,
            max_size: 20 << 30,
            max_files: 500_000,
            min_free: MinFree::default(),
        }
    }
}

/// How much of the store's filesystem an add must leave free (`--image-min-free`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MinFree {
    /// This many bytes (0: none; the filesystem may fill).
    Bytes(u64),
    /// This share of the filesystem's size, in percent, and at most `cap` bytes.
    Share { percent: u8, cap: u64 },
}

impl Default for MinFree {
    /// 10% of the filesystem or 2 GiB, whichever is smaller.
    fn default() -> Self {
        MinFree::Share {
            percent: 10,
            cap: 2 << 30,
        }
    }
}

impl MinFree {
    /// The bytes to keep free on a filesystem of `size` bytes.
    pub fn bytes(&self, size: u64) -> u64 {
        match *self {
            MinFree::Bytes(b) => b,
            MinFree::Share { percent, cap } => {
                (u128::from(size) * u128::from(percent) / 100).min(u128::from(cap)) as u64
            }
        }
    }

    /// `10%` (a share of the filesystem) or a size (`2Gi`, `500M`, `0`).
    pub fn parse(text: &str) -> Result<MinFree, String> {
        if let Some(pct) = text.trim().strip_suffix('%') {
            return match pct.trim().parse::<u8>() {
                Ok(p) if p <= 90 => Ok(MinFree::Share {
                    percent: p,
                    cap: u64::MAX,
                }),
                _ => Err(format!(
                    "{text:?}: a share is 0% to 90% of the image store's filesystem"
                )),
            };
        }
        sbx_proto::quantity::size_arg(text).map(MinFree::Bytes)
    }
}

impl std::fmt::Display for MinFree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            MinFree::Bytes(b) => f.write_str(&sbx_proto::quantity::human_bytes(b)),
            MinFree::Share { percent, cap } if cap == u64::MAX => write!(f, "{percent}%"),
            MinFree::Share { percent, cap } => write!(
                f,
                "{percent}% or {}, whichever is smaller",
                sbx_proto::quantity::human_bytes(cap)
            ),
        }
    }
}

/// How often an add reads the free space: after this many bytes written…
const LOOK_EVERY_BYTES: u64 = 8 << 20;
/// …or this many entries…
const LOOK_EVERY_ENTRIES: u32 = 256;
/// …and at every write once it may be this close to the line.
const NEAR_THE_LINE: u64 = 64 << 20;

/// The free space of the store's filesystem as one add writes to it (see the module docs).
#[derive(Debug)]
pub struct Room {
    image: String,
    root: PathBuf,
    min_free: MinFree,
    /// What was free at the last look (None: not looked yet), the line then, and what this
    /// add has taken since.
    seen: Option<(u64, u64)>,
    since: u64,
    entries_since: u32,
}

impl Room {
    pub(crate) fn new(image: &str, root: PathBuf, min_free: MinFree) -> Room {
        Room {
            image: image.to_string(),
            root,
            min_free,
            seen: None,
            since: 0,
            entries_since: 0,
        }
    }

    /// The filesystem's free bytes (as `df` says "Avail") and its size.
    fn look(&self) -> Result<(u64, u64), ImageError> {
        let st = nix::sys::statvfs::statvfs(&self.root).map_err(|e| {
            ImageError::io(
                &self.image,
                "read the free space of the image store",
                e.into(),
            )
        })?;
        let unit = st.fragment_size();
        Ok((
            st.blocks_available().saturating_mul(unit),
            st.blocks().saturating_mul(unit),
        ))
    }

    /// `bytes` more, about to be written for `what` (an entry's path, a blob): refused when
    /// they would leave less than the minimum free.
    pub fn take(&mut self, bytes: u64, what: &str) -> Result<(), ImageError> {
        self.entries_since += 1;
        let stale = match self.seen {
            None => true,
            Some((free, line)) => {
                self.since >= LOOK_EVERY_BYTES
                    || self.entries_since >= LOOK_EVERY_ENTRIES
                    || free.saturating_sub(self.since)
                        < line.saturating_add(bytes).saturating_add(NEAR_THE_LINE)
            }
        };
        if !stale {
            self.since += bytes;
            return Ok(());
        }
        let (free, size) = self.look()?;
        let line = self.min_free.bytes(size);
        self.seen = Some((free, line));
        self.entries_since = 0;
        self.since = 0;
        if free < line.saturating_add(bytes) {
            let human = sbx_proto::quantity::human_bytes;
            return Err(ImageError::NoRoom {
                image: self.image.clone(),
                why: format!(
                    "the image store's filesystem has {} free; {what} ({}) would leave less \
                     than the {} that --image-min-free ({}) keeps free",
                    human(free),
                    human(bytes),
                    human(line),
                    self.min_free
                ),
            });
        }
        self.since = bytes;
        Ok(())
    }
}

/// What an entry costs besides its bytes: one block for its inode and directory entry.
pub const ENTRY_COST: u64 = 4096;

impl ImageLimits {
    /// The manifest's layers: their count and the sizes they claim.
    pub fn check_manifest(&self, image: &str, sizes: &[u64]) -> Result<(), ImageError> {
        self.check_layers(image, sizes.len())?;
        let claimed = sizes.iter().fold(0u64, |sum, s| sum.saturating_add(*s));
        if claimed > self.max_size {
            return Err(self.too_large(
                image,
                format!(
                    "its manifest claims {} of layers",
                    sbx_proto::quantity::human_bytes(claimed)
                ),
                self.size_limit(),
            ));
        }
        Ok(())
    }

    /// How many layers an image has (a `docker save` archive claims no sizes).
    pub fn check_layers(&self, image: &str, layers: usize) -> Result<(), ImageError> {
        if layers > self.max_layers {
            return Err(self.too_large(
                image,
                format!("its manifest lists {layers} layers"),
                format!("{} layers, --image-max-layers", self.max_layers),
            ));
        }
        Ok(())
    }

    fn size_limit(&self) -> String {
        format!(
            "{}, --image-max-size",
            sbx_proto::quantity::human_bytes(self.max_size)
        )
    }

    fn too_large(&self, image: &str, why: String, limit: String) -> ImageError {
        ImageError::TooLarge {
            image: image.to_string(),
            why,
            limit,
        }
    }

    /// A fresh budget for one image (no free-space check and no cancel: see
    /// [`Budget::watching`]).
    pub fn budget(&self, image: &str) -> Budget {
        Budget {
            image: image.to_string(),
            limits: *self,
            bytes: 0,
            files: 0,
            room: None,
            cancel: None,
        }
    }
}

/// What an image's layers have cost so far, as they are unpacked.
#[derive(Debug)]
pub struct Budget {
    image: String,
    limits: ImageLimits,
    bytes: u64,
    files: u64,
    /// The store's free space, taken from before each entry is written.
    room: Option<Room>,
    /// Ends the add at its next entry.
    cancel: Option<CancellationToken>,
}

impl Budget {
    /// No limit: the built-in image, made from the host's own busybox.
    pub fn unlimited(image: &str) -> Budget {
        ImageLimits {
            max_layers: usize::MAX,
            max_size: u64::MAX,
            max_files: u64::MAX,
            min_free: MinFree::Bytes(0),
        }
        .budget(image)
    }

    /// This budget, also taking every entry from `room` and ending once `cancel` is.
    pub fn watching(mut self, room: Room, cancel: CancellationToken) -> Budget {
        self.room = Some(room);
        self.cancel = Some(cancel);
        self
    }

    /// The token that ends the add (an unpack checks it between reads too).
    pub fn cancel_token(&self) -> Option<&CancellationToken> {
        self.cancel.as_ref()
    }

    /// One more entry of `size` bytes, refused (before it is written) past the limits.
    pub fn take(&mut self, size: u64) -> Result<(), ImageError> {
        self.take_entry(size, None)
    }

    /// [`Budget::take`] for the entry at `path` (the free-space refusal names it).
    pub fn take_at(&mut self, path: &str, size: u64) -> Result<(), ImageError> {
        self.take_entry(size, Some(path))
    }

    fn take_entry(&mut self, size: u64, path: Option<&str>) -> Result<(), ImageError> {
        self.counted(size)?;
        if self.cancel.as_ref().is_some_and(|c| c.is_cancelled()) {
            return Err(ImageError::Cancelled {
                image: self.image.clone(),
            });
        }
        if let Some(room) = &mut self.room {
            room.take(
                size.saturating_add(ENTRY_COST),
                path.unwrap_or("the next entry"),
            )?;
        }
        Ok(())
    }

    /// The count and size limits of one more entry of `size` bytes.
    fn counted(&mut self, size: u64) -> Result<(), ImageError> {
        self.files += 1;
        if self.files > self.limits.max_files {
            return Err(self.limits.too_large(
                &self.image,
                format!(
                    "its layers hold more than {} entries",
                    self.limits.max_files
                ),
                format!("{} files, --image-max-files", self.limits.max_files),
            ));
        }
        self.spend(size.saturating_add(ENTRY_COST), "unpack to")
    }

    /// [`Budget::take`] for the entry at `path`, the refusal naming it.
    pub fn take_named(&mut self, path: &str, size: u64) -> Result<(), ImageError> {
        self.take_entry(size, Some(path)).map_err(|e| match e {
            ImageError::TooLarge { image, why, limit } => ImageError::TooLarge {
                image,
                why: format!(
                    "{path} is {} (its apparent size: a sparse file counts whole), and {why}",
                    sbx_proto::quantity::human_bytes(size)
                ),
                limit,
            },
            e => e,
        })
    }

    /// A layer already in the store (unpacked for another image): its compressed size counts,
    /// a lower bound of what it takes.
    pub fn take_cached(&mut self, size: u64) -> Result<(), ImageError> {
        self.spend(size, "take")
    }

    /// `bytes` more, refused past the size limit ("its layers `verb` more than …").
    fn spend(&mut self, bytes: u64, verb: &str) -> Result<(), ImageError> {
        self.bytes = self.bytes.saturating_add(bytes);
        if self.bytes > self.limits.max_size {
            return Err(self.limits.too_large(
                &self.image,
                format!(
                    "its layers {verb} more than {}",
                    sbx_proto::quantity::human_bytes(self.limits.max_size)
                ),
                self.limits.size_limit(),
            ));
        }
        Ok(())
    }
}

/// The tar block: headers and data are padded to it.
const BLOCK: u64 = 512;
/// The longest data of a GNU long-name or PAX entry: names and a few records, never more.
const MAX_EXTENSION: u64 = 1 << 20;

/// The most extension blocks of an old GNU sparse entry's map (86,016 holes and chunks).
const MAX_SPARSE_BLOCKS: u64 = 4096;

/// An entry's path as the sandbox sees it: `/dir/name`.
fn shown_path(name: &[u8]) -> String {
    let name = String::from_utf8_lossy(name);
    format!("/{}", name.trim_start_matches("./").trim_end_matches('/'))
}

/// Pays for an uncompressed layer tar as it streams past (see the module docs): feed it each
/// chunk before writing it. Its own small tar reader (a header at a time, across chunks)
/// follows the stream as `tar::Archive` does (the first zero block ends the archive; GNU
/// long names and PAX records name and size the entry after them), so what it pays for is
/// what an unpack later reads.
#[derive(Debug)]
pub struct LayerMeter {
    budget: Budget,
    /// The header being read.
    header: Vec<u8>,
    /// Bytes of the current entry's data and padding still to pass.
    data_left: u64,
    /// The current entry's data, kept: a long name's or PAX records' (`kept_len` of it).
    kept: Option<(tar::EntryType, Vec<u8>)>,
    kept_len: u64,
    /// What extension entries said of the entry after them.
    next_name: Option<Vec<u8>>,
    next_size: Option<u64>,
    /// Extension blocks of an old GNU sparse entry's map still to come (their count so far),
    /// then its stored data (padded).
    sparse_map: Option<u64>,
    sparse_data: u64,
    /// Bytes after the end-of-archive block.
    trailer: u64,
    ended: bool,
}

impl LayerMeter {
    pub fn new(budget: Budget) -> LayerMeter {
        LayerMeter {
            budget,
            header: Vec::with_capacity(BLOCK as usize),
            data_left: 0,
            kept: None,
            kept_len: 0,
            next_name: None,
            next_size: None,
            sparse_map: None,
            sparse_data: 0,
            trailer: 0,
            ended: false,
        }
    }

    fn malformed(&self, why: impl std::fmt::Display) -> ImageError {
        ImageError::malformed(&self.budget.image, format!("the layer tar: {why}"))
    }

    /// Takes `chunk`, the stream's next bytes: Err (and nothing of `chunk` may be written)
    /// when an entry it starts is past the budget, or the stream is not a tar.
    pub fn feed(&mut self, mut chunk: &[u8]) -> Result<(), ImageError> {
        while !chunk.is_empty() {
            if self.ended {
                // The end-of-archive blocks and a writer's padding: a few KiB, never more.
                self.trailer += chunk.len() as u64;
                if self.trailer > MAX_EXTENSION {
                    return Err(self.malformed("more than 1 MiB after its end"));
                }
                return Ok(());
            }
            if self.data_left > 0 {
                let n = self.data_left.min(chunk.len() as u64) as usize;
                if let Some((_, data)) = &mut self.kept {
                    let want = (self.kept_len as usize).saturating_sub(data.len()).min(n);
                    data.extend_from_slice(&chunk[..want]);
                }
                self.data_left -= n as u64;
                chunk = &chunk[n..];
                if self.data_left == 0 {
                    self.extension_done()?;
                }
                continue;
            }
            let n = (BLOCK as usize - self.header.len()).min(chunk.len());
            self.header.extend_from_slice(&chunk[..n]);
            chunk = &chunk[n..];
            if self.header.len() == BLOCK as usize {
                let block = std::mem::replace(&mut self.header, Vec::with_capacity(BLOCK as usize));
                match self.sparse_map {
                    Some(count) => self.sparse_block(&block, count)?,
                    None => self.entry(&block)?,
                }
            }
        }
        Ok(())
    }

    /// A whole header block.
    fn entry(&mut self, block: &[u8]) -> Result<(), ImageError> {
        if block.iter().all(|b| *b == 0) {
            if self.next_name.is_some() || self.next_size.is_some() {
                return Err(self.malformed("an extension entry describes no entry"));
            }
            self.ended = true;
            return Ok(());
        }
        let header = tar::Header::from_byte_slice(block);
        let sum = block[..148]
            .iter()
            .chain(&block[156..])
            .fold(8 * 32u32, |a, b| a + u32::from(*b));
        if header.cksum().ok() != Some(sum) {
            return Err(self.malformed("a header's checksum does not match"));
        }
        let kind = header.entry_type();
        let size = header
            .entry_size()
            .map_err(|e| self.malformed(format!("a header's size: {e}")))?;
        let padded = |size: u64| size.div_ceil(BLOCK).checked_mul(BLOCK);
        // As `tar::Archive`: only a GNU or ustar header is an extension's.
        let extension = header.as_gnu().is_some() || header.as_ustar().is_some();
        match kind {
            tar::EntryType::GNULongName
            | tar::EntryType::GNULongLink
            | tar::EntryType::XHeader
            | tar::EntryType::XGlobalHeader
                if extension =>
            {
                if size > MAX_EXTENSION {
                    return Err(self.malformed(format!(
                        "a {kind:?} entry of {size} bytes (at most {MAX_EXTENSION})"
                    )));
                }
                // Its header block too: every byte that passes is paid for.
                self.budget.take_cached(size + BLOCK)?;
                if kind == tar::EntryType::XGlobalHeader {
                    // `tar::Archive` hands it out as an entry: what was said before it was
                    // said of it.
                    self.next_name = None;
                    self.next_size = None;
                }
                self.kept = matches!(kind, tar::EntryType::GNULongName | tar::EntryType::XHeader)
                    .then(|| (kind, Vec::with_capacity(size as usize)));
                self.kept_len = size;
                self.data_left = size.div_ceil(BLOCK) * BLOCK;
                if self.data_left == 0 {
                    self.extension_done()?;
                }
                Ok(())
            }
            // An old GNU sparse entry: what it unpacks to is its real size; its stored data
            // follows the blocks of its sparse map that do not fit in the header.
            tar::EntryType::GNUSparse => {
                let Some(gnu) = header.as_gnu() else {
                    return Err(self.malformed("a GNU sparse entry without a GNU header"));
                };
                let real = gnu
                    .real_size()
                    .map_err(|e| self.malformed(format!("a sparse entry's size: {e}")))?;
                let stored = self.next_size.take().unwrap_or(size);
                let name = self
                    .next_name
                    .take()
                    .unwrap_or_else(|| header.path_bytes().into_owned());
                let shown = shown_path(&name);
                self.budget.take_named(&shown, real.max(stored))?;
                let data = padded(stored).ok_or_else(|| self.malformed("a size past u64"))?;
                match gnu.is_extended() {
                    true => {
                        self.sparse_map = Some(0);
                        self.sparse_data = data;
                    }
                    false => self.data_left = data,
                }
                Ok(())
            }
            _ => {
                let size = self.next_size.take().unwrap_or(size);
                let name = self
                    .next_name
                    .take()
                    .unwrap_or_else(|| header.path_bytes().into_owned());
                self.budget.take_named(&shown_path(&name), size)?;
                self.data_left = padded(size).ok_or_else(|| self.malformed("a size past u64"))?;
                Ok(())
            }
        }
    }

    /// One more block of a sparse entry's map (`count` before it); its last says so.
    fn sparse_block(&mut self, block: &[u8], count: u64) -> Result<(), ImageError> {
        if count >= MAX_SPARSE_BLOCKS {
            return Err(self.malformed(format!(
                "a sparse map of more than {MAX_SPARSE_BLOCKS} blocks"
            )));
        }
        self.budget.take_cached(BLOCK)?;
        // `isextended`, after the block's 21 (offset, length) pairs.
        if block[504] != 0 {
            self.sparse_map = Some(count + 1);
        } else {
            self.sparse_map = None;
            self.data_left = std::mem::take(&mut self.sparse_data);
        }
        Ok(())
    }

    /// The data of a long-name or PAX entry has passed: what it says of the next entry.
    fn extension_done(&mut self) -> Result<(), ImageError> {
        let Some((kind, data)) = self.kept.take() else {
            return Ok(());
        };
        if kind == tar::EntryType::GNULongName {
            let name = data.split(|b| *b == 0).next().unwrap_or_default().to_vec();
            self.next_name = Some(name);
            return Ok(());
        }
        for record in tar::PaxExtensions::new(&data) {
            let record = record.map_err(|e| self.malformed(format!("a PAX record: {e}")))?;
            match record.key() {
                Ok("size") => {
                    let size = record
                        .value()
                        .ok()
                        .and_then(|v| v.parse::<u64>().ok())
                        .ok_or_else(|| self.malformed("a PAX size that is not a number"))?;
                    self.next_size = Some(size);
                }
                Ok("path") => self.next_name = Some(record.value_bytes().to_vec()),
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn a_budget_counts_bytes_and_entries_and_names_the_limit() {
        let limits = ImageLimits {
            max_layers: 2,
            max_size: 3 * ENTRY_COST,
            max_files: 2,
            min_free: MinFree::default(),
        };
        let mut b = limits.budget("img");
        b.take(0).unwrap();
        b.take(ENTRY_COST).unwrap();
        let e = b.take(0).unwrap_err().to_string();
        assert!(e.contains("--image-max-files"), "{e}");
        let mut b = limits.budget("img");
        let e = b.take(3 * ENTRY_COST).unwrap_err().to_string();
        assert!(e.contains("--image-max-size"), "{e}");
        let e = limits
            .check_manifest("img", &[1, 1, 1])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("3 layers") && e.contains("--image-max-layers"),
            "{e}"
        );
        let e = limits
            .check_manifest("img", &[1_000_000_000_000_000])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("claims") && e.contains("--image-max-size"),
            "{e}"
        );
        limits.check_manifest("img", &[10, 20]).unwrap();
    }

    /// A PAX record, its length counted in.
    fn pax_record(key: &str, value: &str) -> Vec<u8> {
        let body = format!(" {key}={value}\n");
        let mut len = body.len() + 1;
        while format!("{len}{body}").len() != len {
            len += 1;
        }
        format!("{len}{body}").into_bytes()
    }

    fn header(path: &str, kind: tar::EntryType, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_path(path).unwrap();
        h.set_mode(0o644);
        h.set_size(size);
        h.set_cksum();
        h
    }

    fn limits(max_size: u64) -> ImageLimits {
        ImageLimits {
            max_layers: 127,
            max_size,
            max_files: 1000,
            min_free: MinFree::default(),
        }
    }

    /// Feeds `tar` in chunks of `step` bytes; the error, and how many bytes had passed before
    /// the chunk it came with.
    fn meter(limit: u64, tar: &[u8], step: usize) -> Result<(), (ImageError, usize)> {
        let mut m = LayerMeter::new(limits(limit).budget("img"));
        let mut passed = 0;
        for chunk in tar.chunks(step) {
            m.feed(chunk).map_err(|e| (e, passed))?;
            passed += chunk.len();
        }
        Ok(())
    }

    #[test]
    fn a_layer_meter_pays_for_each_entry_from_its_header_before_its_data() {
        // Files, a directory, a link and a long name, in any chunking: within the budget.
        let mut b = tar::Builder::new(Vec::new());
        let long = format!("dir/{}", "n".repeat(150));
        for (path, data) in [
            ("dir/", &b""[..]),
            ("dir/a", &[7u8; 1000][..]),
            (long.as_str(), &[1u8; 3000][..]),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(match path.ends_with('/') {
                true => tar::EntryType::Directory,
                false => tar::EntryType::Regular,
            });
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            b.append_data(&mut h, path, data).unwrap();
        }
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        h.set_mode(0o777);
        b.append_link(&mut h, "dir/l", "/etc/shadow").unwrap();
        let fine = b.into_inner().unwrap();
        for step in [1, 7, 511, 512, 4096, fine.len()] {
            meter(10 * ENTRY_COST, &fine, step).unwrap_or_else(|e| panic!("{step}: {:?}", e.0));
        }
        // Less room: the long-named file is refused by name, before its data passes.
        let (e, passed) = meter(4 * ENTRY_COST, &fine, 512).unwrap_err();
        let e = e.to_string();
        assert!(e.contains(&format!("/{long} is 2.9KiB")), "{e}");
        assert!(e.contains("--image-max-size"), "{e}");
        let header_at = fine
            .windows(long.len())
            .rposition(|w| w == long.as_bytes())
            .unwrap();
        assert!(passed <= header_at + 512, "{passed} bytes passed");

        // A sparse file's header: 20 GiB, refused from the header alone.
        let big = header("big", tar::EntryType::Regular, 20 << 30);
        let (e, passed) = meter(20 << 30, big.as_bytes(), 512).unwrap_err();
        let e = e.to_string();
        assert_eq!(passed, 0);
        assert!(
            e.contains("/big is 20.0GiB (its apparent size")
                && e.contains("(the limit: 20.0GiB, --image-max-size)"),
            "{e}"
        );

        // A PAX size is the entry's size, whatever its header says; a PAX path names it.
        let mut pax = pax_record("size", &(30u64 << 20).to_string());
        pax.extend(pax_record("path", "pax/named"));
        let mut tar = Vec::new();
        let mut x = header("PaxHeaders/x", tar::EntryType::XHeader, pax.len() as u64);
        x.set_cksum();
        tar.extend_from_slice(x.as_bytes());
        tar.extend_from_slice(&pax);
        tar.resize(tar.len().div_ceil(512) * 512, 0);
        tar.extend_from_slice(header("short", tar::EntryType::Regular, 0).as_bytes());
        let e = meter(16 << 20, &tar, 100).unwrap_err().0.to_string();
        assert!(e.contains("/pax/named is 30.0MiB"), "{e}");
    }

    #[test]
    fn a_layer_meter_pays_for_a_gnu_sparse_entry_by_its_real_size_and_reads_past_its_map() {
        // 8 MiB apparent, 40 chunks of data: a sparse map longer than its header holds.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse");
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(8 << 20).unwrap();
        for i in 0..40u64 {
            use std::os::unix::fs::FileExt;
            file.write_all_at(&[1u8; 4096], i * (128 << 10)).unwrap();
        }
        let mut b = tar::Builder::new(Vec::new());
        b.sparse(true);
        b.append_path_with_name(&path, "sparse").unwrap();
        let mut h = header("after", tar::EntryType::Regular, 3 << 20);
        h.set_cksum();
        b.append(&h, std::io::repeat(0).take(3 << 20)).unwrap();
        let tar = b.into_inner().unwrap();
        let first = tar::Header::from_byte_slice(&tar[..512]);
        assert_eq!(first.entry_type(), tar::EntryType::GNUSparse);
        assert!(first.as_gnu().unwrap().is_extended());
        for step in [1, 100, 512, 1 << 16] {
            meter(16 << 20, &tar, step).unwrap_or_else(|e| panic!("{step}: {:?}", e.0));
        }
        // Its real size is what it costs.
        let e = meter(4 << 20, &tar, 512).unwrap_err().0.to_string();
        assert!(e.contains("/sparse is 8.0MiB"), "{e}");
        // Past its map and data, the next header is read where it is.
        let e = meter(10 << 20, &tar, 512).unwrap_err().0.to_string();
        assert!(e.contains("/after is 3.0MiB"), "{e}");
    }

    #[test]
    fn a_layer_meter_refuses_what_is_not_a_layer_tar() {
        let mut bad = header("f", tar::EntryType::Regular, 0);
        bad.as_mut_bytes()[0] = b'g';
        let e = meter(1 << 20, bad.as_bytes(), 512)
            .unwrap_err()
            .0
            .to_string();
        assert!(e.contains("checksum"), "{e}");
        let name = header("././@LongLink", tar::EntryType::GNULongName, 2 << 20);
        let e = meter(1 << 40, name.as_bytes(), 512)
            .unwrap_err()
            .0
            .to_string();
        assert!(e.contains("at most 1048576"), "{e}");
        // After the end: a writer's zero blocks, not gigabytes of anything.
        let mut tail = vec![0u8; 1024];
        meter(1 << 20, &tail, 300).unwrap();
        tail.resize(3 << 20, 0);
        let e = meter(1 << 20, &tail, 1 << 16).unwrap_err().0.to_string();
        assert!(e.contains("after its end"), "{e}");
    }
}

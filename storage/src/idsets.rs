//! Sets of ids under a key (what an owner owns, who refers to a record), kept so that a
//! transaction can read and change them: sled's transactional trees answer exact keys only,
//! never a range, so a set cannot be one key per member.
//!
//! A set is chunked: `key (16)` holds the number of chunks (u32), `key (16) · index (u32)`
//! holds up to [`CHUNK`] ids (16 bytes each). Adding appends to the last chunk (or opens a new
//! one), so adding the 10,000th member writes one 4 KiB chunk, not a 160 KiB list (schema
//! version 2 kept one list per owner, rewritten on every add: 10,000 settings of one sandbox
//! wrote ~800 MB). Removing a member rewrites the one chunk that holds it; a chunk left empty is
//! removed, and the head shrinks when the last chunks are gone. Reading a set reads every
//! chunk. No IO here beyond the tree handed in.

use sled::transaction::{ConflictableTransactionError, TransactionalTree};
use uuid::Uuid;

use crate::error::StoreError;
use crate::layout::{decode_id_list, encode_id_list};

/// The most ids in one chunk.
pub(crate) const CHUNK: usize = 256;

type TxResult<T> = Result<T, ConflictableTransactionError<StoreError>>;

fn chunk_key(key: Uuid, index: u32) -> [u8; 20] {
    let mut out = [0u8; 20];
    out[..16].copy_from_slice(key.as_bytes());
    out[16..].copy_from_slice(&index.to_be_bytes());
    out
}

fn decode_head(raw: &[u8], what: &str) -> Result<u32, StoreError> {
    let arr: [u8; 4] = raw.try_into().map_err(|_| {
        StoreError::Corrupt(format!(
            "{what} head of {} bytes, expected 4 (a chunk count)",
            raw.len()
        ))
    })?;
    Ok(u32::from_be_bytes(arr))
}

/// Reads a whole set through `get` (a plain tree or a transactional one).
fn read_set(
    key: Uuid,
    what: &str,
    mut get: impl FnMut(&[u8]) -> Result<Option<sled::IVec>, StoreError>,
) -> Result<Vec<Uuid>, StoreError> {
    let Some(head) = get(key.as_bytes())? else {
        return Ok(Vec::new());
    };
    let chunks = decode_head(&head, what)?;
    let mut out = Vec::new();
    for index in 0..chunks {
        if let Some(raw) = get(&chunk_key(key, index))? {
            out.extend(decode_id_list(&raw)?);
        }
    }
    Ok(out)
}

/// Every member of the set under `key`, in the order they were added (outside a transaction).
pub(crate) fn members(tree: &sled::Tree, key: Uuid, what: &str) -> Result<Vec<Uuid>, StoreError> {
    read_set(key, what, |k| Ok(tree.get(k)?))
}

/// Whether a key of a set tree is a head (16 bytes: the set's key) or a chunk (20 bytes), and
/// whose: for `verify_indexes`.
pub(crate) enum SetEntry {
    Head(Uuid),
    Chunk(Uuid, u32),
    Malformed,
}

pub(crate) fn classify(key: &[u8]) -> SetEntry {
    match key.len() {
        16 => SetEntry::Head(Uuid::from_slice(key).expect("16 bytes")),
        20 => SetEntry::Chunk(
            Uuid::from_slice(&key[..16]).expect("16 bytes"),
            u32::from_be_bytes(key[16..].try_into().expect("4 bytes")),
        ),
        _ => SetEntry::Malformed,
    }
}

/// The sets of one tree, inside a write transaction.
pub(crate) struct TxSets<'a> {
    pub tree: &'a TransactionalTree,
    /// What the sets are, for errors ("owner index").
    pub what: &'static str,
}

fn abort<T>(e: StoreError) -> TxResult<T> {
    Err(ConflictableTransactionError::Abort(e))
}

impl TxSets<'_> {
    fn head(&self, key: Uuid) -> TxResult<u32> {
        match self.tree.get(key.as_bytes())? {
            Some(raw) => decode_head(&raw, self.what).or_else(abort),
            None => Ok(0),
        }
    }

    fn set_head(&self, key: Uuid, chunks: u32) -> TxResult<()> {
        if chunks == 0 {
            self.tree.remove(key.as_bytes())?;
        } else {
            self.tree
                .insert(key.as_bytes(), chunks.to_be_bytes().as_slice())?;
        }
        Ok(())
    }

    fn chunk(&self, key: Uuid, index: u32) -> TxResult<Vec<Uuid>> {
        match self.tree.get(chunk_key(key, index))? {
            Some(raw) => decode_id_list(&raw).or_else(abort),
            None => Ok(Vec::new()),
        }
    }

    fn set_chunk(&self, key: Uuid, index: u32, ids: &[Uuid]) -> TxResult<()> {
        if ids.is_empty() {
            self.tree.remove(&chunk_key(key, index))?;
        } else {
            self.tree
                .insert(&chunk_key(key, index), encode_id_list(ids))?;
        }
        Ok(())
    }

    /// Every member of the set under `key`.
    pub fn members(&self, key: Uuid) -> TxResult<Vec<Uuid>> {
        let what = self.what;
        read_set(key, what, |k| {
            self.tree
                .get(k)
                .map_err(|e| StoreError::Io(format!("{what}: {e}")))
        })
        .or_else(abort)
    }

    /// Adds `id` to the set under `key` (the caller knows it is not a member yet).
    pub fn add(&self, key: Uuid, id: Uuid) -> TxResult<()> {
        let chunks = self.head(key)?;
        if chunks > 0 {
            let last = chunks - 1;
            let mut ids = self.chunk(key, last)?;
            if ids.len() < CHUNK {
                ids.push(id);
                return self.set_chunk(key, last, &ids);
            }
        }
        self.set_chunk(key, chunks, &[id])?;
        self.set_head(key, chunks + 1)
    }

    /// Removes `id` from the set under `key`; false when it was not a member.
    pub fn remove(&self, key: Uuid, id: Uuid) -> TxResult<bool> {
        let chunks = self.head(key)?;
        for index in 0..chunks {
            let mut ids = self.chunk(key, index)?;
            let Some(at) = ids.iter().position(|m| *m == id) else {
                continue;
            };
            ids.remove(at);
            self.set_chunk(key, index, &ids)?;
            // Trailing empty chunks go, and with the last one the head.
            let mut kept = chunks;
            while kept > 0 && self.tree.get(chunk_key(key, kept - 1))?.is_none() {
                kept -= 1;
            }
            if kept != chunks {
                self.set_head(key, kept)?;
            }
            return Ok(true);
        }
        Ok(false)
    }

    /// Removes the whole set under `key`.
    pub fn clear(&self, key: Uuid) -> TxResult<()> {
        let chunks = self.head(key)?;
        for index in 0..chunks {
            self.tree.remove(&chunk_key(key, index))?;
        }
        self.set_head(key, 0)
    }
}

/// Writes the set `ids` under `key` into a plain tree from scratch (for migrations and
/// restores, which build the index outside a transaction first).
pub(crate) fn chunked(key: Uuid, ids: &[Uuid]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut out = Vec::new();
    let chunks = ids.chunks(CHUNK);
    let count = chunks.len() as u32;
    for (index, part) in chunks.enumerate() {
        out.push((chunk_key(key, index as u32).to_vec(), encode_id_list(part)));
    }
    if count > 0 {
        out.push((key.as_bytes().to_vec(), count.to_be_bytes().to_vec()));
    }
    out
}

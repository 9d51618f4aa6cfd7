//! The on-disk layout: tree names, key encodings and the list cursor. No IO here.
//!
//! Every multi-byte integer in a key is big-endian so that sled's byte order is numeric order.
//!
//! | tree        | key                                          | value                         |
//! |-------------|----------------------------------------------|-------------------------------|
//! | `records`   | id (16)                                      | prost `RecordEnvelope`        |
//! | `names`     | kind tag (1) · owner, else workspace id, else nil (16) · name | id (16)      |
//! | `owners`    | owner id (16) [· chunk (4)]                  | chunk count / owned ids (`idsets.rs`) |
//! | `refs`      | record id (16) [· chunk (4)]                 | chunk count / referrer ids    |
//! | `order_all` | kind tag (1) · created_at_ms (8) · id (16)   | empty                         |
//! | `order_ws`  | workspace id (16) · kind tag (1) · created_at_ms (8) · id (16) | empty       |
//! | `ws_counts` | workspace id (16)                            | u64: records scoped in it     |
//! | `meta`      | `schema_version` / `revision`                | u32 / u64                     |

use uuid::Uuid;

use crate::error::StoreError;
use crate::kind::Kind;

pub const TREE_RECORDS: &str = "records";
pub const TREE_NAMES: &str = "names";
pub const TREE_OWNERS: &str = "owners";
pub const TREE_REFS: &str = "refs";
pub const TREE_ORDER_ALL: &str = "order_all";
pub const TREE_ORDER_WS: &str = "order_ws";
pub const TREE_WS_COUNTS: &str = "ws_counts";
pub const TREE_META: &str = "meta";

/// Meta key of the schema version (u32, big-endian).
pub const META_SCHEMA_VERSION: &[u8] = b"schema_version";
/// Meta key of the global revision (u64, big-endian): the highest resource version assigned.
pub const META_REVISION: &[u8] = b"revision";

pub fn record_key(id: Uuid) -> [u8; 16] {
    *id.as_bytes()
}

/// `scope`: where the name is unique (`Record::name_scope`).
pub fn name_key(kind: Kind, scope: Option<Uuid>, name: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(17 + name.len());
    key.push(kind.tag());
    key.extend_from_slice(scope.unwrap_or(Uuid::nil()).as_bytes());
    key.extend_from_slice(name.as_bytes());
    key
}

pub fn order_all_key(kind: Kind, created_at_ms: u64, id: Uuid) -> [u8; 25] {
    let mut key = [0u8; 25];
    key[0] = kind.tag();
    key[1..9].copy_from_slice(&created_at_ms.to_be_bytes());
    key[9..].copy_from_slice(id.as_bytes());
    key
}

pub fn order_ws_key(workspace: Uuid, kind: Kind, created_at_ms: u64, id: Uuid) -> [u8; 41] {
    let mut key = [0u8; 41];
    key[..16].copy_from_slice(workspace.as_bytes());
    key[16..].copy_from_slice(&order_all_key(kind, created_at_ms, id));
    key
}

/// The `(created_at_ms, id)` at the end of an order-index key of either tree.
pub fn order_key_position(key: &[u8]) -> Result<(u64, Uuid), StoreError> {
    if key.len() < 24 {
        return Err(StoreError::Corrupt(format!(
            "order index key of {} bytes, expected at least 24",
            key.len()
        )));
    }
    let tail = &key[key.len() - 24..];
    let created = u64::from_be_bytes(tail[..8].try_into().expect("8 bytes"));
    let id = Uuid::from_slice(&tail[8..]).expect("16 bytes");
    Ok((created, id))
}

pub fn encode_u64(v: u64) -> [u8; 8] {
    v.to_be_bytes()
}

pub fn decode_u64(bytes: &[u8], what: &str) -> Result<u64, StoreError> {
    let arr: [u8; 8] = bytes
        .try_into()
        .map_err(|_| StoreError::Corrupt(format!("{what} is {} bytes, expected 8", bytes.len())))?;
    Ok(u64::from_be_bytes(arr))
}

pub fn decode_uuid(bytes: &[u8], what: &str) -> Result<Uuid, StoreError> {
    Uuid::from_slice(bytes)
        .map_err(|_| StoreError::Corrupt(format!("{what} is {} bytes, expected 16", bytes.len())))
}

/// The ids in a chunk of an id set (`idsets.rs`).
pub fn decode_id_list(bytes: &[u8]) -> Result<Vec<Uuid>, StoreError> {
    if !bytes.len().is_multiple_of(16) {
        return Err(StoreError::Corrupt(format!(
            "id set chunk of {} bytes is not a list of 16-byte ids",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(16)
        .map(|c| Uuid::from_slice(c).expect("16 bytes"))
        .collect())
}

pub fn encode_id_list(ids: &[Uuid]) -> Vec<u8> {
    ids.iter().flat_map(|id| *id.as_bytes()).collect()
}

const CURSOR_PREFIX: &str = "c1.";

/// An opaque cursor for the position just after `(created_at_ms, id)` in the `kind` list.
pub fn encode_cursor(kind: Kind, created_at_ms: u64, id: Uuid) -> String {
    let mut out = String::with_capacity(CURSOR_PREFIX.len() + 50);
    out.push_str(CURSOR_PREFIX);
    for b in order_all_key(kind, created_at_ms, id) {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// Decodes a cursor made by [`encode_cursor`] for a list of `kind`; anything else is `Invalid`.
pub fn decode_cursor(cursor: &str, kind: Kind) -> Result<(u64, Uuid), StoreError> {
    let bad = |why: &str| {
        // Quoted no longer than a real cursor (the prefix and 50 hex digits): a page token may
        // be 1 KiB of anything, and an error stays short.
        let shown = match cursor.char_indices().nth(CURSOR_PREFIX.len() + 50) {
            None => format!("{cursor:?}"),
            Some((cut, _)) => format!("{:?}… ({} bytes)", &cursor[..cut], cursor.len()),
        };
        StoreError::invalid(format!("malformed list cursor {shown}: {why}"))
    };
    let hex = cursor
        .strip_prefix(CURSOR_PREFIX)
        .ok_or_else(|| bad("unknown format"))?;
    if hex.len() != 50 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad("expected 50 hex digits"));
    }
    let mut bytes = [0u8; 25];
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad("not hex"))?;
    }
    if bytes[0] != kind.tag() {
        return Err(bad(&format!(
            "it belongs to a list of another kind, not {kind}"
        )));
    }
    order_key_position(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_keys_sort_by_time_then_id() {
        let a = Uuid::from_u128(5);
        let b = Uuid::from_u128(1 << 100);
        assert!(order_all_key(Kind::Sandbox, 1, b) < order_all_key(Kind::Sandbox, 2, a));
        assert!(order_all_key(Kind::Sandbox, 2, a) < order_all_key(Kind::Sandbox, 2, b));
        assert!(order_all_key(Kind::Sandbox, u64::MAX, b) < order_all_key(Kind::Setting, 0, a));
        let ws = Uuid::from_u128(9);
        assert_eq!(
            order_key_position(&order_ws_key(ws, Kind::Sandbox, 77, b)).unwrap(),
            (77, b)
        );
    }

    #[test]
    fn cursors_round_trip_and_reject_garbage() {
        let id = Uuid::from_u128(0xdead_beef);
        let c = encode_cursor(Kind::Sandbox, 1234, id);
        assert_eq!(decode_cursor(&c, Kind::Sandbox).unwrap(), (1234, id));
        for bad in [
            "",
            "c1.",
            "zz",
            &c[..c.len() - 1],
            &c.replace("c1.", "c2."),
            &format!("{}g", &c[..c.len() - 1]),
        ] {
            assert!(
                matches!(
                    decode_cursor(bad, Kind::Sandbox),
                    Err(StoreError::Invalid { .. })
                ),
                "{bad:?} accepted"
            );
        }
        assert!(matches!(
            decode_cursor(&c, Kind::Workspace),
            Err(StoreError::Invalid { .. })
        ));
    }

    #[test]
    fn id_lists_round_trip() {
        let ids = vec![Uuid::from_u128(1), Uuid::from_u128(2)];
        assert_eq!(decode_id_list(&encode_id_list(&ids)).unwrap(), ids);
        assert!(decode_id_list(&[0u8; 17]).is_err());
    }
}

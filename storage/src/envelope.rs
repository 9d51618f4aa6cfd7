//! The on-disk encoding of a record: a prost message written by hand (no .proto file), so that
//! fields can be added later without a schema migration.

use std::collections::BTreeMap;

use prost::Message;
use uuid::Uuid;

use crate::error::StoreError;
use crate::record::{Kind, Record};

#[derive(Clone, PartialEq, prost::Message)]
struct RecordEnvelope {
    #[prost(bytes = "vec", tag = "1")]
    id: Vec<u8>,
    /// `Kind::tag()`.
    #[prost(uint32, tag = "2")]
    kind: u32,
    /// Empty for a global record.
    #[prost(bytes = "vec", tag = "3")]
    workspace: Vec<u8>,
    #[prost(string, tag = "4")]
    name: String,
    /// Empty when the record has no owner.
    #[prost(bytes = "vec", tag = "5")]
    owner: Vec<u8>,
    #[prost(btree_map = "string, string", tag = "6")]
    labels: BTreeMap<String, String>,
    #[prost(uint64, tag = "7")]
    created_at_ms: u64,
    #[prost(uint64, tag = "8")]
    resource_version: u64,
    #[prost(uint64, tag = "9")]
    updated_at_ms: u64,
    #[prost(bytes = "vec", tag = "10")]
    body: Vec<u8>,
    /// The ids this record refers to, 16 bytes each (schema 3; absent before).
    #[prost(bytes = "vec", repeated, tag = "11")]
    refs: Vec<Vec<u8>>,
}

pub fn encode_record(rec: &Record) -> Vec<u8> {
    RecordEnvelope {
        id: rec.id.as_bytes().to_vec(),
        kind: u32::from(rec.kind.tag()),
        workspace: rec
            .workspace
            .map(|w| w.as_bytes().to_vec())
            .unwrap_or_default(),
        name: rec.name.clone(),
        owner: rec.owner.map(|o| o.as_bytes().to_vec()).unwrap_or_default(),
        labels: rec.labels.clone(),
        created_at_ms: rec.created_at_ms,
        resource_version: rec.resource_version,
        updated_at_ms: rec.updated_at_ms,
        body: rec.body.clone(),
        refs: rec.refs.iter().map(|r| r.as_bytes().to_vec()).collect(),
    }
    .encode_to_vec()
}

pub fn decode_record(bytes: &[u8]) -> Result<Record, StoreError> {
    let env = RecordEnvelope::decode(bytes)
        .map_err(|e| StoreError::Corrupt(format!("record does not decode: {e}")))?;
    let opt_uuid = |b: &[u8], what: &str| -> Result<Option<Uuid>, StoreError> {
        if b.is_empty() {
            Ok(None)
        } else {
            Uuid::from_slice(b)
                .map(Some)
                .map_err(|_| StoreError::Corrupt(format!("record {what} is {} bytes", b.len())))
        }
    };
    let id = Uuid::from_slice(&env.id)
        .map_err(|_| StoreError::Corrupt(format!("record id is {} bytes", env.id.len())))?;
    let kind = u8::try_from(env.kind)
        .ok()
        .and_then(Kind::from_tag)
        .ok_or_else(|| StoreError::Corrupt(format!("record {id} has unknown kind {}", env.kind)))?;
    Ok(Record {
        id,
        kind,
        workspace: opt_uuid(&env.workspace, "workspace")?,
        name: env.name,
        owner: opt_uuid(&env.owner, "owner")?,
        labels: env.labels,
        created_at_ms: env.created_at_ms,
        resource_version: env.resource_version,
        updated_at_ms: env.updated_at_ms,
        body: env.body,
        refs: env
            .refs
            .iter()
            .map(|r| {
                Uuid::from_slice(r).map_err(|_| {
                    StoreError::Corrupt(format!("record {id} has a reference of {} bytes", r.len()))
                })
            })
            .collect::<Result<_, _>>()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let rec = Record {
            id: Uuid::from_u128(1),
            kind: Kind::Setting,
            workspace: Some(Uuid::from_u128(2)),
            name: "s".into(),
            owner: Some(Uuid::from_u128(3)),
            labels: [("a".to_string(), "b".to_string())].into(),
            created_at_ms: 4,
            body: vec![0, 1, 2],
            resource_version: 5,
            updated_at_ms: 6,
            refs: vec![Uuid::from_u128(7), Uuid::from_u128(8)],
        };
        assert_eq!(decode_record(&encode_record(&rec)).unwrap(), rec);
        let global = Record {
            kind: Kind::Workspace,
            workspace: None,
            owner: None,
            refs: Vec::new(),
            ..rec
        };
        assert_eq!(decode_record(&encode_record(&global)).unwrap(), global);
    }

    #[test]
    fn garbage_is_corrupt_not_misread() {
        assert!(matches!(
            decode_record(&[0xff, 0xff]),
            Err(StoreError::Corrupt(_))
        ));
        let unknown_kind = RecordEnvelope {
            id: vec![1; 16],
            kind: 99,
            ..Default::default()
        }
        .encode_to_vec();
        assert!(matches!(
            decode_record(&unknown_kind),
            Err(StoreError::Corrupt(_))
        ));
    }
}

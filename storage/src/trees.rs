//! The sled trees of one database ([`Trees`]), opened once by their layout names: what the
//! store's reads, its write transactions (`writes.rs`) and its committer share, kept below all
//! three.

use crate::error::StoreError;
use crate::layout::{
    TREE_META, TREE_NAMES, TREE_ORDER_ALL, TREE_ORDER_WS, TREE_OWNERS, TREE_RECORDS, TREE_REFS,
    TREE_WS_COUNTS,
};

/// The sled trees of one database, opened once.
#[derive(Clone)]
pub(crate) struct Trees {
    pub(crate) records: sled::Tree,
    pub(crate) names: sled::Tree,
    pub(crate) owners: sled::Tree,
    pub(crate) refs: sled::Tree,
    pub(crate) order_all: sled::Tree,
    pub(crate) order_ws: sled::Tree,
    pub(crate) ws_counts: sled::Tree,
    pub(crate) meta: sled::Tree,
}

impl Trees {
    /// Opens (makes, the first time) every tree of the layout in `db`.
    pub(crate) fn open(db: &sled::Db) -> Result<Trees, StoreError> {
        Ok(Trees {
            records: db.open_tree(TREE_RECORDS)?,
            names: db.open_tree(TREE_NAMES)?,
            owners: db.open_tree(TREE_OWNERS)?,
            refs: db.open_tree(TREE_REFS)?,
            order_all: db.open_tree(TREE_ORDER_ALL)?,
            order_ws: db.open_tree(TREE_ORDER_WS)?,
            ws_counts: db.open_tree(TREE_WS_COUNTS)?,
            meta: db.open_tree(TREE_META)?,
        })
    }
}

//! sbx-actors

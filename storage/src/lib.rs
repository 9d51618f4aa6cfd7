//! sbx-storage

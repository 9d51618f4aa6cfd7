//! sbx-chaos-tests

//! One module per noun of `sbx`, as mini-redis has `cmd/<name>.rs`: each holds its noun's
//! clap arguments, the requests it makes and what it prints, and runs it (`run_<noun>`, called
//! from `Command::run` in lib.rs). A noun with many verbs is a directory (`sandbox/`,
//! `workspace/`, `image/`) with a file per verb or group of verbs.
//!
//! What nouns share lies below `cmd` (`crate::connect`, `crate::output`, `crate::reply`, …) and
//! uses nothing here. Nouns use each other in one direction only: `sandbox create` pulls
//! through `image` and asks `version` what the driver can do, `sandbox events` is run by
//! `events`, `run` creates through `sandbox::create`, `wait` shows through `sandbox::view`,
//! and `workspace network` shows and parses through `sandbox::network`.

pub mod completion;
pub mod config;
pub mod events;
pub mod identity;
pub mod image;
pub mod node;
pub mod provider;
pub mod run;
pub mod sandbox;
pub mod service;
pub mod setting;
pub mod version;
pub mod wait;
pub mod workspace;

#[cfg(test)]
mod output_tests;
#[cfg(test)]
mod request_tests;

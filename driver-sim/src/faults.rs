//! Seeded fault injection for the sim driver: latency, jitter, injected `Unavailable` errors and
//! calls that never answer.
//!
//! Every call the driver receives draws exactly four numbers from one seeded generator
//! (jitter, hang roll, error roll, lost-reply roll), whatever the knobs are set to, so a given
//! seed and call sequence always gives the same decisions. Concurrent calls are decided in the
//! order they reach the driver, so only a sequential caller gets a reproducible sequence. The generator is SplitMix64, written out here
//! rather than taken from `rand`, so that a seed printed by a failing run reproduces it with
//! any version of any dependency.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// The operations of the driver contract, as the sim's audit log and fault knobs name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimOp {
    Create,
    Start,
    Stop,
    Delete,
    Get,
    List,
    Watch,
    Exec,
    Logs,
    Capabilities,
    Stats,
    Pause,
    Resume,
}

impl SimOp {
    /// Every operation, in declaration order.
    pub const ALL: [SimOp; 13] = [
        SimOp::Create,
        SimOp::Start,
        SimOp::Stop,
        SimOp::Delete,
        SimOp::Get,
        SimOp::List,
        SimOp::Watch,
        SimOp::Exec,
        SimOp::Logs,
        SimOp::Capabilities,
        SimOp::Stats,
        SimOp::Pause,
        SimOp::Resume,
    ];

    /// The operation's name, lowercase, as it appears in error messages.
    pub fn as_str(self) -> &'static str {
        match self {
            SimOp::Create => "create",
            SimOp::Start => "start",
            SimOp::Stop => "stop",
            SimOp::Delete => "delete",
            SimOp::Get => "get",
            SimOp::List => "list",
            SimOp::Watch => "watch",
            SimOp::Exec => "exec",
            SimOp::Logs => "logs",
            SimOp::Capabilities => "capabilities",
            SimOp::Stats => "stats",
            SimOp::Pause => "pause",
            SimOp::Resume => "resume",
        }
    }
}

/// The faults a [`SimDriver`](super::SimDriver) injects. Everything is off by default.
///
/// An injected error or hang happens before the call acts and leaves the world untouched; a
/// lost reply happens after it acted (the caller sees `Unavailable`, the change is made), as
/// when a connection drops on the way back. Streams (watch, exec, logs) are not faulted once
/// they have been returned.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SimFaults {
    /// Seeds the generator behind jitter, `error_rate` and `hang_rate`.
    pub seed: u64,
    /// Added to every call, before it acts.
    pub latency: Duration,
    /// A further uniformly drawn delay in `0..=jitter` per call.
    pub jitter: Duration,
    /// Probability (0.0..=1.0) that a call answers `DriverError::Unavailable`, for every op
    /// not listed in `error_rate_by_op`.
    pub error_rate: f64,
    /// Per-operation override of `error_rate`.
    pub error_rate_by_op: BTreeMap<SimOp, f64>,
    /// Probability that a call never answers (awaits forever), for every op not listed in
    /// `hang_rate_by_op`. The caller's deadline must handle it.
    pub hang_rate: f64,
    /// Per-operation override of `hang_rate`; `1.0` makes every call of that op hang.
    pub hang_rate_by_op: BTreeMap<SimOp, f64>,
    /// Probability that a call acts and then answers `DriverError::Unavailable`, for every op
    /// not listed in `lost_reply_rate_by_op`.
    pub lost_reply_rate: f64,
    /// Per-operation override of `lost_reply_rate`.
    pub lost_reply_rate_by_op: BTreeMap<SimOp, f64>,
    /// Every call answers `DriverError::Unavailable` (after its latency), as if the machine
    /// were away. Checked before the hang and error rolls.
    pub fail_all: bool,
}

impl SimFaults {
    /// No faults, with the given seed (for adding knobs with the `with_*` builders).
    pub fn seeded(seed: u64) -> Self {
        SimFaults {
            seed,
            ..SimFaults::default()
        }
    }

    pub fn with_latency(mut self, latency: Duration) -> Self {
        self.latency = latency;
        self
    }

    pub fn with_jitter(mut self, jitter: Duration) -> Self {
        self.jitter = jitter;
        self
    }

    pub fn with_error_rate(mut self, probability: f64) -> Self {
        self.error_rate = probability;
        self
    }

    pub fn with_error_rate_for(mut self, op: SimOp, probability: f64) -> Self {
        self.error_rate_by_op.insert(op, probability);
        self
    }

    pub fn with_hang_rate(mut self, probability: f64) -> Self {
        self.hang_rate = probability;
        self
    }

    pub fn with_hang_rate_for(mut self, op: SimOp, probability: f64) -> Self {
        self.hang_rate_by_op.insert(op, probability);
        self
    }

    pub fn with_lost_reply_rate(mut self, probability: f64) -> Self {
        self.lost_reply_rate = probability;
        self
    }

    pub fn with_lost_reply_rate_for(mut self, op: SimOp, probability: f64) -> Self {
        self.lost_reply_rate_by_op.insert(op, probability);
        self
    }

    /// Every call of `op` hangs.
    pub fn with_hang_on(self, op: SimOp) -> Self {
        self.with_hang_rate_for(op, 1.0)
    }

    pub fn with_fail_all(mut self, fail_all: bool) -> Self {
        self.fail_all = fail_all;
        self
    }

    fn error_probability(&self, op: SimOp) -> f64 {
        *self.error_rate_by_op.get(&op).unwrap_or(&self.error_rate)
    }

    fn hang_probability(&self, op: SimOp) -> f64 {
        *self.hang_rate_by_op.get(&op).unwrap_or(&self.hang_rate)
    }

    fn lost_reply_probability(&self, op: SimOp) -> f64 {
        *self
            .lost_reply_rate_by_op
            .get(&op)
            .unwrap_or(&self.lost_reply_rate)
    }
}

/// What happens to one call.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum FaultOutcome {
    Proceed,
    /// Answer `Unavailable` with this message.
    Fail(String),
    /// Never answer.
    Hang,
    /// Act, then answer `Unavailable` with this message.
    LoseReply(String),
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FaultDecision {
    pub(crate) delay: Duration,
    pub(crate) outcome: FaultOutcome,
}

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and good enough to roll dice for tests.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw in `[0, 1)`.
    fn next_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[derive(Debug)]
struct FaultState {
    faults: SimFaults,
    rng: SplitMix64,
    /// Calls decided since the faults were last set; named in injected errors so that a
    /// failure can be traced to its seed and call number.
    calls: u64,
}

/// A cloneable handle on one driver's fault settings, so a test can change them after it has
/// handed the driver away as `Arc<dyn ComputeDriver>`.
#[derive(Debug, Clone)]
pub struct SimFaultHandle {
    state: Arc<Mutex<FaultState>>,
}

impl SimFaultHandle {
    pub(crate) fn new(faults: SimFaults) -> Self {
        let rng = SplitMix64(faults.seed);
        SimFaultHandle {
            state: Arc::new(Mutex::new(FaultState {
                faults,
                rng,
                calls: 0,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, FaultState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Replaces the faults and reseeds the generator from `faults.seed`.
    pub fn set_faults(&self, faults: SimFaults) {
        let mut state = self.lock();
        state.rng = SplitMix64(faults.seed);
        state.calls = 0;
        state.faults = faults;
    }

    /// Makes every call fail with `Unavailable` (true) or lets calls through again (false).
    /// Leaves the generator where it is.
    pub fn fail_all(&self, fail_all: bool) {
        self.lock().faults.fail_all = fail_all;
    }

    /// The current fault settings.
    pub fn faults(&self) -> SimFaults {
        self.lock().faults.clone()
    }

    /// Decides the fate of one call of `op`.
    pub(crate) fn decide(&self, op: SimOp) -> FaultDecision {
        let mut state = self.lock();
        state.calls += 1;
        let call = state.calls;
        let jitter_draw = state.rng.next_u64();
        let hang_roll = state.rng.next_unit();
        let error_roll = state.rng.next_unit();
        let lost_reply_roll = state.rng.next_unit();
        let faults = &state.faults;

        let jitter_nanos = faults.jitter.as_nanos();
        let extra = if jitter_nanos == 0 {
            Duration::ZERO
        } else {
            // The remainder is at most `jitter_nanos`, which came from a Duration.
            let nanos = u128::from(jitter_draw) % (jitter_nanos + 1);
            Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
        };
        let delay = faults.latency.saturating_add(extra);

        let outcome = if faults.fail_all {
            FaultOutcome::Fail(format!(
                "sim: fail_all is on ({} call #{call})",
                op.as_str()
            ))
        } else if hang_roll < faults.hang_probability(op) {
            FaultOutcome::Hang
        } else if error_roll < faults.error_probability(op) {
            FaultOutcome::Fail(format!(
                "sim: injected fault (seed {}, {} call #{call})",
                faults.seed,
                op.as_str()
            ))
        } else if lost_reply_roll < faults.lost_reply_probability(op) {
            FaultOutcome::LoseReply(format!(
                "sim: injected lost reply; the call acted (seed {}, {} call #{call})",
                faults.seed,
                op.as_str()
            ))
        } else {
            FaultOutcome::Proceed
        };
        FaultDecision { delay, outcome }
    }
}

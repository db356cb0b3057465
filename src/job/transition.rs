//! The changes a job can go through, and what applying one did or why it did not apply.
//! [`super::JobRecord::apply`] is the one place that decides; every store applies it
//! atomically.

use std::time::SystemTime;

use super::{JobState, StoredResponse};

/// A change to a job, issued by a round, a late answer, the admin API or a newcomer.
///
/// Every transition carries what it expects of the job, so applying it a second time —
/// after a store applied it but its reply was lost, and the caller retried — is recognised
/// as already applied and answers the same effect, without changing anything again. That
/// is what makes the engine's retry of a store that blipped safe: a retried `StartAttempt`
/// never appends a second attempt, a retried `Reopen` never reads as "someone else
/// re-opened it".
#[derive(Clone, Debug)]
pub enum Transition {
    /// Register attempt `n` — the next ordinal of the job as the round knows it — in the
    /// round that read `version`.
    StartAttempt {
        version: u64,
        n: u32,
        provider: String,
    },
    /// The compare-and-swap of SPEC §2: attempt `n` offers its final answer.
    Complete {
        n: u32,
        response: StoredResponse,
    },
    /// Attempt `n` definitely failed (or broke the contract).
    FailAttempt {
        n: u32,
        kind: Failure,
        upstream_status: Option<u16>,
        error: Option<String>,
    },
    /// Attempt `n` timed out: its upstream call may still be alive.
    AttemptUnknown {
        n: u32,
        error: String,
    },
    /// No attempt of the round is running and at least one timed out.
    MarkUnknown {
        version: u64,
    },
    /// Every provider of the round definitely failed.
    FailRound {
        version: u64,
    },
    /// Out-of-band resolution, whatever the job's version. The one transition that cannot
    /// tell a second apply from a first: the engine never sends it (the admin API sends
    /// [`Transition::CancelAt`]); it is for a person or a tool applying it once.
    Cancel,
    /// Out-of-band resolution of the job an operator saw at `version` (the admin API): a
    /// second apply finds it cancelled at a later version and is already applied; a cancel
    /// of a job the operator saw cancelled already is refused as settled.
    CancelAt {
        version: u64,
    },
    /// A retry opens a new round after `failed`/`cancelled`. `lease_until` is the
    /// re-opener's own (a wall-clock instant to the nanosecond), which is how a second apply
    /// of the same re-open tells itself apart from another retry's.
    Reopen {
        version: u64,
        lease_until: SystemTime,
    },
    RenewLease {
        version: u64,
        until: SystemTime,
    },
    /// A newcomer found the job `in_progress` with its lease lapsed.
    ExpireLease {
        version: u64,
    },
    /// Attempt `n` has the first byte of a streamed answer: it claims the result slot by the
    /// same compare-and-swap as [`Transition::Complete`] before relaying anything, so two
    /// streams are never interleaved. The job stays unsettled until the stream ends.
    BeginStream {
        n: u32,
    },
    /// The stream of attempt `n` ended cleanly: its recording settles the job.
    EndStream {
        n: u32,
        response: StoredResponse,
    },
    /// The stream of attempt `n` broke off: the job is `failed`, so a retry may run again.
    CutStream {
        n: u32,
        error: String,
    },
}

/// Why an attempt failed definitely.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    Failed,
    ContractRejected,
}

/// What a transition did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    AttemptStarted {
        n: u32,
        read_version: u64,
    },
    /// The attempt completed the job.
    Won,
    /// The compare-and-swap touched nothing; the attempt is `lost_race` (or stays
    /// `cancelled`) and its payload was dropped.
    LostRace {
        completed_by: Option<u32>,
    },
    /// The attempt is recorded as failed; `job_failed` when that was the job's last hope.
    AttemptFailed {
        job_failed: bool,
    },
    /// The attempt's answer was discarded: it had been cancelled, or already settled.
    Discarded,
    Applied,
}

/// A transition that does not apply to the job as it is; nothing was changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error("job is {state} at version {version}, not as the transition expected")]
    WrongState { state: JobState, version: u64 },
    #[error("job has no attempt {0}")]
    NoSuchAttempt(u32),
    #[error("job is already settled ({0})")]
    AlreadySettled(JobState),
    #[error("attempt {0} may still be running")]
    AttemptLive(u32),
}

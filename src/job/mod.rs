//! Jobs and attempts: the records, and the pure rules that move them between states.
//!
//! Every store applies [`JobRecord::apply`] atomically (under a lock, in a transaction, or in
//! a script that mirrors it), so the rules of SPEC §2 live here once and are unit-tested here.
//!
//! The job's `version` is a fencing token. Every transition that ends or restarts a round
//! (completion, failure, cancellation, re-opening) bumps it; marking a job `unknown` does not,
//! because the attempt that timed out may still legitimately finish. Every transition issued
//! by a round names the version the round read, so a round that was cancelled and re-opened
//! behind its back can no longer touch the job.

mod headers;
mod transition;

pub use self::headers::Headers;
pub use self::transition::{Effect, Failure, Rejection, Transition};

use std::fmt;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// A job's id, as returned in `X-Idempotency-Job-Id`.
pub type JobId = String;

/// Mints a new job id for (owner, key): `job_`, a 16-hex shard tag derived from the owner
/// and key, then a time-ordered UUIDv7. The tag lets a store keep a job next to its claim
/// (on Redis Cluster: in the same hash slot) and still find the job from its id alone.
pub fn new_job_id(owner: &str, key: &str) -> JobId {
    job_id_for(&claim_digest_bytes(owner, key))
}

/// [`new_job_id`] for the (owner, key) whose [`claim_digest_bytes`] the caller holds.
pub(crate) fn job_id_for(identity: &[u8; 32]) -> JobId {
    // Built in place, in one allocation: the digest's hex string and a `format!` showed in
    // the profile of a new job.
    let mut tag = [0u8; SHARD_TAG_LEN];
    hex::encode_to_slice(&identity[..SHARD_TAG_LEN / 2], &mut tag)
        .expect("the tag is half the digest's first bytes in hex");
    let mut time_ordered = [0u8; uuid::fmt::Simple::LENGTH];
    let time_ordered = uuid::Uuid::now_v7()
        .simple()
        .encode_lower(&mut time_ordered);
    let mut id = String::with_capacity(4 + SHARD_TAG_LEN + time_ordered.len());
    id.push_str("job_");
    id.push_str(std::str::from_utf8(&tag).expect("hex is ASCII"));
    id.push_str(time_ordered);
    id
}

/// Length of the shard tag at the start of a job id, after `job_`.
pub const SHARD_TAG_LEN: usize = 16;

/// The shard tag of a job id minted by [`new_job_id`].
pub fn shard_tag(id: &str) -> Option<&str> {
    id_parts(id).map(|(tag, _)| tag)
}

/// A job id minted by [`new_job_id`] as its shard tag and its time-ordered rest.
pub fn id_parts(id: &str) -> Option<(&str, &str)> {
    let rest = id.strip_prefix("job_")?;
    let tag = rest.get(..SHARD_TAG_LEN)?;
    tag.bytes()
        .all(|b| b.is_ascii_hexdigit())
        .then(|| (tag, &rest[SHARD_TAG_LEN..]))
}

/// SHA-256 (hex) naming the (owner, key) pair; NUL cannot occur in either.
pub fn claim_digest(owner: &str, key: &str) -> String {
    hex_of(&claim_digest_bytes(owner, key))
}

pub fn claim_digest_bytes(owner: &str, key: &str) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    hasher.update(owner.as_bytes());
    hasher.update([0]);
    hasher.update(key.as_bytes());
    hasher.finalize().into()
}

/// A SHA-256 digest in lower-case hex. `hex::encode` builds its string a `char` at a time,
/// which showed in the profile of a new job (four digests each).
pub fn hex_of(digest: &[u8; 32]) -> String {
    let mut text = [0u8; 64];
    hex::encode_to_slice(digest, &mut text).expect("64 bytes hold 32 in hex");
    String::from_utf8(text.to_vec()).expect("hex is ASCII")
}

/// Where a job is in its life (SPEC §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    InProgress,
    Succeeded,
    Failed,
    Unknown,
    Cancelled,
}

impl JobState {
    /// Settled jobs hold their final word; `in_progress` and `unknown` may still change.
    pub fn is_settled(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Unknown => "unknown",
            Self::Cancelled => "cancelled",
        }
    }
}

impl std::str::FromStr for JobState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        [
            Self::InProgress,
            Self::Succeeded,
            Self::Failed,
            Self::Unknown,
            Self::Cancelled,
        ]
        .into_iter()
        .find(|state| state.as_str() == s)
        .ok_or_else(|| format!("{s:?} is not a job state"))
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where one attempt is in its life (SPEC §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptState {
    Started,
    Succeeded,
    Failed,
    Unknown,
    LostRace,
    ContractRejected,
    Cancelled,
}

impl AttemptState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Unknown => "unknown",
            Self::LostRace => "lost_race",
            Self::ContractRejected => "contract_rejected",
            Self::Cancelled => "cancelled",
        }
    }

    /// An attempt that may still produce an answer: its upstream call may be alive.
    pub fn is_live(self) -> bool {
        matches!(self, Self::Started | Self::Unknown)
    }
}

impl std::str::FromStr for AttemptState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        [
            Self::Started,
            Self::Succeeded,
            Self::Failed,
            Self::Unknown,
            Self::LostRace,
            Self::ContractRejected,
            Self::Cancelled,
        ]
        .into_iter()
        .find(|state| state.as_str() == s)
        .ok_or_else(|| format!("{s:?} is not an attempt state"))
    }
}

/// The answer a job settled with, replayed byte for byte. Hop-by-hop headers are never kept.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    pub status: u16,
    /// Header names (lower case) and raw values, in the order the provider sent them.
    pub headers: Headers,
    pub body: Bytes,
    /// The answer was larger than `max_stored_response_bytes`: it reached the client that
    /// ran the job, but its body is not kept, so it cannot be replayed.
    #[serde(default)]
    pub body_omitted: bool,
}

/// The durable record of one intent.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Job {
    pub id: JobId,
    /// SHA-256 of the owner's credential or identity, never the raw value.
    pub owner: String,
    pub key: String,
    pub fingerprint: String,
    pub route: String,
    pub state: JobState,
    pub version: u64,
    /// The winning attempt's ordinal, set once, only by a successful completion.
    pub completed_by: Option<u32>,
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
    pub expires_at: SystemTime,
    /// Until when the gateway running the job vouches that it is alive (SPEC §4 lease).
    pub lease_until: SystemTime,
    pub response: Option<StoredResponse>,
}

/// One try at fulfilling a job against one provider.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attempt {
    pub n: u32,
    pub provider: String,
    pub state: AttemptState,
    /// The job version this attempt read when it started: its fencing token for completion.
    pub read_version: u64,
    pub started_at: SystemTime,
    pub finished_at: Option<SystemTime>,
    pub upstream_status: Option<u16>,
    pub error: Option<String>,
}

/// A job with its attempts: the unit every store reads and writes atomically.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobRecord {
    pub job: Job,
    pub attempts: Vec<Attempt>,
}

/// How long records live, so every store computes `expires_at` the same way.
#[derive(Clone, Copy, Debug)]
pub struct ExpiryPolicy {
    pub retention: Duration,
    /// An unsettled job is kept at least this much longer than a settled one, so no new
    /// claim can slip in while an attempt of it may still land.
    pub late_result_window: Duration,
}

impl ExpiryPolicy {
    fn expires_at(&self, state: JobState, now: SystemTime) -> SystemTime {
        if state.is_settled() {
            now + self.retention
        } else {
            now + self.retention + self.late_result_window
        }
    }
}

/// What a claim does with the job its (owner, key) already names, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimRule {
    /// No job: the new record is created.
    Create,
    /// A retained job: it is the job of the key, and the claim returns it.
    Keep,
    /// An expired job: it is removed and the new record takes its place.
    Replace,
}

impl Job {
    /// The compare-and-swap condition of SPEC §2, written once: `job.version ==
    /// attempt.read_version AND job.completed_by IS NULL AND job.state IN (in_progress,
    /// unknown)`. Completion and a stream's first byte both take the result slot with it.
    pub fn may_complete(&self, attempt: &Attempt) -> bool {
        self.version == attempt.read_version
            && self.completed_by.is_none()
            && matches!(self.state, JobState::InProgress | JobState::Unknown)
    }
}

/// What a claim found when the (owner, key) already had a job (SPEC §3 step 6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// The key was used for a different payload.
    Conflict,
    /// The job holds its answer.
    Replay,
    /// Another request is running the job and its gateway is alive.
    InFlight,
    /// The job is `in_progress` but the gateway running it stopped renewing its lease.
    LeaseLapsed,
    /// An attempt may have run; nobody knows.
    Unknown,
    /// The last round failed or was cancelled: a retry may open a new round at this version.
    Reopenable { version: u64 },
}

/// What a replay needs of a settled job: its id, its stored answer and the attempt that
/// gave it. Cheap to take from a record in place: the answer's buffers are shared.
#[derive(Clone, Debug)]
pub struct Settled {
    pub job_id: JobId,
    pub response: StoredResponse,
    pub n: u32,
    pub provider: String,
    /// Where a store that keeps its replays' headers keeps them for this job.
    pub head: Option<ReplayHead>,
}

/// The headers of a job's replays — the provider's, then the gateway's — made by the first
/// replay a store hands the place to, and cloned by each later one. They depend only on the
/// settled job, so a store may keep them per job (the memory store does, beside the repeat
/// digest, from a job's second replay on): making them parses, validates and hashes every
/// header of the answer again, the largest part of a replay's own work after hashing the
/// request.
pub type ReplayHead = std::sync::Arc<std::sync::OnceLock<http::HeaderMap>>;

impl JobRecord {
    /// A freshly claimed job: `in_progress`, version 1, no attempts, leased until `lease_until`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: JobId,
        owner: String,
        key: String,
        fingerprint: String,
        route: String,
        now: SystemTime,
        lease_until: SystemTime,
        policy: &ExpiryPolicy,
    ) -> Self {
        Self {
            job: Job {
                id,
                owner,
                key,
                fingerprint,
                route,
                state: JobState::InProgress,
                version: 1,
                completed_by: None,
                created_at: now,
                updated_at: now,
                expires_at: policy.expires_at(JobState::InProgress, now),
                lease_until,
                response: None,
            },
            attempts: Vec::new(),
        }
    }

    /// What a claim with `fingerprint` found. The fingerprint check comes first, so a
    /// different payload is reported as reuse whatever the job's state.
    pub fn classify(&self, fingerprint: &str, now: SystemTime) -> Found {
        if self.job.fingerprint != fingerprint {
            return Found::Conflict;
        }
        match self.job.state {
            JobState::Succeeded => Found::Replay,
            JobState::InProgress if self.job.lease_until <= now => Found::LeaseLapsed,
            JobState::InProgress => Found::InFlight,
            JobState::Unknown => Found::Unknown,
            JobState::Failed | JobState::Cancelled => Found::Reopenable {
                version: self.job.version,
            },
        }
    }

    /// The answer of a succeeded job whose body was kept, as a replay sends it; `None` for
    /// any other job (a replay of one kept without its body is refused by the engine).
    pub fn settled(&self) -> Option<Settled> {
        if self.job.state != JobState::Succeeded {
            return None;
        }
        let response = self.job.response.as_ref().filter(|r| !r.body_omitted)?;
        let (n, provider) = self
            .job
            .completed_by
            .and_then(|n| self.attempt(n))
            .map_or((0, String::new()), |a| (a.n, a.provider.clone()));
        Some(Settled {
            job_id: self.job.id.clone(),
            response: response.clone(),
            n,
            provider,
            head: None,
        })
    }

    pub fn is_expired(&self, now: SystemTime) -> bool {
        self.job.expires_at <= now
    }

    /// What a claim of this record's (owner, key) does with it: the job of the key while
    /// it is retained, replaced by the new claim once it has expired. Every store applies
    /// this one rule inside its atomic claim.
    pub fn claim_rule(existing: Option<&Self>, now: SystemTime) -> ClaimRule {
        match existing {
            None => ClaimRule::Create,
            Some(record) if record.is_expired(now) => ClaimRule::Replace,
            Some(_) => ClaimRule::Keep,
        }
    }

    pub fn attempt(&self, n: u32) -> Option<&Attempt> {
        self.attempts.iter().find(|a| a.n == n)
    }

    /// Applies one transition, or rejects it without changing anything.
    pub fn apply(
        &mut self,
        transition: Transition,
        now: SystemTime,
        policy: &ExpiryPolicy,
    ) -> Result<Effect, Rejection> {
        let effect = self.transition(transition, now)?;
        self.job.updated_at = now;
        self.job.expires_at = policy.expires_at(self.job.state, now);
        Ok(effect)
    }

    fn transition(&mut self, transition: Transition, now: SystemTime) -> Result<Effect, Rejection> {
        match transition {
            Transition::StartAttempt {
                version,
                n,
                provider,
            } => {
                if let Some(existing) = self.attempts.iter().find(|a| a.n == n) {
                    return if existing.read_version == version && existing.provider == provider {
                        // Already applied: the reply to the first apply was lost.
                        Ok(Effect::AttemptStarted {
                            n,
                            read_version: version,
                        })
                    } else {
                        Err(self.wrong_state())
                    };
                }
                self.expect(JobState::InProgress, version)?;
                if n != self.attempts.last().map_or(1, |a| a.n + 1) {
                    return Err(self.wrong_state());
                }
                self.attempts.push(Attempt {
                    n,
                    provider,
                    state: AttemptState::Started,
                    read_version: version,
                    started_at: now,
                    finished_at: None,
                    upstream_status: None,
                    error: None,
                });
                Ok(Effect::AttemptStarted {
                    n,
                    read_version: version,
                })
            }
            Transition::Complete { n, response } => self.complete(n, response, now),
            Transition::FailAttempt {
                n,
                kind,
                upstream_status,
                error,
            } => self.fail_attempt(n, kind, upstream_status, error, now),
            Transition::AttemptUnknown { n, error } => {
                let attempt = self.attempt_mut(n)?;
                if attempt.state == AttemptState::Unknown {
                    return Ok(Effect::Applied);
                }
                if attempt.state != AttemptState::Started {
                    return Ok(Effect::Discarded);
                }
                attempt.state = AttemptState::Unknown;
                attempt.error = Some(error);
                Ok(Effect::Applied)
            }
            Transition::MarkUnknown { version } | Transition::ExpireLease { version } => {
                // Marking unknown leaves the version as it is: at the same version, unknown
                // is this transition already applied.
                if self.job.state == JobState::Unknown && self.job.version == version {
                    return Ok(Effect::Applied);
                }
                self.expect(JobState::InProgress, version)?;
                self.job.state = JobState::Unknown;
                for attempt in &mut self.attempts {
                    if attempt.state == AttemptState::Started {
                        attempt.state = AttemptState::Unknown;
                        attempt
                            .error
                            .get_or_insert_with(|| "outcome unknown".into());
                    }
                }
                Ok(Effect::Applied)
            }
            Transition::FailRound { version } => {
                if self.job.state == JobState::Failed && self.job.version == version + 1 {
                    return Ok(Effect::Applied);
                }
                self.expect(JobState::InProgress, version)?;
                // A round fails only when every attempt of it definitely failed: one that may
                // still run would otherwise overlap the next round.
                if let Some(live) = self.attempts.iter().find(|a| a.state.is_live()) {
                    return Err(Rejection::AttemptLive(live.n));
                }
                self.job.state = JobState::Failed;
                self.job.version += 1;
                Ok(Effect::Applied)
            }
            Transition::BeginStream { n } => self.begin_stream(n, now),
            Transition::EndStream { n, response } => self.end_stream(n, Ok(response), now),
            Transition::CutStream { n, error } => self.end_stream(n, Err(error), now),
            // Cancelled since the operator saw it: by this cancel, applied before its reply
            // was lost (perhaps after a retry of the client re-opened the job, so more than
            // one version on), or by another that did what this one asks.
            Transition::CancelAt { version }
                if self.job.state == JobState::Cancelled && self.job.version > version =>
            {
                Ok(Effect::Applied)
            }
            Transition::Cancel | Transition::CancelAt { .. } => {
                if self.job.state.is_settled() {
                    return Err(Rejection::AlreadySettled(self.job.state));
                }
                self.job.state = JobState::Cancelled;
                self.job.version += 1;
                // A stream that held the result slot loses it with the cancel.
                self.job.completed_by = None;
                for attempt in &mut self.attempts {
                    if attempt.state.is_live() {
                        attempt.state = AttemptState::Cancelled;
                        attempt.finished_at = Some(now);
                    }
                }
                Ok(Effect::Applied)
            }
            Transition::Reopen {
                version,
                lease_until,
            } => {
                if self.job.state == JobState::InProgress
                    && self.job.version == version + 1
                    && self.job.lease_until == lease_until
                {
                    // This very re-open, applied before: its lease instant is its own.
                    return Ok(Effect::Applied);
                }
                if !matches!(self.job.state, JobState::Failed | JobState::Cancelled)
                    || self.job.version != version
                {
                    return Err(self.wrong_state());
                }
                self.job.state = JobState::InProgress;
                self.job.version += 1;
                self.job.lease_until = lease_until;
                Ok(Effect::Applied)
            }
            Transition::RenewLease { version, until } => {
                self.expect(JobState::InProgress, version)?;
                self.job.lease_until = until;
                Ok(Effect::Applied)
            }
        }
    }

    /// SPEC §2: `job.version == attempt.read_version AND job.completed_by IS NULL AND
    /// job.state IN (in_progress, unknown)`, or the attempt is `lost_race` and its payload
    /// is dropped whole.
    fn complete(
        &mut self,
        n: u32,
        response: StoredResponse,
        now: SystemTime,
    ) -> Result<Effect, Rejection> {
        let job = &self.job;
        let attempt = self
            .attempts
            .iter()
            .find(|a| a.n == n)
            .ok_or(Rejection::NoSuchAttempt(n))?;
        if attempt.state == AttemptState::Succeeded && job.completed_by == Some(n) {
            // Re-applied after a store blip swallowed the first reply: the same win.
            return Ok(Effect::Won);
        }
        if attempt.state == AttemptState::LostRace {
            return Ok(Effect::LostRace {
                completed_by: job.completed_by,
            });
        }
        if !attempt.state.is_live() {
            // A cancelled attempt stays cancelled; an already finished one cannot finish twice.
            // What the provider said is still worth showing an operator.
            let status = response.status;
            let attempt = self.attempt_mut(n)?;
            if attempt.state == AttemptState::Cancelled {
                attempt.upstream_status = Some(status);
            }
            return Ok(Effect::Discarded);
        }
        let wins = job.may_complete(attempt);
        let completed_by = job.completed_by;
        let status = response.status;
        let attempt = self.attempt_mut(n)?;
        attempt.finished_at = Some(now);
        attempt.upstream_status = Some(status);
        if !wins {
            attempt.state = AttemptState::LostRace;
            return Ok(Effect::LostRace { completed_by });
        }
        attempt.state = AttemptState::Succeeded;
        self.job.state = JobState::Succeeded;
        self.job.completed_by = Some(n);
        self.job.version += 1;
        self.job.response = Some(response);
        Ok(Effect::Won)
    }

    /// The compare-and-swap of [`Self::complete`], taken at a stream's first byte: the slot
    /// is claimed (`completed_by`) but the job settles only when the stream ends.
    fn begin_stream(&mut self, n: u32, now: SystemTime) -> Result<Effect, Rejection> {
        let job = &self.job;
        let attempt = self
            .attempts
            .iter()
            .find(|a| a.n == n)
            .ok_or(Rejection::NoSuchAttempt(n))?;
        if job.completed_by == Some(n) && attempt.state.is_live() {
            return Ok(Effect::Won);
        }
        if attempt.state == AttemptState::LostRace {
            // Re-applied after a store blip swallowed the first reply: the same loss.
            return Ok(Effect::LostRace {
                completed_by: job.completed_by,
            });
        }
        if !attempt.state.is_live() {
            return Ok(Effect::Discarded);
        }
        if !job.may_complete(attempt) {
            let completed_by = job.completed_by;
            let attempt = self.attempt_mut(n)?;
            attempt.state = AttemptState::LostRace;
            attempt.finished_at = Some(now);
            return Ok(Effect::LostRace { completed_by });
        }
        self.job.completed_by = Some(n);
        Ok(Effect::Won)
    }

    fn end_stream(
        &mut self,
        n: u32,
        result: Result<StoredResponse, String>,
        now: SystemTime,
    ) -> Result<Effect, Rejection> {
        let holds_slot = self.job.completed_by == Some(n)
            && matches!(self.job.state, JobState::InProgress | JobState::Unknown);
        let settled_by_it =
            self.job.completed_by == Some(n) && self.job.state == JobState::Succeeded;
        let job_failed = self.job.state == JobState::Failed;
        let attempt = self.attempt_mut(n)?;
        // Applied before (its reply was lost): the same effect again.
        match (&result, attempt.state) {
            (Ok(_), AttemptState::Succeeded) if settled_by_it => return Ok(Effect::Won),
            (Err(error), AttemptState::Failed) if attempt.error.as_ref() == Some(error) => {
                return Ok(Effect::AttemptFailed { job_failed });
            }
            _ => {}
        }
        if !holds_slot || !attempt.state.is_live() {
            // Cancelled while it streamed: the recording is dropped.
            return Ok(Effect::Discarded);
        }
        attempt.finished_at = Some(now);
        match result {
            Ok(response) => {
                attempt.state = AttemptState::Succeeded;
                attempt.upstream_status = Some(response.status);
                self.job.state = JobState::Succeeded;
                self.job.response = Some(response);
                self.job.version += 1;
                Ok(Effect::Won)
            }
            Err(error) => {
                attempt.state = AttemptState::Failed;
                attempt.error = Some(error);
                self.job.completed_by = None;
                // A hedged attempt still running may yet answer: the job stays open for it
                // (its gateway's lease decides if it is dead). Otherwise a retry may run.
                if self.attempts.iter().any(|a| a.state.is_live()) {
                    return Ok(Effect::AttemptFailed { job_failed: false });
                }
                self.job.state = JobState::Failed;
                self.job.version += 1;
                Ok(Effect::AttemptFailed { job_failed: true })
            }
        }
    }

    fn fail_attempt(
        &mut self,
        n: u32,
        kind: Failure,
        upstream_status: Option<u16>,
        error: Option<String>,
        now: SystemTime,
    ) -> Result<Effect, Rejection> {
        let job_failed_now = self.job.state == JobState::Failed;
        let attempt = self.attempt_mut(n)?;
        let failed_as = match kind {
            Failure::Failed => AttemptState::Failed,
            Failure::ContractRejected => AttemptState::ContractRejected,
        };
        if attempt.state == failed_as
            && attempt.upstream_status == upstream_status
            && attempt.error == error
        {
            // Applied before (its reply was lost): the same effect again.
            return Ok(Effect::AttemptFailed {
                job_failed: job_failed_now && attempt.read_version + 1 == self.job.version,
            });
        }
        if !attempt.state.is_live() {
            return Ok(Effect::Discarded);
        }
        let was_unknown = attempt.state == AttemptState::Unknown;
        let read_version = attempt.read_version;
        attempt.state = match kind {
            Failure::Failed => AttemptState::Failed,
            Failure::ContractRejected => AttemptState::ContractRejected,
        };
        attempt.finished_at = Some(now);
        attempt.upstream_status = upstream_status;
        attempt.error = error;
        // A late definite failure resolves an `unknown` job once nothing else may land.
        let job_failed = was_unknown
            && self.job.state == JobState::Unknown
            && self.job.version == read_version
            && !self.attempts.iter().any(|a| a.state.is_live());
        if job_failed {
            self.job.state = JobState::Failed;
            self.job.version += 1;
        }
        Ok(Effect::AttemptFailed { job_failed })
    }

    fn expect(&self, state: JobState, version: u64) -> Result<(), Rejection> {
        if self.job.state == state && self.job.version == version {
            Ok(())
        } else {
            Err(self.wrong_state())
        }
    }

    fn wrong_state(&self) -> Rejection {
        Rejection::WrongState {
            state: self.job.state,
            version: self.job.version,
        }
    }

    fn attempt_mut(&mut self, n: u32) -> Result<&mut Attempt, Rejection> {
        self.attempts
            .iter_mut()
            .find(|a| a.n == n)
            .ok_or(Rejection::NoSuchAttempt(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: ExpiryPolicy = ExpiryPolicy {
        retention: Duration::from_secs(100),
        late_result_window: Duration::from_secs(10),
    };

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + secs)
    }

    fn record() -> JobRecord {
        JobRecord::new(
            "job_1".into(),
            "owner".into(),
            "key".into(),
            "fp".into(),
            "chat".into(),
            t(0),
            t(30),
            &POLICY,
        )
    }

    fn answer(status: u16, body: &'static str) -> StoredResponse {
        StoredResponse {
            status,
            headers: vec![(
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            )]
            .into(),
            body: Bytes::from_static(body.as_bytes()),
            body_omitted: false,
        }
    }

    fn start(r: &mut JobRecord, provider: &str) -> u32 {
        let version = r.job.version;
        let n = r.attempts.last().map_or(1, |a| a.n + 1);
        match r.apply(
            Transition::StartAttempt {
                version,
                n,
                provider: provider.into(),
            },
            t(1),
            &POLICY,
        ) {
            Ok(Effect::AttemptStarted { n, .. }) => n,
            other => panic!("start failed: {other:?}"),
        }
    }

    fn complete(r: &mut JobRecord, n: u32, body: &'static str) -> Result<Effect, Rejection> {
        r.apply(
            Transition::Complete {
                n,
                response: answer(200, body),
            },
            t(2),
            &POLICY,
        )
    }

    fn fail(r: &mut JobRecord, n: u32) -> Result<Effect, Rejection> {
        r.apply(
            Transition::FailAttempt {
                n,
                kind: Failure::Failed,
                upstream_status: Some(503),
                error: None,
            },
            t(2),
            &POLICY,
        )
    }

    /// A job whose first round failed (version 2): what a client's retry re-opens.
    fn failed_round() -> JobRecord {
        let mut r = record();
        let a = start(&mut r, "p");
        fail(&mut r, a).unwrap();
        r.apply(Transition::FailRound { version: 1 }, t(3), &POLICY)
            .unwrap();
        r
    }

    fn unknown(r: &mut JobRecord, n: u32) {
        r.apply(
            Transition::AttemptUnknown {
                n,
                error: "timeout".into(),
            },
            t(2),
            &POLICY,
        )
        .unwrap();
    }

    #[test]
    fn job_ids_carry_the_shard_tag_of_their_claim() {
        let a = new_job_id("owner", "key");
        let b = new_job_id("owner", "key");
        assert_ne!(a, b);
        assert_eq!(shard_tag(&a), shard_tag(&b));
        assert_eq!(
            shard_tag(&a).unwrap(),
            &claim_digest("owner", "key")[..SHARD_TAG_LEN]
        );
        assert_ne!(shard_tag(&new_job_id("owner", "other")), shard_tag(&a));
        let time_ordered = &a[4 + SHARD_TAG_LEN..];
        assert_eq!(time_ordered.len(), 32, "{a}");
        let parsed = uuid::Uuid::parse_str(time_ordered).expect("a simple UUID");
        assert_eq!(parsed.get_version_num(), 7);
        assert_eq!(time_ordered, parsed.simple().to_string(), "lower-case");
        assert_eq!(shard_tag("job_orphan"), None);
        assert_ne!(claim_digest("ab", "c"), claim_digest("a", "bc"));
    }

    #[test]
    fn new_job_is_in_progress_at_version_one() {
        let r = record();
        assert_eq!(r.job.state, JobState::InProgress);
        assert_eq!(r.job.version, 1);
        assert_eq!(r.job.completed_by, None);
        assert_eq!(r.job.expires_at, t(110));
    }

    #[test]
    fn classify_checks_the_fingerprint_before_the_state() {
        let mut r = record();
        assert_eq!(r.classify("other", t(1)), Found::Conflict);
        assert_eq!(r.classify("fp", t(1)), Found::InFlight);
        assert_eq!(r.classify("fp", t(30)), Found::LeaseLapsed);
        let n = start(&mut r, "p");
        complete(&mut r, n, "a").unwrap();
        assert_eq!(r.classify("other", t(1)), Found::Conflict);
        assert_eq!(r.classify("fp", t(1)), Found::Replay);
    }

    /// Only a succeeded job whose body was kept has an answer to replay, the one its winning
    /// attempt gave.
    #[test]
    fn a_succeeded_job_is_settled_with_its_winning_attempt() {
        let mut r = record();
        assert!(r.settled().is_none(), "in progress");
        start(&mut r, "primary");
        let second = start(&mut r, "fallback");
        assert!(r.settled().is_none(), "attempts running");
        complete(&mut r, second, "b").unwrap();
        let settled = r.settled().expect("succeeded");
        assert_eq!((settled.n, settled.provider.as_str()), (second, "fallback"));
        assert_eq!(&settled.response.body[..], b"b");
        assert_eq!(settled.job_id, r.job.id);
        r.job.response.as_mut().unwrap().body_omitted = true;
        assert!(r.settled().is_none(), "an answer not kept is not replayed");
    }

    #[test]
    fn first_completion_wins_and_bumps_the_version() {
        let mut r = record();
        let n = start(&mut r, "primary");
        assert_eq!(complete(&mut r, n, "a"), Ok(Effect::Won));
        assert_eq!(r.job.state, JobState::Succeeded);
        assert_eq!(r.job.version, 2);
        assert_eq!(r.job.completed_by, Some(n));
        assert_eq!(r.attempt(n).unwrap().state, AttemptState::Succeeded);
        assert_eq!(r.job.response.as_ref().unwrap().body, "a");
        assert_eq!(r.job.expires_at, t(102));
    }

    #[test]
    fn second_completion_loses_and_its_payload_is_dropped() {
        let mut r = record();
        let a = start(&mut r, "primary");
        let b = start(&mut r, "fallback");
        assert_eq!(complete(&mut r, b, "fallback"), Ok(Effect::Won));
        assert_eq!(
            complete(&mut r, a, "primary"),
            Ok(Effect::LostRace {
                completed_by: Some(b)
            })
        );
        assert_eq!(r.attempt(a).unwrap().state, AttemptState::LostRace);
        assert_eq!(r.job.completed_by, Some(b));
        assert_eq!(r.job.version, 2);
        assert_eq!(r.job.response.as_ref().unwrap().body, "fallback");
    }

    #[test]
    fn cas_requires_the_read_version() {
        let mut r = failed_round();
        r.apply(
            Transition::Reopen {
                version: 2,
                lease_until: t(60),
            },
            t(3),
            &POLICY,
        )
        .unwrap();
        assert_eq!(r.job.version, 3);
        // Attempt 2 reads version 3. Forge an old-round attempt still live at version 1.
        let b = start(&mut r, "p");
        assert_eq!(r.attempt(b).unwrap().read_version, 3);
        r.attempts[0].state = AttemptState::Unknown;
        assert_eq!(
            complete(&mut r, 1, "stale"),
            Ok(Effect::LostRace { completed_by: None })
        );
        assert_eq!(r.job.state, JobState::InProgress);
        assert_eq!(complete(&mut r, b, "fresh"), Ok(Effect::Won));
    }

    #[test]
    fn cas_requires_an_unsettled_job_without_a_winner() {
        for state in [JobState::Failed, JobState::Cancelled, JobState::Succeeded] {
            let mut r = record();
            let a = start(&mut r, "p");
            r.job.state = state;
            assert_eq!(
                complete(&mut r, a, "x"),
                Ok(Effect::LostRace { completed_by: None }),
                "{state}"
            );
            assert!(r.job.response.is_none());
        }
        let mut r = record();
        let a = start(&mut r, "p");
        r.job.completed_by = Some(9);
        assert_eq!(
            complete(&mut r, a, "x"),
            Ok(Effect::LostRace {
                completed_by: Some(9)
            })
        );
    }

    #[test]
    fn timeout_marks_unknown_without_bumping_the_version_and_the_late_answer_settles() {
        let mut r = record();
        let a = start(&mut r, "p");
        unknown(&mut r, a);
        assert_eq!(r.attempt(a).unwrap().state, AttemptState::Unknown);
        r.apply(Transition::MarkUnknown { version: 1 }, t(3), &POLICY)
            .unwrap();
        assert_eq!(r.job.state, JobState::Unknown);
        assert_eq!(r.job.version, 1);
        assert_eq!(r.classify("fp", t(4)), Found::Unknown);
        // No new attempt while unknown.
        assert!(r
            .apply(
                Transition::StartAttempt {
                    version: 1,
                    n: 2,
                    provider: "f".into()
                },
                t(4),
                &POLICY
            )
            .is_err());
        assert_eq!(complete(&mut r, a, "late"), Ok(Effect::Won));
        assert_eq!(r.job.state, JobState::Succeeded);
        assert_eq!(r.job.version, 2);
    }

    #[test]
    fn a_late_definite_failure_fails_an_unknown_job() {
        let mut r = record();
        let a = start(&mut r, "p");
        unknown(&mut r, a);
        r.apply(Transition::MarkUnknown { version: 1 }, t(3), &POLICY)
            .unwrap();
        assert_eq!(
            fail(&mut r, a),
            Ok(Effect::AttemptFailed { job_failed: true })
        );
        assert_eq!(r.job.state, JobState::Failed);
        assert_eq!(r.job.version, 2);
    }

    #[test]
    fn a_late_failure_waits_for_other_live_attempts() {
        let mut r = record();
        let a = start(&mut r, "p");
        let b = start(&mut r, "f");
        unknown(&mut r, a);
        unknown(&mut r, b);
        r.apply(Transition::MarkUnknown { version: 1 }, t(3), &POLICY)
            .unwrap();
        assert_eq!(
            fail(&mut r, a),
            Ok(Effect::AttemptFailed { job_failed: false })
        );
        assert_eq!(r.job.state, JobState::Unknown);
        assert_eq!(complete(&mut r, b, "late"), Ok(Effect::Won));
    }

    #[test]
    fn a_failure_in_progress_leaves_the_job_to_its_round() {
        let mut r = record();
        let a = start(&mut r, "p");
        assert_eq!(
            fail(&mut r, a),
            Ok(Effect::AttemptFailed { job_failed: false })
        );
        assert_eq!(r.job.state, JobState::InProgress);
        assert_eq!(r.attempt(a).unwrap().upstream_status, Some(503));
    }

    #[test]
    fn contract_rejection_is_its_own_attempt_state() {
        let mut r = record();
        let a = start(&mut r, "p");
        r.apply(
            Transition::FailAttempt {
                n: a,
                kind: Failure::ContractRejected,
                upstream_status: Some(200),
                error: Some("missing /choices".into()),
            },
            t(2),
            &POLICY,
        )
        .unwrap();
        assert_eq!(r.attempt(a).unwrap().state, AttemptState::ContractRejected);
        assert!(r.job.response.is_none());
    }

    #[test]
    fn cancel_settles_and_discards_the_late_answer() {
        let mut r = record();
        let a = start(&mut r, "p");
        unknown(&mut r, a);
        r.apply(Transition::MarkUnknown { version: 1 }, t(3), &POLICY)
            .unwrap();
        r.apply(Transition::Cancel, t(4), &POLICY).unwrap();
        assert_eq!(r.job.state, JobState::Cancelled);
        assert_eq!(r.job.version, 2);
        assert_eq!(r.attempt(a).unwrap().state, AttemptState::Cancelled);
        assert_eq!(complete(&mut r, a, "late"), Ok(Effect::Discarded));
        assert_eq!(r.attempt(a).unwrap().state, AttemptState::Cancelled);
        assert_eq!(r.attempt(a).unwrap().upstream_status, Some(200));
        assert!(r.job.response.is_none());
        assert_eq!(fail(&mut r, a), Ok(Effect::Discarded));
    }

    #[test]
    fn cancel_of_a_settled_job_is_rejected() {
        for state in [JobState::Succeeded, JobState::Failed, JobState::Cancelled] {
            let mut r = record();
            r.job.state = state;
            assert_eq!(
                r.apply(Transition::Cancel, t(1), &POLICY),
                Err(Rejection::AlreadySettled(state))
            );
            assert_eq!(r.job.version, 1);
        }
    }

    /// An operator's cancel is known by the version it saw: applied again after its reply
    /// was lost, it is already applied, even when a retry of the client re-opened the job
    /// between the operator's look and the cancel; a cancel of a job seen cancelled is not.
    #[test]
    fn a_cancel_applied_again_is_recognised_by_the_version_it_saw() {
        let mut r = failed_round();
        let seen = r.job.version;
        r.apply(
            Transition::Reopen {
                version: seen,
                lease_until: t(40),
            },
            t(3),
            &POLICY,
        )
        .unwrap();
        let cancel = Transition::CancelAt { version: seen };
        assert_eq!(r.apply(cancel.clone(), t(4), &POLICY), Ok(Effect::Applied));
        assert_eq!(
            (r.job.state, r.job.version),
            (JobState::Cancelled, seen + 2)
        );
        assert_eq!(r.apply(cancel, t(5), &POLICY), Ok(Effect::Applied));
        assert_eq!(r.job.version, seen + 2, "applied once");
        assert_eq!(
            r.apply(
                Transition::CancelAt {
                    version: r.job.version
                },
                t(6),
                &POLICY
            ),
            Err(Rejection::AlreadySettled(JobState::Cancelled))
        );
    }

    #[test]
    fn cancel_in_progress_cancels_started_attempts() {
        let mut r = record();
        let a = start(&mut r, "p");
        r.apply(Transition::Cancel, t(4), &POLICY).unwrap();
        assert_eq!(r.attempt(a).unwrap().state, AttemptState::Cancelled);
        // The round that was running can no longer touch the job.
        assert!(r
            .apply(Transition::FailRound { version: 1 }, t(5), &POLICY)
            .is_err());
        assert!(r
            .apply(Transition::MarkUnknown { version: 1 }, t(5), &POLICY)
            .is_err());
    }

    #[test]
    fn reopen_is_version_checked_so_one_of_two_retries_wins() {
        let mut r = failed_round();
        assert_eq!(r.classify("fp", t(4)), Found::Reopenable { version: 2 });
        let reopen = Transition::Reopen {
            version: 2,
            lease_until: t(60),
        };
        assert_eq!(r.apply(reopen.clone(), t(4), &POLICY), Ok(Effect::Applied));
        // Another retry's re-open (its own lease instant) loses…
        let other = Transition::Reopen {
            version: 2,
            lease_until: t(61),
        };
        assert_eq!(
            r.apply(other, t(4), &POLICY),
            Err(Rejection::WrongState {
                state: JobState::InProgress,
                version: 3
            })
        );
        // …while the same re-open applied again is recognised as already applied.
        assert_eq!(r.apply(reopen, t(4), &POLICY), Ok(Effect::Applied));
        assert_eq!(r.job.version, 3);
        // The new round's attempts continue the ordinals.
        assert_eq!(start(&mut r, "p"), 2);
    }

    #[test]
    fn reopen_refuses_unsettled_and_succeeded_jobs() {
        for state in [JobState::InProgress, JobState::Unknown, JobState::Succeeded] {
            let mut r = record();
            r.job.state = state;
            assert!(r
                .apply(
                    Transition::Reopen {
                        version: 1,
                        lease_until: t(9)
                    },
                    t(1),
                    &POLICY
                )
                .is_err());
        }
    }

    #[test]
    fn lease_lapse_moves_in_progress_to_unknown() {
        let mut r = record();
        let a = start(&mut r, "p");
        r.apply(
            Transition::RenewLease {
                version: 1,
                until: t(50),
            },
            t(20),
            &POLICY,
        )
        .unwrap();
        assert_eq!(r.classify("fp", t(40)), Found::InFlight);
        assert_eq!(r.classify("fp", t(50)), Found::LeaseLapsed);
        r.apply(Transition::ExpireLease { version: 1 }, t(50), &POLICY)
            .unwrap();
        assert_eq!(r.job.state, JobState::Unknown);
        assert_eq!(r.job.version, 1);
        assert_eq!(r.attempt(a).unwrap().state, AttemptState::Unknown);
    }

    #[test]
    fn attempts_only_start_in_the_round_that_read_the_version() {
        let mut r = record();
        assert!(r
            .apply(
                Transition::StartAttempt {
                    version: 7,
                    n: 1,
                    provider: "p".into()
                },
                t(1),
                &POLICY
            )
            .is_err());
        assert!(r.attempts.is_empty());
    }

    #[test]
    fn attempt_unknown_does_not_reopen_a_finished_attempt() {
        let mut r = record();
        let a = start(&mut r, "p");
        complete(&mut r, a, "x").unwrap();
        assert_eq!(
            r.apply(
                Transition::AttemptUnknown {
                    n: a,
                    error: "t".into()
                },
                t(3),
                &POLICY
            ),
            Ok(Effect::Discarded)
        );
        assert_eq!(r.attempt(a).unwrap().state, AttemptState::Succeeded);
    }

    #[test]
    fn re_applying_a_win_is_the_same_win() {
        let mut r = record();
        let a = start(&mut r, "p");
        assert_eq!(complete(&mut r, a, "x"), Ok(Effect::Won));
        assert_eq!(complete(&mut r, a, "y"), Ok(Effect::Won));
        assert_eq!(r.job.version, 2);
        assert_eq!(r.job.response.as_ref().unwrap().body, "x");
    }

    fn stream(r: &mut JobRecord, transition: Transition) -> Result<Effect, Rejection> {
        r.apply(transition, t(5), &POLICY)
    }

    #[test]
    fn a_stream_claims_the_slot_at_its_first_byte_and_settles_at_its_end() {
        let mut r = record();
        let a = start(&mut r, "primary");
        let b = start(&mut r, "fallback");
        assert_eq!(
            stream(&mut r, Transition::BeginStream { n: b }),
            Ok(Effect::Won)
        );
        assert_eq!(
            (r.job.state, r.job.version, r.job.completed_by),
            (JobState::InProgress, 1, Some(b))
        );
        // The other attempt can neither stream nor complete now.
        assert_eq!(
            stream(&mut r, Transition::BeginStream { n: a }),
            Ok(Effect::LostRace {
                completed_by: Some(b)
            })
        );
        assert_eq!(r.attempt(a).unwrap().state, AttemptState::LostRace);
        let done = Transition::EndStream {
            n: b,
            response: answer(200, "data: x"),
        };
        assert_eq!(stream(&mut r, done), Ok(Effect::Won));
        assert_eq!((r.job.state, r.job.version), (JobState::Succeeded, 2));
        assert_eq!(r.job.response.as_ref().unwrap().body, "data: x");
        assert_eq!(r.attempt(b).unwrap().state, AttemptState::Succeeded);
    }

    #[test]
    fn a_buffered_answer_loses_to_a_live_stream() {
        let mut r = record();
        let a = start(&mut r, "primary");
        let b = start(&mut r, "fallback");
        stream(&mut r, Transition::BeginStream { n: a }).unwrap();
        assert_eq!(
            complete(&mut r, b, "late"),
            Ok(Effect::LostRace {
                completed_by: Some(a)
            })
        );
    }

    #[test]
    fn a_cut_stream_fails_the_job_and_frees_the_slot() {
        let mut r = record();
        let a = start(&mut r, "p");
        stream(&mut r, Transition::BeginStream { n: a }).unwrap();
        let cut = Transition::CutStream {
            n: a,
            error: "reset".into(),
        };
        assert_eq!(
            stream(&mut r, cut),
            Ok(Effect::AttemptFailed { job_failed: true })
        );
        assert_eq!(
            (r.job.state, r.job.version, r.job.completed_by),
            (JobState::Failed, 2, None)
        );
        assert_eq!(r.attempt(a).unwrap().state, AttemptState::Failed);
        assert_eq!(r.classify("fp", t(6)), Found::Reopenable { version: 2 });
    }

    #[test]
    fn a_round_with_a_live_attempt_cannot_fail() {
        for live in [AttemptState::Started, AttemptState::Unknown] {
            let mut r = record();
            let a = start(&mut r, "p");
            r.attempts[0].state = live;
            assert_eq!(
                r.apply(Transition::FailRound { version: 1 }, t(3), &POLICY),
                Err(Rejection::AttemptLive(a))
            );
            assert_eq!(r.job.state, JobState::InProgress);
        }
    }

    #[test]
    fn a_cut_stream_leaves_the_job_to_a_hedged_attempt_still_running() {
        let mut r = record();
        let a = start(&mut r, "primary");
        let b = start(&mut r, "fallback");
        stream(&mut r, Transition::BeginStream { n: b }).unwrap();
        let cut = Transition::CutStream {
            n: b,
            error: "reset".into(),
        };
        assert_eq!(
            stream(&mut r, cut),
            Ok(Effect::AttemptFailed { job_failed: false })
        );
        assert_eq!(
            (r.job.state, r.job.version, r.job.completed_by),
            (JobState::InProgress, 1, None)
        );
        assert_eq!(complete(&mut r, a, "primary"), Ok(Effect::Won));
    }

    #[test]
    fn a_stream_that_lost_the_race_loses_it_again_when_retried() {
        // A store blip swallowed the first reply; the caller applies the same transition again.
        let mut r = record();
        let a = start(&mut r, "p");
        let b = start(&mut r, "q");
        assert_eq!(
            stream(&mut r, Transition::BeginStream { n: a }),
            Ok(Effect::Won)
        );
        let lost = Effect::LostRace {
            completed_by: Some(a),
        };
        for _ in 0..2 {
            assert_eq!(stream(&mut r, Transition::BeginStream { n: b }), Ok(lost));
        }
        assert_eq!(r.attempt(b).unwrap().state, AttemptState::LostRace);
    }

    #[test]
    fn a_cancel_drops_a_live_stream() {
        let mut r = record();
        let a = start(&mut r, "p");
        stream(&mut r, Transition::BeginStream { n: a }).unwrap();
        r.apply(Transition::Cancel, t(6), &POLICY).unwrap();
        assert_eq!(r.job.completed_by, None);
        let done = Transition::EndStream {
            n: a,
            response: answer(200, "x"),
        };
        assert_eq!(stream(&mut r, done), Ok(Effect::Discarded));
        assert!(r.job.response.is_none());
        assert_eq!(r.job.state, JobState::Cancelled);
    }

    #[test]
    fn unknown_attempts_are_rejected() {
        let mut r = record();
        assert_eq!(complete(&mut r, 3, "x"), Err(Rejection::NoSuchAttempt(3)));
    }
}

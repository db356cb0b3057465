//! The job store: the one place that enforces identity. (owner, key) is claimed atomically,
//! and every [`Transition`] is applied atomically with the pure rules of [`crate::job`].
//!
//! The gateway holds an `Arc<dyn JobStore>`: one vtable call per store operation is
//! negligible next to the network round trip to a provider, and it lets the store be chosen
//! from the config at start-up without making the whole gateway generic.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::config::{StoreConfig, StoreKind};
use crate::job::{
    Effect, ExpiryPolicy, Found, JobId, JobRecord, JobState, Rejection, Settled, Transition,
};

pub mod embedded;
pub mod memory;
pub mod postgres;
pub mod redis;
pub mod timed;

/// The store could not answer. Never a reason to call a provider without a claim.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// What was being done, and the store's own error: kept for the logs, never shown to a
    /// client (see [`crate::error`]).
    #[error("store unavailable: {context}: {source}")]
    Unavailable {
        context: String,
        #[source]
        source: Arc<dyn std::error::Error + Send + Sync>,
    },
    #[error("job {0} not found")]
    NotFound(JobId),
}

impl StoreError {
    pub fn unavailable(
        context: impl Into<String>,
        source: impl Into<crate::body::BoxError>,
    ) -> Self {
        Self::Unavailable {
            context: context.into(),
            source: Arc::from(source.into()),
        }
    }
}

/// What a claim of (owner, key) found.
#[derive(Debug)]
pub enum Claim {
    /// The key was free (or its old job had expired): this record is now the job.
    Created(JobRecord),
    /// The key already names this job.
    Existing(JobRecord),
}

/// The result of applying a transition: what it did (or why it did not apply), and the
/// record as it is afterwards.
#[derive(Debug)]
pub struct Applied {
    pub outcome: Result<Effect, Rejection>,
    pub record: JobRecord,
}

/// What [`JobStore::peek`] found.
#[derive(Debug)]
pub enum Peeked {
    /// The job succeeded with the same fingerprint: its answer, for a replay.
    Settled(Settled),
    /// Any other live job, whole, for the engine to resolve.
    Record(JobRecord),
}

impl Peeked {
    /// What a peek at `live` gives a request of `fingerprint`.
    pub fn of(live: &JobRecord, fingerprint: &str, now: SystemTime) -> Self {
        Self::replay_of(live, fingerprint, now)
            .map_or_else(|| Self::Record(live.clone()), Self::Settled)
    }

    /// As [`Peeked::of`], for a record the store read out for the peek.
    pub fn of_owned(live: JobRecord, fingerprint: &str, now: SystemTime) -> Self {
        Self::replay_of(&live, fingerprint, now).map_or(Self::Record(live), Self::Settled)
    }

    /// The answer a request of `fingerprint` is replayed, if `live` is one to replay.
    fn replay_of(live: &JobRecord, fingerprint: &str, now: SystemTime) -> Option<Settled> {
        match live.classify(fingerprint, now) {
            Found::Replay => live.settled(),
            _ => None,
        }
    }
}

#[async_trait]
pub trait JobStore: Send + Sync + Debug + 'static {
    /// Creates `record` as the job of its (owner, key) unless a live job already holds
    /// them, in one atomic step. An expired job is replaced.
    async fn claim(&self, record: JobRecord, now: SystemTime) -> Result<Claim, StoreError>;

    /// [`JobStore::claim`] for a caller that holds the identity of the record's (owner, key)
    /// (`job::claim_digest_bytes`) already, as the engine does from its peek: a store that
    /// files its claims by that digest does not hash them again.
    async fn claim_identified(
        &self,
        _identity: &[u8; 32],
        record: JobRecord,
        now: SystemTime,
    ) -> Result<Claim, StoreError> {
        self.claim(record, now).await
    }

    /// The live job of an (owner, key), named by its identity (`job::claim_digest_bytes`),
    /// where the store can read it in memory, without a round trip or a transaction: lets a
    /// retry skip minting a new job (a fresh id, its first attempt) only for its claim to
    /// find the stored one. `None` means "claim to find out", which is always right: a
    /// claim returns the live job too.
    ///
    /// A succeeded job of the same `fingerprint` comes as its [`Settled`] answer, taken in
    /// place: a replay needs nothing else, and a copy of the whole record was most of the
    /// allocations of a replay. `owner` and `key` are what `identity` digests, for a store
    /// that files its claims by them.
    fn peek(
        &self,
        _identity: &[u8; 32],
        _owner: &str,
        _key: &str,
        _now: SystemTime,
        _fingerprint: &str,
    ) -> Option<Peeked> {
        None
    }

    /// Where the store reads in memory as [`JobStore::peek`] does: the answer of the live job
    /// of `identity` if it is one a replay would give, with the
    /// [`crate::intent::request_digest`] of the request it was last replayed for (kept by
    /// [`JobStore::remember_repeat`]). A request of that digest is byte for byte that one,
    /// so of the job's fingerprint, and is answered without being fingerprinted again.
    fn peek_repeat(&self, _identity: &[u8; 32], _now: SystemTime) -> Option<([u8; 32], Settled)> {
        None
    }

    /// Notes that `job_id`, the job of `identity`, was replayed for a request of digest
    /// `repeat()`, for [`JobStore::peek_repeat`]. Nothing is noted if `identity` names another
    /// job by now: a digest vouches only for the job whose fingerprint it was checked against.
    /// The digest is asked for only by a store that keeps it: it hashes the whole request.
    fn remember_repeat(&self, _identity: &[u8; 32], _job_id: &str, _repeat: &dyn Fn() -> [u8; 32]) {
    }

    async fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError>;

    /// Applies one transition atomically; [`StoreError::NotFound`] if the job is gone.
    async fn apply(
        &self,
        id: &str,
        transition: Transition,
        now: SystemTime,
    ) -> Result<Applied, StoreError>;

    /// Waits until the job's version or state differs from what the caller saw, or
    /// `timeout` passes, and returns the record as it then is. Woken by a notification,
    /// not a poll.
    async fn wait_change(
        &self,
        id: &str,
        seen_version: u64,
        seen_state: JobState,
        timeout: Duration,
    ) -> Result<JobRecord, StoreError>;

    /// Whether the store answers (`/readyz`).
    async fn ping(&self) -> Result<(), StoreError>;

    /// Ids of jobs currently `unknown`, in id order, after `after`, at most `limit`: what an
    /// operator must resolve.
    async fn unknown_jobs(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError>;

    /// Jobs `in_progress` whose lease lapsed by `now` (their gateway stopped renewing it),
    /// with their versions, at most `limit`, from an index of in-progress jobs: what the
    /// lease sweep turns `unknown` when no request for their key comes.
    async fn lapsed_leases(
        &self,
        now: SystemTime,
        limit: usize,
    ) -> Result<Vec<(JobId, u64)>, StoreError>;

    /// Ids of jobs currently `in_progress`, in id order, after `after`, at most `limit`,
    /// from the store's in-progress index.
    async fn in_progress_jobs(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError>;

    /// The job of (owner, key), if one is retained.
    async fn find(&self, owner: &str, key: &str) -> Result<Option<JobRecord>, StoreError>;

    /// How many jobs are `unknown`, from the store's index: one cheap read, never one per
    /// job, so `/metrics` costs the same whatever the store holds.
    async fn count_unknown(&self) -> Result<usize, StoreError> {
        Ok(self.unknown_jobs(None, usize::MAX).await?.len())
    }

    /// Publishes a live stream's progress for duplicates on other gateways. Stores that
    /// serve one process only need not: duplicates there join the stream in memory.
    async fn mirror_stream(&self, _id: &str, _update: StreamUpdate) -> Result<(), StoreError> {
        Ok(())
    }

    /// Another gateway's mirrored stream, from chunk `from`; `None` when there is none.
    async fn read_stream(
        &self,
        _id: &str,
        _from: usize,
    ) -> Result<Option<MirroredStream>, StoreError> {
        Ok(None)
    }
}

/// The head of a streamed answer, as duplicates on other gateways need it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct StreamHead {
    pub status: u16,
    pub headers: crate::job::Headers,
    pub n: u32,
    pub provider: String,
}

/// One step of a mirrored stream. Each can be written again after a failure that may have
/// hidden its success (a lost reply): it leaves the mirror as one write would.
///
/// Chunks and ends name their attempt (`n`) and are dropped unless the mirror's head is that
/// attempt's: a cut attempt's last writes can land after a retry's head (the job fails at
/// the cut, before its mirror has written the cut), and must not become the retry's. So can
/// its head, when its mirror started late.
#[derive(Clone, Debug)]
pub enum StreamUpdate {
    /// A new attempt's stream: replaces whatever an earlier attempt mirrored, and is
    /// dropped when the mirror is a later attempt's.
    Head(StreamHead),
    /// Chunks `from`, `from + 1`, … of attempt `n`'s stream; the ones the mirror already
    /// holds are not added again.
    Chunks {
        n: u32,
        from: usize,
        chunks: Vec<bytes::Bytes>,
    },
    /// Attempt `n`'s stream ended cleanly, or was cut for this reason.
    End { n: u32, end: Result<(), String> },
}

/// What a duplicate on another gateway reads of a live stream.
#[derive(Clone, Debug)]
pub struct MirroredStream {
    pub head: StreamHead,
    /// Chunks from the position asked for.
    pub chunks: Vec<bytes::Bytes>,
    pub end: Option<Result<(), String>>,
}

/// Wakes the waiters of a job through one of a fixed number of shards keyed by its id, so
/// memory stays bounded however many jobs there are; a waiter woken for another job of its
/// shard re-reads and waits again.
#[derive(Debug)]
pub(crate) struct Changes {
    shards: Box<[tokio::sync::Notify]>,
}

impl Changes {
    const SHARDS: u64 = 64;

    pub(crate) fn new() -> Self {
        Self {
            shards: (0..Self::SHARDS)
                .map(|_| tokio::sync::Notify::new())
                .collect(),
        }
    }

    /// Wakes every waiter: after notifications may have been lost.
    pub(crate) fn wake_all(&self) {
        for shard in self.shards.iter() {
            shard.notify_waiters();
        }
    }

    pub(crate) fn of(&self, id: &str) -> &tokio::sync::Notify {
        // By the id's shard tag, a digest of its (owner, key), where it has one: the rest of
        // an id is random, and which jobs shared a shard (and woke each other's waiters to
        // read the store again) then differed between two runs of one simulated seed.
        // FNV-1a: cheap, and spreads the tags well enough over the shards.
        let named = crate::job::shard_tag(id).unwrap_or(id);
        let hash = named.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        &self.shards[(hash % Self::SHARDS) as usize]
    }
}

/// The wait every store offers: re-read the job until its version or state differs from
/// what the caller saw, sleeping on the job's change notification in between (and waking at
/// least every `poll`, for stores whose notifications can be lost), up to `timeout`.
pub(crate) async fn wait_for_change<F, Fut>(
    changes: &Changes,
    id: &str,
    seen: (u64, JobState),
    timeout: Duration,
    poll: Option<Duration>,
    read: F,
) -> Result<JobRecord, StoreError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Option<JobRecord>, StoreError>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let notified = changes.of(id).notified();
        tokio::pin!(notified);
        // Registered before the read, so a change between the two still wakes us.
        notified.as_mut().enable();
        let record = read()
            .await?
            .ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
        let now = tokio::time::Instant::now();
        if (record.job.version, record.job.state) != seen || now >= deadline {
            return Ok(record);
        }
        let wake = poll.map_or(deadline, |poll| deadline.min(now + poll));
        let _ = tokio::time::timeout_at(wake, notified).await;
    }
}

/// The binary form records are kept in by the stores that serialise them.
pub(crate) fn encode<T: serde::Serialize>(value: &T) -> Vec<u8> {
    let mut encoded = Vec::with_capacity(ENCODED_CAPACITY);
    encode_into(value, &mut encoded);
    encoded
}

/// What an encoding starts with. A record or an answer is a few hundred bytes to a few KB,
/// and every encoding is handed on at once (sent, or copied into a table), so starting there
/// saves the seven doublings a vector grown from empty goes through, copying as it goes.
const ENCODED_CAPACITY: usize = 1024;

/// Encodes `value` at the end of `buf`, as [`encode`] does into a vector of its own.
pub(crate) fn encode_into<T: serde::Serialize>(value: &T, buf: &mut Vec<u8>) {
    postcard::serialize_with_flavor(value, Append(buf)).expect("records always serialise");
}

/// postcard's `AllocVec` output, which always starts a vector of its own, appending to a
/// vector the caller has (sized beforehand, or holding what comes before).
struct Append<'a>(&'a mut Vec<u8>);

impl postcard::ser_flavors::Flavor for Append<'_> {
    type Output = ();

    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        self.0.extend_from_slice(data);
        Ok(())
    }

    fn try_push(&mut self, data: u8) -> postcard::Result<()> {
        self.0.push(data);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
}

pub(crate) fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, StoreError> {
    postcard::from_bytes(bytes).map_err(|e| StoreError::unavailable("undecodable record", e))
}

/// Opens the store the config names.
pub async fn open(
    config: &StoreConfig,
    policy: ExpiryPolicy,
) -> Result<Arc<dyn JobStore>, StoreError> {
    match config.kind {
        StoreKind::Memory => Ok(Arc::new(memory::MemoryStore::new(policy))),
        StoreKind::Embedded => Ok(Arc::new(embedded::EmbeddedStore::open(
            &config.path,
            policy,
        )?)),
        StoreKind::Redis => Ok(Arc::new(redis::RedisStore::open(config, policy).await?)),
        StoreKind::Postgres => Ok(Arc::new(
            postgres::PostgresStore::open(config, policy).await?,
        )),
    }
}

/// A job's way through every state, for the stores' index tests: started, its lease renewed
/// (then renewed to the same instant: nothing to move), timed out, unknown, then settled by
/// the late answer. `None` past the last step.
#[cfg(test)]
fn lifecycle_step(step: usize, version: u64, renewed_until: SystemTime) -> Option<Transition> {
    Some(match step {
        0 => Transition::StartAttempt {
            version,
            n: 1,
            provider: "p".into(),
        },
        1 | 2 => Transition::RenewLease {
            version,
            until: renewed_until,
        },
        3 => Transition::AttemptUnknown {
            n: 1,
            error: "timed out".into(),
        },
        4 => Transition::MarkUnknown { version },
        5 => Transition::Complete {
            n: 1,
            response: crate::job::StoredResponse {
                status: 200,
                headers: Vec::new().into(),
                body: "late".into(),
                body_omitted: false,
            },
        },
        _ => return None,
    })
}

/// Walks the new job `record` (already claimed in `store`) through every state with
/// [`lifecycle_step`], calling `check` with the record after each step; the job must pass
/// through `unknown` and end `succeeded`.
#[cfg(test)]
pub(crate) async fn walk_every_state(
    store: &dyn JobStore,
    record: &JobRecord,
    now: SystemTime,
    check: impl Fn(&JobRecord),
) {
    let id = record.job.id.as_str();
    let mut version = record.job.version;
    let later = now + Duration::from_secs(60);
    let mut seen = Vec::new();
    let mut step = 0;
    while let Some(transition) = lifecycle_step(step, version, later) {
        let applied = store.apply(id, transition, now).await.unwrap();
        assert!(
            applied.outcome.is_ok(),
            "step {step}: {:?}",
            applied.outcome
        );
        version = applied.record.job.version;
        check(&applied.record);
        seen.push(applied.record.job.state);
        step += 1;
    }
    assert!(seen.contains(&JobState::Unknown), "{seen:?}");
    assert_eq!(seen.last(), Some(&JobState::Succeeded));
}

#[cfg(test)]
mod tests {
    use super::Changes;
    use crate::job::new_job_id;

    /// Which waiters one change wakes must not depend on the random part of job ids: a
    /// waiter woken by another job's change reads the store once more, and a simulated seed
    /// whose jobs shared a shard in one run and not in the next replayed differently.
    #[test]
    fn a_job_change_shard_follows_its_owner_and_key_alone() {
        let changes = Changes::new();
        for key in ["a", "b", "c", "d", "e", "f", "g", "h"] {
            let first = changes.of(&new_job_id("owner", key));
            for _ in 0..8 {
                assert!(std::ptr::eq(first, changes.of(&new_job_id("owner", key))));
            }
        }
    }
}

//! The in-memory store: one process, nothing durable. For tests, development and as the
//! reference the other stores are held to by the conformance suite.
//!
//! One `std::sync::Mutex` guards everything: every critical section is a hash lookup plus a
//! pure transition, never held across an `.await`, so a finer-grained scheme would buy
//! nothing measurable next to a provider round trip. Nothing scans the whole map under that
//! lock: the in-progress and unknown jobs and the expiry order are kept as indexes, so the
//! lease sweep, the listings and the expiry sweep cost what they find, not what is stored
//! (a scan of 100 000 jobs every few seconds stalled every request behind it).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use super::{Applied, Changes, Claim, JobStore, Peeked, StoreError};
use crate::job::{
    ClaimRule, ExpiryPolicy, JobId, JobRecord, JobState, ReplayHead, Settled, Transition,
};

#[derive(Debug)]
pub struct MemoryStore {
    inner: Arc<Mutex<State>>,
    policy: ExpiryPolicy,
    changed: Changes,
}

/// A job id as the indexes hold it: one allocation shared by all of them, not a string each.
type Id = Arc<str>;

#[derive(Debug, Default)]
struct State {
    /// The (owner, key) digest → job id: the identity index the claim is atomic over, keyed
    /// as the Redis store keys its claims (`job::claim_digest`), so that it holds no second
    /// copy of the owner and key the record holds already.
    by_key: Sharded<[u8; 32], Claimed>,
    jobs: Sharded<Id, Box<JobRecord>>,
    in_progress: BTreeSet<Id>,
    unknown: BTreeSet<Id>,
    /// (expires_at, id), soonest first: the expiry sweep takes from the front.
    expiry: BTreeSet<(SystemTime, Id)>,
}

/// What the identity index holds for an (owner, key): its job, and the request digest of
/// the last request its answer was replayed for (`JobStore::peek_repeat`). Reset with the
/// entry when another job takes the identity, so a digest never outlives its job.
#[derive(Debug)]
struct Claimed {
    id: Id,
    repeat: Option<[u8; 32]>,
    /// Where the headers of the job's replays are kept (`Settled::head`): made with the
    /// repeat digest, filled by the replay after.
    head: Option<ReplayHead>,
}

/// A hash map split into 64 by key hash, each part growing on its own, so a resize moves
/// a 64th of the entries; records are boxed so the entries moved are small. One map of
/// 57 000 jobs stopped every request for 239 ms while it doubled (seen by a probe request
/// every 2 ms under `benches/overhead.sh`'s new-job load), and each doubling took twice as
/// long as the one before.
///
/// Hashed with foldhash, seeded at random per map (the shard's hasher apart from the maps'
/// own, so a shard's keys do not share the bits its map indexes by): SipHash over every id
/// and identity, twice per lookup, was the largest hashing cost of a new job. The keys are
/// SHA-256 digests and ids the gateway minted, so a client cannot aim keys at one bucket.
#[derive(Debug)]
struct Sharded<K, V> {
    hasher: foldhash::fast::RandomState,
    shards: Box<[HashMap<K, V, foldhash::fast::RandomState>]>,
}

impl<K, V> Default for Sharded<K, V> {
    fn default() -> Self {
        Self {
            hasher: foldhash::fast::RandomState::default(),
            shards: (0..64).map(|_| HashMap::default()).collect(),
        }
    }
}

impl<K: std::hash::Hash + Eq, V> Sharded<K, V> {
    fn shard<Q: std::hash::Hash + ?Sized>(&self, key: &Q) -> usize {
        use std::hash::BuildHasher;
        (self.hasher.hash_one(key) % self.shards.len() as u64) as usize
    }

    fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        self.shards[self.shard(key)].get(key)
    }

    fn get_mut<Q>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        let shard = self.shard(key);
        self.shards[shard].get_mut(key)
    }

    fn insert(&mut self, key: K, value: V) {
        let shard = self.shard(&key);
        self.shards[shard].insert(key, value);
    }

    /// Removes the entry, giving back its stored key too.
    fn remove<Q>(&mut self, key: &Q) -> Option<(K, V)>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        let shard = self.shard(key);
        self.shards[shard].remove_entry(key)
    }

    /// The stored key equal to `key`: an index entry is made from it, sharing its allocation.
    fn key<Q>(&self, key: &Q) -> Option<&K>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        self.shards[self.shard(key)]
            .get_key_value(key)
            .map(|(k, _)| k)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards.iter().map(HashMap::len).sum()
    }
}

/// What the indexes know of a record.
#[derive(Clone, Copy, PartialEq)]
struct Indexed {
    state: JobState,
    expires_at: SystemTime,
}

impl Indexed {
    fn of(record: &JobRecord) -> Self {
        Self {
            state: record.job.state,
            expires_at: record.job.expires_at,
        }
    }
}

fn identity(owner: &str, key: &str) -> [u8; 32] {
    crate::job::claim_digest_bytes(owner, key)
}

impl State {
    /// Stores `record` under its identity, the digest of its (owner, key).
    fn insert(&mut self, identity: [u8; 32], record: JobRecord) {
        let id: Id = record.job.id.as_str().into();
        self.by_key.insert(
            identity,
            Claimed {
                id: id.clone(),
                repeat: None,
                head: None,
            },
        );
        self.reindex(&id, None, Some(Indexed::of(&record)));
        self.jobs.insert(id, Box::new(record));
    }

    fn remove(&mut self, id: &str) {
        if let Some((id, record)) = self.jobs.remove(id) {
            self.reindex(&id, Some(Indexed::of(&record)), None);
            self.by_key
                .remove(&identity(&record.job.owner, &record.job.key));
        }
    }

    /// The job of `identity` while a claim would keep it (not expired), with its index entry.
    fn live(&self, identity: &[u8; 32], now: SystemTime) -> Option<(&Claimed, &JobRecord)> {
        let claimed = self.by_key.get(identity)?;
        let record = self.jobs.get(&claimed.id).map(|r| &**r)?;
        matches!(JobRecord::claim_rule(Some(record), now), ClaimRule::Keep)
            .then_some((claimed, record))
    }

    /// Moves only the entries that differ between `old` and `new`.
    fn reindex(&mut self, id: &Id, old: Option<Indexed>, new: Option<Indexed>) {
        if let Some(old) = old {
            if new.is_none_or(|new| new.state != old.state) {
                self.state_index(old.state).map(|set| set.remove(id));
            }
            if new.is_none_or(|new| new.expires_at != old.expires_at) {
                self.expiry.remove(&(old.expires_at, id.clone()));
            }
        }
        if let Some(new) = new {
            if old.is_none_or(|old| old.state != new.state) {
                self.state_index(new.state)
                    .map(|set| set.insert(id.clone()));
            }
            if old.is_none_or(|old| old.expires_at != new.expires_at) {
                self.expiry.insert((new.expires_at, id.clone()));
            }
        }
    }

    fn state_index(&mut self, state: JobState) -> Option<&mut BTreeSet<Id>> {
        match state {
            JobState::InProgress => Some(&mut self.in_progress),
            JobState::Unknown => Some(&mut self.unknown),
            _ => None,
        }
    }

    /// Removes jobs past their expiry; at most `limit`, so one sweep never holds the lock
    /// for long.
    fn expire(&mut self, now: SystemTime, limit: usize) -> usize {
        let expired: Vec<Id> = self
            .expiry
            .iter()
            .take_while(|(at, _)| *at <= now)
            .take(limit)
            .map(|(_, id)| id.clone())
            .collect();
        for id in &expired {
            self.remove(id);
        }
        expired.len()
    }
}

impl MemoryStore {
    /// A new store with a background sweep of expired jobs that ends when the store drops.
    pub fn new(policy: ExpiryPolicy) -> Self {
        let inner = Arc::new(Mutex::new(State::default()));
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let weak = Arc::downgrade(&inner);
            let every = policy
                .retention
                .clamp(Duration::from_secs(1), Duration::from_secs(60));
            handle.spawn(sweep(weak, every));
        }
        Self {
            inner,
            policy,
            changed: Changes::new(),
        }
    }

    /// Ids of jobs in `state` (in progress or unknown), in id order, after `after`, at most
    /// `limit`.
    fn in_state(&self, state: JobState, after: Option<&str>, limit: usize) -> Vec<JobId> {
        let mut guard = self.lock();
        let Some(index) = guard.state_index(state) else {
            return Vec::new();
        };
        let from = match after {
            Some(after) => std::ops::Bound::Excluded(after),
            None => std::ops::Bound::Unbounded,
        };
        index
            .range::<str, _>((from, std::ops::Bound::Unbounded))
            .take(limit)
            .map(|id| id.to_string())
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave a half-applied transition: records
        // are replaced only after the pure transition returned.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Most expired jobs removed at once. The lock is let go and the task yields between
/// slices, so requests interleave: a slice is what a request may wait behind.
const SWEEP_SLICE: usize = 64;

async fn sweep(state: Weak<Mutex<State>>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        let Some(state) = state.upgrade() else { return };
        loop {
            let now = crate::clock::now();
            let removed = state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .expire(now, SWEEP_SLICE);
            if removed < SWEEP_SLICE {
                break;
            }
            tokio::task::yield_now().await;
        }
    }
}

#[async_trait]
impl JobStore for MemoryStore {
    async fn claim(&self, record: JobRecord, now: SystemTime) -> Result<Claim, StoreError> {
        let index = identity(&record.job.owner, &record.job.key);
        self.claim_identified(&index, record, now).await
    }

    async fn claim_identified(
        &self,
        index: &[u8; 32],
        record: JobRecord,
        now: SystemTime,
    ) -> Result<Claim, StoreError> {
        debug_assert_eq!(*index, identity(&record.job.owner, &record.job.key));
        let index = *index;
        let mut state = self.lock();
        if let Some(id) = state.by_key.get(&index).map(|c| c.id.clone()) {
            let existing = state.jobs.get(&id).map(|r| &**r);
            match JobRecord::claim_rule(existing, now) {
                ClaimRule::Keep => {
                    return Ok(Claim::Existing(existing.expect("kept").clone()));
                }
                ClaimRule::Replace | ClaimRule::Create => state.remove(&id),
            }
        }
        state.insert(index, record.clone());
        Ok(Claim::Created(record))
    }

    fn peek(
        &self,
        identity: &[u8; 32],
        _owner: &str,
        _key: &str,
        now: SystemTime,
        fingerprint: &str,
    ) -> Option<Peeked> {
        let state = self.lock();
        let (_, live) = state.live(identity, now)?;
        Some(Peeked::of(live, fingerprint, now))
    }

    fn peek_repeat(&self, identity: &[u8; 32], now: SystemTime) -> Option<([u8; 32], Settled)> {
        let state = self.lock();
        let (claimed, live) = state.live(identity, now)?;
        // `settled` is an answer only for a succeeded job whose body was kept.
        let repeat = claimed.repeat?;
        let mut settled = live.settled()?;
        settled.head.clone_from(&claimed.head);
        Some((repeat, settled))
    }

    fn remember_repeat(&self, identity: &[u8; 32], job_id: &str, repeat: &dyn Fn() -> [u8; 32]) {
        let repeat = repeat();
        let mut state = self.lock();
        if let Some(claimed) = state.by_key.get_mut(identity) {
            if &*claimed.id == job_id {
                claimed.repeat = Some(repeat);
                claimed.head.get_or_insert_with(ReplayHead::default);
            }
        }
    }

    async fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        Ok(self.lock().jobs.get(id).map(|r| (**r).clone()))
    }

    async fn apply(
        &self,
        id: &str,
        transition: Transition,
        now: SystemTime,
    ) -> Result<Applied, StoreError> {
        let mut state = self.lock();
        let record = state
            .jobs
            .get_mut(id)
            .ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
        let before = Indexed::of(record);
        let outcome = record.apply(transition, now, &self.policy);
        let record = (**record).clone();
        let after = Indexed::of(&record);
        if after != before {
            let id = state.jobs.key(id).expect("just applied").clone();
            state.reindex(&id, Some(before), Some(after));
        }
        drop(state);
        if outcome.is_ok() {
            self.changed.of(id).notify_waiters();
        }
        Ok(Applied { outcome, record })
    }

    async fn wait_change(
        &self,
        id: &str,
        seen_version: u64,
        seen_state: JobState,
        timeout: Duration,
    ) -> Result<JobRecord, StoreError> {
        let seen = (seen_version, seen_state);
        super::wait_for_change(&self.changed, id, seen, timeout, None, || async {
            self.get(id).await
        })
        .await
    }

    async fn unknown_jobs(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        Ok(self.in_state(JobState::Unknown, after, limit))
    }

    async fn lapsed_leases(
        &self,
        now: SystemTime,
        limit: usize,
    ) -> Result<Vec<(JobId, u64)>, StoreError> {
        // In-progress jobs are the ones running now: few, whatever is stored.
        let state = self.lock();
        Ok(state
            .in_progress
            .iter()
            .filter_map(|id| state.jobs.get(id))
            .filter(|r| r.job.lease_until <= now)
            .map(|r| (r.job.id.clone(), r.job.version))
            .take(limit)
            .collect())
    }

    async fn in_progress_jobs(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        Ok(self.in_state(JobState::InProgress, after, limit))
    }

    async fn find(&self, owner: &str, key: &str) -> Result<Option<JobRecord>, StoreError> {
        let index = identity(owner, key);
        let state = self.lock();
        Ok(state
            .by_key
            .get(&index)
            .and_then(|c| state.jobs.get(&c.id))
            .map(|r| (**r).clone()))
    }

    async fn count_unknown(&self) -> Result<usize, StoreError> {
        Ok(self.lock().unknown.len())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: ExpiryPolicy = ExpiryPolicy {
        retention: Duration::from_secs(60),
        late_result_window: Duration::from_secs(30),
    };

    fn record(n: usize, now: SystemTime) -> JobRecord {
        JobRecord::new(
            format!("job_{n:06}"),
            "owner".into(),
            format!("key-{n}"),
            "fp".into(),
            "chat".into(),
            now,
            now + Duration::from_secs(30),
            &POLICY,
        )
    }

    /// The index entries for `record`'s job must be exactly what its state and expiry say.
    fn check_indexes(store: &MemoryStore, record: &JobRecord) {
        let state = store.lock();
        let id = record.job.id.as_str();
        let expiries: Vec<SystemTime> = (state.expiry.iter())
            .filter(|(_, job)| &**job == id)
            .map(|(at, _)| *at)
            .collect();
        assert_eq!(
            expiries,
            [record.job.expires_at],
            "one expiry entry, the record's"
        );
        let listed = |set: &BTreeSet<Id>| set.contains(id);
        assert_eq!(
            listed(&state.in_progress),
            record.job.state == JobState::InProgress,
            "in progress index of a {:?} job",
            record.job.state
        );
        assert_eq!(
            listed(&state.unknown),
            record.job.state == JobState::Unknown,
            "unknown index of a {:?} job",
            record.job.state
        );
        let by_key = state
            .by_key
            .get(&identity(&record.job.owner, &record.job.key));
        assert_eq!(by_key.map(|c| &*c.id), Some(id));
    }

    #[tokio::test]
    async fn indexes_follow_the_record_through_every_state() {
        let store = MemoryStore::new(POLICY);
        let now = crate::clock::now();
        let Claim::Created(record) = store.claim(record(1, now), now).await.unwrap() else {
            panic!("a new job");
        };
        check_indexes(&store, &record);
        crate::store::walk_every_state(&store, &record, now, |r| check_indexes(&store, r)).await;
        // Gone whole when it expires: no index keeps it.
        let state = &mut *store.lock();
        assert_eq!(state.expire(now + Duration::from_secs(86_400 * 365), 10), 1);
        assert_eq!(
            (state.jobs.len(), state.by_key.len(), state.expiry.len()),
            (0, 0, 0)
        );
        assert!(state.in_progress.is_empty() && state.unknown.is_empty());
    }

    #[tokio::test]
    async fn peek_finds_only_the_live_job_of_the_same_owner_and_key() {
        let store = MemoryStore::new(POLICY);
        let now = crate::clock::now();
        let peek = |owner, key, at| store.peek(&identity(owner, key), owner, key, at, "fp");
        assert!(peek("owner", "key-1", now).is_none());
        store.claim(record(1, now), now).await.unwrap();
        let Some(Peeked::Record(found)) = peek("owner", "key-1", now) else {
            panic!("the live job, in progress, whole");
        };
        assert_eq!(found.job.id, "job_000001");
        assert!(peek("other", "key-1", now).is_none(), "another owner");
        assert!(peek("owner", "key-2", now).is_none(), "another key");
        // Once expired, the job is the next claim's to replace, not a peek's to return.
        let later = found.job.expires_at + Duration::from_secs(1);
        assert!(peek("owner", "key-1", later).is_none());
        let mut again = record(2, later);
        again.job.key = "key-1".into();
        let claimed = store.claim(again, later).await.unwrap();
        assert!(matches!(claimed, Claim::Created(r) if r.job.id == "job_000002"));
    }

    /// A succeeded job comes as its answer to a request of the same fingerprint, and whole
    /// to one of another (a conflict, for the engine to refuse).
    #[tokio::test]
    async fn peek_gives_a_succeeded_job_as_its_answer() {
        let store = MemoryStore::new(POLICY);
        let now = crate::clock::now();
        store.claim(record(3, now), now).await.unwrap();
        let start = Transition::StartAttempt {
            version: 1,
            n: 1,
            provider: "primary".into(),
        };
        store.apply("job_000003", start, now).await.unwrap();
        let answer = crate::job::StoredResponse {
            status: 200,
            headers: crate::job::Headers::from_pairs([("content-type", &b"application/json"[..])]),
            body: bytes::Bytes::from_static(b"{\"ok\":true}"),
            body_omitted: false,
        };
        let complete = Transition::Complete {
            n: 1,
            response: answer.clone(),
        };
        store.apply("job_000003", complete, now).await.unwrap();
        let key = identity("owner", "key-3");
        let Some(Peeked::Settled(settled)) = store.peek(&key, "owner", "key-3", now, "fp") else {
            panic!("the answer of a succeeded job");
        };
        assert_eq!(
            (
                settled.job_id.as_str(),
                settled.n,
                settled.provider.as_str()
            ),
            ("job_000003", 1, "primary")
        );
        assert_eq!(settled.response, answer);
        let Some(Peeked::Record(other)) =
            store.peek(&key, "owner", "key-3", now, "another payload")
        else {
            panic!("the record, for a conflict");
        };
        assert_eq!(other.job.state, JobState::Succeeded);
    }

    /// A request digest is given back only for the job it was checked against, only while
    /// that job is one a replay would answer from, and never for the job that takes the
    /// identity after it expired.
    #[tokio::test]
    async fn a_remembered_repeat_belongs_to_its_job_alone() {
        let store = MemoryStore::new(POLICY);
        let now = crate::clock::now();
        let key = identity("owner", "key-4");
        store.claim(record(4, now), now).await.unwrap();
        store.remember_repeat(&key, "job_000004", &|| [7; 32]);
        assert!(
            store.peek_repeat(&key, now).is_none(),
            "an in-progress job has no answer to repeat"
        );
        let start = Transition::StartAttempt {
            version: 1,
            n: 1,
            provider: "primary".into(),
        };
        store.apply("job_000004", start, now).await.unwrap();
        let complete = Transition::Complete {
            n: 1,
            response: crate::job::StoredResponse {
                status: 200,
                headers: crate::job::Headers::default(),
                body: bytes::Bytes::from_static(b"{}"),
                body_omitted: false,
            },
        };
        store.apply("job_000004", complete, now).await.unwrap();
        let (repeat, settled) = store
            .peek_repeat(&key, now)
            .expect("a succeeded job's answer");
        assert_eq!((repeat, settled.job_id.as_str()), ([7; 32], "job_000004"));
        let head = settled.head.expect("a place for the replays' headers");
        head.set(http::HeaderMap::new()).unwrap();
        let (_, again) = store.peek_repeat(&key, now).unwrap();
        assert!(
            again
                .head
                .is_some_and(|h| std::sync::Arc::ptr_eq(&h, &head)),
            "every replay of the job shares its headers"
        );
        store.remember_repeat(&key, "job_999999", &|| [8; 32]);
        assert_eq!(
            store.peek_repeat(&key, now).map(|(r, _)| r),
            Some([7; 32]),
            "another job's digest is not taken"
        );
        assert!(store
            .peek_repeat(&identity("other", "key-4"), now)
            .is_none());

        let later = now + Duration::from_secs(86_400);
        assert!(
            store.peek_repeat(&key, later).is_none(),
            "an expired job is not repeated"
        );
        let mut again = record(5, later);
        again.job.key = "key-4".into();
        store.claim(again, later).await.unwrap();
        assert!(store
            .lock()
            .by_key
            .get(&key)
            .is_some_and(|c| c.repeat.is_none() && c.head.is_none()));
    }

    /// A tick removes every job that is due, however many slices that takes, and nothing
    /// that is not.
    #[tokio::test(start_paused = true)]
    async fn a_sweep_tick_takes_every_due_job_a_slice_at_a_time() {
        let store = MemoryStore::new(POLICY);
        let long_ago = crate::clock::now() - Duration::from_secs(3600);
        let due = 3 * SWEEP_SLICE + 5;
        for n in 0..due {
            store.claim(record(n, long_ago), long_ago).await.unwrap();
        }
        let now = crate::clock::now();
        store.claim(record(due, now), now).await.unwrap();
        // The first tick is at once; the sweep then yields between slices, so let it run.
        for _ in 0..100 {
            if store.lock().jobs.len() == 1 {
                break;
            }
            tokio::task::yield_now().await;
        }
        let state = store.lock();
        assert_eq!(state.jobs.len(), 1, "every due job went in the first tick");
        assert_eq!(
            state
                .jobs
                .get(format!("job_{due:06}").as_str())
                .map(|r| r.job.state),
            Some(JobState::InProgress)
        );
    }

    #[test]
    fn expiry_takes_only_what_is_due_in_bounded_slices() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut state = State::default();
        let insert = |state: &mut State, record: JobRecord| {
            state.insert(identity(&record.job.owner, &record.job.key), record);
        };
        for n in 0..2500 {
            insert(&mut state, record(n, t0));
        }
        let late = t0 + Duration::from_secs(3600);
        insert(&mut state, record(9999, late));
        assert_eq!(state.in_progress.len(), 2501);

        // Past the first jobs' retention + late window, before the last one's.
        let at = t0 + Duration::from_secs(1800);
        assert_eq!(state.expire(at, 1000), 1000);
        assert_eq!(state.expire(at, 1000), 1000);
        assert_eq!(state.expire(at, 1000), 500);
        // The one job that expires later is still there, in every index.
        assert_eq!(state.expire(at, 1000), 0);
        assert_eq!(state.jobs.len(), 1);
        assert_eq!(state.by_key.len(), 1);
        assert_eq!(state.in_progress.len(), 1);
        assert_eq!(state.expiry.len(), 1);
    }
}

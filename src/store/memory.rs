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

use super::{Applied, Changes, Claim, JobStore, StoreError};
use crate::job::{ClaimRule, ExpiryPolicy, JobId, JobRecord, JobState, Transition};

#[derive(Debug)]
pub struct MemoryStore {
    inner: Arc<Mutex<State>>,
    policy: ExpiryPolicy,
    changed: Changes,
}

#[derive(Debug, Default)]
struct State {
    /// (owner, key) → job id: the identity index the claim is atomic over.
    by_key: Sharded<(String, String), JobId>,
    jobs: Sharded<JobId, Box<JobRecord>>,
    in_progress: BTreeSet<JobId>,
    unknown: BTreeSet<JobId>,
    /// (expires_at, id), soonest first: the expiry sweep takes from the front.
    expiry: BTreeSet<(SystemTime, JobId)>,
}

/// A hash map split into 64 by key hash, each part growing on its own, so a resize moves
/// a 64th of the entries; records are boxed so the entries moved are small. One map of
/// 57 000 jobs stopped every request for 239 ms while it doubled (seen by a probe request
/// every 2 ms under `benches/overhead.sh`'s new-job load), and each doubling took twice as
/// long as the one before.
#[derive(Debug)]
struct Sharded<K, V> {
    hasher: std::hash::RandomState,
    shards: Box<[HashMap<K, V>]>,
}

impl<K, V> Default for Sharded<K, V> {
    fn default() -> Self {
        Self {
            hasher: std::hash::RandomState::new(),
            shards: (0..64).map(|_| HashMap::new()).collect(),
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

    fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        let shard = self.shard(key);
        self.shards[shard].remove(key)
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

impl State {
    /// Stores `record` under its identity `(owner, key)`, which the caller already built.
    fn insert(&mut self, identity: (String, String), record: JobRecord) {
        let id = record.job.id.clone();
        self.by_key.insert(identity, id.clone());
        self.reindex(&id, None, Some(Indexed::of(&record)));
        self.jobs.insert(id, Box::new(record));
    }

    fn remove(&mut self, id: &str) {
        if let Some(record) = self.jobs.remove(id) {
            self.reindex(id, Some(Indexed::of(&record)), None);
            self.by_key.remove(&(record.job.owner, record.job.key));
        }
    }

    fn reindex(&mut self, id: &str, old: Option<Indexed>, new: Option<Indexed>) {
        if old == new {
            return;
        }
        if let Some(old) = old {
            self.state_index(old.state).map(|set| set.remove(id));
            self.expiry.remove(&(old.expires_at, id.to_owned()));
        }
        if let Some(new) = new {
            self.state_index(new.state)
                .map(|set| set.insert(id.to_owned()));
            self.expiry.insert((new.expires_at, id.to_owned()));
        }
    }

    fn state_index(&mut self, state: JobState) -> Option<&mut BTreeSet<JobId>> {
        match state {
            JobState::InProgress => Some(&mut self.in_progress),
            JobState::Unknown => Some(&mut self.unknown),
            _ => None,
        }
    }

    /// Removes jobs past their expiry; at most `limit`, so one sweep never holds the lock
    /// for long.
    fn expire(&mut self, now: SystemTime, limit: usize) -> usize {
        let expired: Vec<JobId> = self
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
            Some(after) => std::ops::Bound::Excluded(after.to_owned()),
            None => std::ops::Bound::Unbounded,
        };
        index
            .range((from, std::ops::Bound::Unbounded))
            .take(limit)
            .cloned()
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave a half-applied transition: records
        // are replaced only after the pure transition returned.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

async fn sweep(state: Weak<Mutex<State>>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        let Some(state) = state.upgrade() else { return };
        // In slices of 1000 with the lock let go in between, so requests interleave.
        loop {
            let now = crate::clock::now();
            let removed = state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .expire(now, 1000);
            if removed < 1000 {
                break;
            }
            tokio::task::yield_now().await;
        }
    }
}

#[async_trait]
impl JobStore for MemoryStore {
    async fn claim(&self, record: JobRecord, now: SystemTime) -> Result<Claim, StoreError> {
        let mut state = self.lock();
        let index = (record.job.owner.clone(), record.job.key.clone());
        if let Some(id) = state.by_key.get(&index).cloned() {
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
        state.reindex(id, Some(before), Some(Indexed::of(&record)));
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
        let state = self.lock();
        Ok(state
            .by_key
            .get(&(owner.to_owned(), key.to_owned()))
            .and_then(|id| state.jobs.get(id))
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

    #[test]
    fn expiry_takes_only_what_is_due_in_bounded_slices() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut state = State::default();
        let insert = |state: &mut State, record: JobRecord| {
            let identity = (record.job.owner.clone(), record.job.key.clone());
            state.insert(identity, record);
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

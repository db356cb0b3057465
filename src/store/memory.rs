//! The in-memory store: one process, nothing durable. For tests, development and as the
//! reference the other stores are held to by the conformance suite.
//!
//! One `std::sync::Mutex` guards everything: every critical section is a hash lookup plus a
//! pure transition, never held across an `.await`, so a finer-grained scheme would buy
//! nothing measurable next to a provider round trip.

use std::collections::HashMap;
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
    by_key: HashMap<(String, String), JobId>,
    jobs: HashMap<JobId, JobRecord>,
}

impl State {
    fn remove(&mut self, id: &str) {
        if let Some(record) = self.jobs.remove(id) {
            self.by_key.remove(&(record.job.owner, record.job.key));
        }
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

    /// Ids of jobs in `state`, in id order, after `after`, at most `limit`.
    fn in_state(&self, state: JobState, after: Option<&str>, limit: usize) -> Vec<JobId> {
        let mut ids: Vec<JobId> = self
            .lock()
            .jobs
            .values()
            .filter(|r| r.job.state == state)
            .map(|r| r.job.id.clone())
            .filter(|id| after.is_none_or(|after| id.as_str() > after))
            .collect();
        ids.sort_unstable();
        ids.truncate(limit);
        ids
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
        let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
        let now = crate::clock::now();
        let expired: Vec<JobId> = state
            .jobs
            .iter()
            .filter(|(_, record)| record.is_expired(now))
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            state.remove(&id);
        }
    }
}

#[async_trait]
impl JobStore for MemoryStore {
    async fn claim(&self, record: JobRecord, now: SystemTime) -> Result<Claim, StoreError> {
        let mut state = self.lock();
        let index = (record.job.owner.clone(), record.job.key.clone());
        if let Some(id) = state.by_key.get(&index).cloned() {
            let existing = state.jobs.get(&id);
            match JobRecord::claim_rule(existing, now) {
                ClaimRule::Keep => {
                    return Ok(Claim::Existing(existing.expect("kept").clone()));
                }
                ClaimRule::Replace | ClaimRule::Create => state.remove(&id),
            }
        }
        state.by_key.insert(index, record.job.id.clone());
        state.jobs.insert(record.job.id.clone(), record.clone());
        Ok(Claim::Created(record))
    }

    async fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        Ok(self.lock().jobs.get(id).cloned())
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
        let outcome = record.apply(transition, now, &self.policy);
        let record = record.clone();
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
        let state = self.lock();
        let mut lapsed: Vec<(JobId, u64)> = state
            .jobs
            .values()
            .filter(|r| r.job.state == JobState::InProgress && r.job.lease_until <= now)
            .map(|r| (r.job.id.clone(), r.job.version))
            .collect();
        lapsed.sort_unstable();
        lapsed.truncate(limit);
        Ok(lapsed)
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
            .cloned())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

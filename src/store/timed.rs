//! `store.op_timeout` for every store: an operation that does not answer in time counts as
//! the store failing (SPEC §7), so a hung store fails requests closed within a bound instead
//! of holding them for as long as its client library would wait.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use super::{Applied, Claim, JobStore, MirroredStream, Peeked, StoreError, StreamUpdate};
use crate::job::{JobId, JobRecord, JobState, Settled, Transition};

#[derive(Debug)]
pub struct Timed {
    inner: Arc<dyn JobStore>,
    limit: Duration,
}

impl Timed {
    pub fn new(inner: Arc<dyn JobStore>, limit: Duration) -> Arc<Self> {
        Arc::new(Self { inner, limit })
    }

    async fn bounded<T>(
        &self,
        limit: Duration,
        op: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(limit, op).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::unavailable(
                "store",
                format!("no answer within op_timeout ({limit:?})"),
            )),
        }
    }
}

#[async_trait]
impl JobStore for Timed {
    async fn claim(&self, record: JobRecord, now: SystemTime) -> Result<Claim, StoreError> {
        self.bounded(self.limit, self.inner.claim(record, now))
            .await
    }

    async fn claim_identified(
        &self,
        identity: &[u8; 32],
        record: JobRecord,
        now: SystemTime,
    ) -> Result<Claim, StoreError> {
        self.bounded(
            self.limit,
            self.inner.claim_identified(identity, record, now),
        )
        .await
    }

    fn peek(
        &self,
        identity: &[u8; 32],
        owner: &str,
        key: &str,
        now: SystemTime,
        fingerprint: &str,
    ) -> Option<Peeked> {
        self.inner.peek(identity, owner, key, now, fingerprint)
    }

    fn peek_repeat(&self, identity: &[u8; 32], now: SystemTime) -> Option<([u8; 32], Settled)> {
        self.inner.peek_repeat(identity, now)
    }

    fn remember_repeat(&self, identity: &[u8; 32], job_id: &str, repeat: &dyn Fn() -> [u8; 32]) {
        self.inner.remember_repeat(identity, job_id, repeat);
    }

    async fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        self.bounded(self.limit, self.inner.get(id)).await
    }

    async fn apply(
        &self,
        id: &str,
        transition: Transition,
        now: SystemTime,
    ) -> Result<Applied, StoreError> {
        self.bounded(self.limit, self.inner.apply(id, transition, now))
            .await
    }

    async fn wait_change(
        &self,
        id: &str,
        seen_version: u64,
        seen_state: JobState,
        timeout: Duration,
    ) -> Result<JobRecord, StoreError> {
        let wait = self
            .inner
            .wait_change(id, seen_version, seen_state, timeout);
        self.bounded(timeout + self.limit, wait).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.bounded(self.limit, self.inner.ping()).await
    }

    async fn unknown_jobs(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        self.bounded(self.limit, self.inner.unknown_jobs(after, limit))
            .await
    }

    async fn lapsed_leases(
        &self,
        now: SystemTime,
        limit: usize,
    ) -> Result<Vec<(JobId, u64)>, StoreError> {
        self.bounded(self.limit, self.inner.lapsed_leases(now, limit))
            .await
    }

    async fn in_progress_jobs(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        self.bounded(self.limit, self.inner.in_progress_jobs(after, limit))
            .await
    }

    async fn find(&self, owner: &str, key: &str) -> Result<Option<JobRecord>, StoreError> {
        self.bounded(self.limit, self.inner.find(owner, key)).await
    }

    async fn count_unknown(&self) -> Result<usize, StoreError> {
        self.bounded(self.limit, self.inner.count_unknown()).await
    }

    async fn mirror_stream(&self, id: &str, update: StreamUpdate) -> Result<(), StoreError> {
        self.bounded(self.limit, self.inner.mirror_stream(id, update))
            .await
    }

    async fn read_stream(
        &self,
        id: &str,
        from: usize,
    ) -> Result<Option<MirroredStream>, StoreError> {
        self.bounded(self.limit, self.inner.read_stream(id, from))
            .await
    }
}

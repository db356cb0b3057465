//! A store that misbehaves between a write and its reply, for tests: it wraps a real store
//! and, as a plan or a seed decides, fails an operation before it reaches the store, fails
//! it *after* the store applied it (the reply is lost), delays it, or never answers.

#![allow(dead_code, unreachable_pub)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use idemgate::job::{JobId, JobRecord, JobState, Transition};
use idemgate::store::{Applied, Claim, JobStore, MirroredStream, StoreError, StreamUpdate};

/// What happens to one operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The store never sees it; the caller gets an error.
    ErrorBefore,
    /// The store applies it; the caller gets an error (the reply was lost).
    ErrorAfter,
    /// It is applied after a pause.
    Delay(Duration),
    /// It never answers (a frozen store): only the caller's own timeout ends it.
    Hang,
}

#[derive(Debug)]
enum Plan {
    /// The next writes meet these faults, one each (`None`: no fault), then none.
    Script(VecDeque<Option<Fault>>),
    /// Each write meets a fault with probability `rate` (per mille), drawn from a seed.
    Random { rng: fastrand::Rng, per_mille: u32 },
}

/// How often each fault fired.
#[derive(Debug, Default)]
pub struct Fired {
    pub error_before: AtomicU64,
    pub error_after: AtomicU64,
    pub delay: AtomicU64,
    pub hang: AtomicU64,
}

/// Where a simulated gateway dies: at its `at`-th write through this store, before the
/// write reaches the store or just after it (its reply never read).
pub struct CrashPoint {
    pub at: u64,
    pub after_write: bool,
    pub crash: Box<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for CrashPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CrashPoint({}, after_write: {})",
            self.at, self.after_write
        )
    }
}

/// What a write whose reply was lost fails with: the store applied it.
pub const REPLY_LOST: &str = "the reply was lost after the write";

#[derive(Debug)]
pub struct Faulty {
    inner: Arc<dyn JobStore>,
    plan: Mutex<Plan>,
    crash: Mutex<Option<CrashPoint>>,
    writes: AtomicU64,
    /// Whether claims meet faults too (transitions always do).
    claims: bool,
    /// Faults for the next writes of a stream's mirror, in order, apart from `plan`.
    mirror: Mutex<VecDeque<Option<Fault>>>,
    /// The next mirror write of this step waits for a permit of this before it reaches the
    /// store.
    held: Mutex<Option<(&'static str, Arc<tokio::sync::Semaphore>)>>,
    /// Told of every mirror write that reached the store: its step and its attempt.
    mirrored: Mutex<Option<tokio::sync::mpsc::UnboundedSender<(&'static str, u32)>>>,
    pub fired: Fired,
}

impl Faulty {
    /// Faults for the next writes, in order.
    pub fn scripted(inner: Arc<dyn JobStore>, faults: &[Option<Fault>]) -> Arc<Self> {
        Arc::new(Self {
            inner,
            plan: Mutex::new(Plan::Script(faults.iter().copied().collect())),
            claims: true,
            mirror: Mutex::default(),
            held: Mutex::default(),
            mirrored: Mutex::default(),
            crash: Mutex::new(None),
            writes: AtomicU64::new(0),
            fired: Fired::default(),
        })
    }

    /// Crashes the gateway using this store at one of its writes.
    pub fn crash_at(&self, point: CrashPoint) {
        *self.crash.lock().unwrap() = Some(point);
    }

    /// Random faults at `per_mille` of the transitions (and of the claims, with `claims`),
    /// from `seed`: error before, error after, a short delay — never a hang, which only a
    /// caller with a timeout can survive.
    pub fn seeded(inner: Arc<dyn JobStore>, seed: u64, per_mille: u32, claims: bool) -> Arc<Self> {
        Arc::new(Self {
            inner,
            plan: Mutex::new(Plan::Random {
                rng: fastrand::Rng::with_seed(seed),
                per_mille,
            }),
            claims,
            mirror: Mutex::default(),
            held: Mutex::default(),
            mirrored: Mutex::default(),
            crash: Mutex::new(None),
            writes: AtomicU64::new(0),
            fired: Fired::default(),
        })
    }

    /// Faults for the next mirror writes of live streams, in order.
    pub fn mirror_faults(&self, faults: &[Option<Fault>]) {
        self.mirror.lock().unwrap().extend(faults.iter().copied());
    }

    /// Holds the next mirror write of `step` (`"head"`, `"chunks"` or `"end"`) until the
    /// returned semaphore is given a permit, as a write that lands late.
    pub fn hold_next_mirror(&self, step: &'static str) -> Arc<tokio::sync::Semaphore> {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        *self.held.lock().unwrap() = Some((step, gate.clone()));
        gate
    }

    /// Every mirror write that reached the store from now on, as `("head" | "chunks" |
    /// "end", attempt)`.
    pub fn watch_mirror(&self) -> tokio::sync::mpsc::UnboundedReceiver<(&'static str, u32)> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        *self.mirrored.lock().unwrap() = Some(tx);
        rx
    }

    /// Queues more scripted faults.
    pub fn then(&self, fault: Option<Fault>) {
        if let Plan::Script(queue) = &mut *self.plan.lock().unwrap() {
            queue.push_back(fault);
        }
    }

    fn next(&self) -> Option<Fault> {
        match &mut *self.plan.lock().unwrap() {
            Plan::Script(queue) => queue.pop_front().flatten(),
            Plan::Random { rng, per_mille } => {
                (rng.u32(0..1000) < *per_mille).then(|| match rng.u8(0..3) {
                    0 => Fault::ErrorBefore,
                    1 => Fault::ErrorAfter,
                    _ => Fault::Delay(Duration::from_millis(rng.u64(1..20))),
                })
            }
        }
    }

    async fn write<T>(
        &self,
        op: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let lost = |what: &str| StoreError::unavailable("injected fault", what.to_owned());
        let write = self.writes.fetch_add(1, Ordering::Relaxed);
        let crash = {
            let mut point = self.crash.lock().unwrap();
            if point.as_ref().is_some_and(|p| p.at == write) {
                point.take()
            } else {
                None
            }
        };
        if let Some(point) = crash {
            // The process dies here: its tasks stop at their next await, and whoever was
            // waiting for this write (a client of the dead gateway) sees its connection go.
            if point.after_write {
                let _ = op.await;
            }
            (point.crash)();
            return Err(lost("the gateway crashed"));
        }
        self.meet(self.next(), op).await
    }

    /// Runs `op` as `fault` has it, counting the fault.
    async fn meet<T>(
        &self,
        fault: Option<Fault>,
        op: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let lost = |what: &str| StoreError::unavailable("injected fault", what.to_owned());
        match fault {
            None => op.await,
            Some(Fault::ErrorBefore) => {
                self.fired.error_before.fetch_add(1, Ordering::Relaxed);
                Err(lost("the connection dropped before the write"))
            }
            Some(Fault::ErrorAfter) => {
                self.fired.error_after.fetch_add(1, Ordering::Relaxed);
                let _ = op.await?;
                Err(lost(REPLY_LOST))
            }
            Some(Fault::Delay(pause)) => {
                self.fired.delay.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(pause).await;
                op.await
            }
            Some(Fault::Hang) => {
                self.fired.hang.fetch_add(1, Ordering::Relaxed);
                std::future::pending().await
            }
        }
    }
}

#[async_trait]
impl JobStore for Faulty {
    async fn claim(&self, record: JobRecord, now: SystemTime) -> Result<Claim, StoreError> {
        if !self.claims {
            return self.inner.claim(record, now).await;
        }
        self.write(self.inner.claim(record, now)).await
    }

    async fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        self.inner.get(id).await
    }

    async fn apply(
        &self,
        id: &str,
        transition: Transition,
        now: SystemTime,
    ) -> Result<Applied, StoreError> {
        self.write(self.inner.apply(id, transition, now)).await
    }

    async fn wait_change(
        &self,
        id: &str,
        seen_version: u64,
        seen_state: JobState,
        timeout: Duration,
    ) -> Result<JobRecord, StoreError> {
        self.inner
            .wait_change(id, seen_version, seen_state, timeout)
            .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }

    async fn unknown_jobs(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        self.inner.unknown_jobs(after, limit).await
    }

    async fn in_progress_jobs(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        self.inner.in_progress_jobs(after, limit).await
    }

    async fn find(&self, owner: &str, key: &str) -> Result<Option<JobRecord>, StoreError> {
        self.inner.find(owner, key).await
    }

    async fn count_unknown(&self) -> Result<usize, StoreError> {
        self.inner.count_unknown().await
    }

    async fn lapsed_leases(
        &self,
        now: SystemTime,
        limit: usize,
    ) -> Result<Vec<(JobId, u64)>, StoreError> {
        self.inner.lapsed_leases(now, limit).await
    }

    async fn mirror_stream(&self, id: &str, update: StreamUpdate) -> Result<(), StoreError> {
        let step = match &update {
            StreamUpdate::Head(head) => ("head", head.n),
            StreamUpdate::Chunks { n, .. } => ("chunks", *n),
            StreamUpdate::End { n, .. } => ("end", *n),
        };
        let held = {
            let mut held = self.held.lock().unwrap();
            match &*held {
                Some((held_step, _)) if *held_step == step.0 => held.take(),
                _ => None,
            }
        };
        if let Some((_, gate)) = held {
            gate.acquire().await.expect("the gate stays open").forget();
        }
        let fault = self.mirror.lock().unwrap().pop_front().flatten();
        let written = self.meet(fault, self.inner.mirror_stream(id, update)).await;
        if written.is_ok() {
            if let Some(tx) = &*self.mirrored.lock().unwrap() {
                let _ = tx.send(step);
            }
        }
        written
    }

    async fn read_stream(
        &self,
        id: &str,
        from: usize,
    ) -> Result<Option<MirroredStream>, StoreError> {
        self.inner.read_stream(id, from).await
    }
}

/// Counts of faults, for reports.
pub fn report(fired: &Fired) -> String {
    format!(
        "faults fired: {} error-before, {} error-after (reply lost), {} delays, {} hangs",
        fired.error_before.load(Ordering::Relaxed),
        fired.error_after.load(Ordering::Relaxed),
        fired.delay.load(Ordering::Relaxed),
        fired.hang.load(Ordering::Relaxed)
    )
}

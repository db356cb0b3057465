//! The embedded store, idemgate's default: one node, on disk, nothing to install.
//!
//! The jobs live in a [redb] file: pure Rust, ACID transactions over copy-on-write
//! B-trees, and a file lock that keeps a second process off the same file. (sled is
//! unmaintained; SQLite would bring C and a SQL layer we do not need; RocksDB brings C++
//! and minutes of build.) What makes a write durable, though, is the store's own journal
//! beside it.
//!
//! # Durability: a journal, synced per group
//!
//! A claim and a settled job are on disk before the response that depends on them is sent,
//! and there is no setting that trades this away: a gateway that forgets a claim after a
//! crash could run an intent twice, which is the one thing it exists to prevent. One writer
//! thread takes every operation waiting in its queue (up to 512), runs them in order — each
//! atomic, each seeing the changes of the ones before it — and appends the jobs they change
//! to the [journal] as one sequential write, syncs it once, and only then makes the changes
//! visible and answers them all. Under load many claims and settles share one sync; alone, a
//! request pays exactly one, of a few KB written where the last group ended.
//!
//! Committing each group to the B-trees instead cost a copy, a checksum and a write of every
//! page the group touched in every table, twice per job (claim, settle), most of it the
//! writer's CPU: at one client 0.4 ms a commit, at 32 clients 53 µs of CPU per job.
//!
//! # Checkpoints
//!
//! The tables are brought up to date by a checkpointer thread, every second or 8 MiB of
//! journal: it takes every job the [overlay] holds (each job once, at its latest version,
//! so a job claimed and settled between two checkpoints is written once), writes them in
//! one transaction, commits it with a sync, and only then drops them from the overlay and
//! resets the journal file they were in. Reads look in the overlay first and then in the
//! file. At open, the frames left in the journal (by a crash, or a close whose last
//! checkpoint failed) are applied to the tables before anything is served; each frame is a
//! job's whole version or its deletion, so applying frames the tables already hold again,
//! in order, ends in the same tables.
//!
//! # Layout
//!
//! - No claim index: which job holds each (owner, key) is kept in memory ([claims]), built
//!   at open from the ids in `expiry`, as a job id carries the hash of its (owner, key).
//!   `claim_rows`: row key → that hash, for the jobs whose ids do not carry it. Files
//!   written before kept `claims`, owner NUL key → job id; opening such a file files its
//!   jobs from their rows once and drops it.
//! - `job_rows`: row key → the job and its attempts (postcard), without the stored answer.
//! - `response_rows`: row key → the stored answer.
//!
//!   A row key is the job id with its time-ordered part first (see [`row_key`]). Ids begin
//!   with a shard tag, a hash: keyed by id, every new job landed on a random page of the
//!   B-tree. Keyed by time, the jobs of one checkpoint share the rightmost pages. Files
//!   written before keep `jobs` and `responses` keyed by id; opening such a file moves their
//!   rows once, in the transaction that opens it.
//! - `expiry`: (expires_at in ms, job id) → (), so the retention sweep finds expired jobs
//!   without scanning, and does bounded work per tick.
//! - `unknown`, `in_progress`: the jobs an operator must resolve and the leases the lease
//!   sweep watches.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use redb::{Database, ReadableTable, TableDefinition};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, error, info};

mod claims;
mod journal;
mod overlay;
mod tables;
mod writer;

use self::claims::{ClaimIndex, ClaimKey, CLAIM_ROWS};
use self::journal::Journal;
use self::overlay::Overlay;
use self::tables::Tables;
use self::writer::{Change, Op, Writer};
use super::{decode, encode, encode_into, Applied, Changes, Claim, JobStore, Peeked, StoreError};
use crate::job::{ExpiryPolicy, JobId, JobRecord, JobState, Transition};

const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("job_rows");
const RESPONSES: TableDefinition<&str, &[u8]> = TableDefinition::new("response_rows");
/// The tables of files written before rows were keyed by time: id → the same values.
const LEGACY_JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs");
const LEGACY_RESPONSES: TableDefinition<&str, &[u8]> = TableDefinition::new("responses");
/// The claims of files written before `claim_rows`: owner NUL key → job id.
const LEGACY_CLAIMS: TableDefinition<&[u8], &str> = TableDefinition::new("claims");
const EXPIRY: TableDefinition<(u64, &str), ()> = TableDefinition::new("expiry");
/// Ids of the jobs that are `unknown`: what an operator must resolve, without a scan.
const UNKNOWN: TableDefinition<&str, ()> = TableDefinition::new("unknown");
/// Jobs `in_progress` → their lease's end (ms): what the lease sweep reads.
const IN_PROGRESS: TableDefinition<&str, u64> = TableDefinition::new("in_progress");

#[derive(Debug)]
pub struct EmbeddedStore {
    shared: Arc<Shared>,
    writer: mpsc::UnboundedSender<Op>,
    /// Joined on drop, so the last checkpoint is made and the file is closed (and its lock
    /// released) when the store is.
    thread: Option<std::thread::JoinHandle<()>>,
    changed: Arc<Changes>,
    stats: Arc<CommitStats>,
}

/// How well group commit is doing: operations per durable commit (journal sync).
#[derive(Debug, Default)]
pub struct CommitStats {
    pub commits: std::sync::atomic::AtomicU64,
    pub operations: std::sync::atomic::AtomicU64,
}

/// What the store's threads and its readers share.
#[derive(Debug)]
pub(super) struct Shared {
    db: Database,
    overlay: Mutex<Overlay>,
    /// Which job holds each claim, for the jobs the file has. Brought up to date by a
    /// checkpoint after its commit and before its changes leave the overlay, so a claim
    /// is always in one or the other.
    claims: Mutex<ClaimIndex>,
    /// The most jobs the overlay may hold: past it, checkpoints are failing (the file cannot
    /// be written while the journal can), and writes are refused until one succeeds rather
    /// than held in memory without end.
    overlay_limit: usize,
    /// The file's path as errors show it.
    path: String,
    /// Makes every checkpoint fail, as a file that cannot be written would.
    #[cfg(test)]
    failing: std::sync::atomic::AtomicBool,
}

/// [`Shared::overlay_limit`]: at 32 clients on one core a checkpoint takes ~8 000 jobs a
/// second, so this is about half a minute of failed checkpoints, and ~0.7 GB of records
/// with 2 KB answers.
const OVERLAY_LIMIT: usize = 200_000;

impl Shared {
    fn overlay(&self) -> MutexGuard<'_, Overlay> {
        // Changes are published whole, after the pure transitions ran: a panic elsewhere
        // while the lock is held leaves nothing half-done.
        self.overlay.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn unavailable(&self, e: impl Into<crate::body::BoxError>) -> StoreError {
        StoreError::unavailable(format!("embedded store {}", self.path), e)
    }

    /// A table as the file has it now, on a read snapshot of its own.
    fn table<K: redb::Key + 'static, V: redb::Value + 'static>(
        &self,
        definition: TableDefinition<K, V>,
    ) -> Result<redb::ReadOnlyTable<K, V>, StoreError> {
        let txn = self.db.begin_read().map_err(|e| self.unavailable(e))?;
        txn.open_table(definition).map_err(|e| self.unavailable(e))
    }

    /// The job's latest version: the overlay's, else the file's.
    fn job(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        self.latest(id, Answer::With)
    }

    /// As [`Shared::job`]; a version read from the file comes without its answer when
    /// `answer` says so (one from the overlay has it either way).
    fn latest(&self, id: &str, answer: Answer) -> Result<Option<JobRecord>, StoreError> {
        if let Some(version) = self.overlay().job(id) {
            return Ok(version.as_deref().cloned());
        }
        self.read(id, answer)
    }

    fn claims(&self) -> MutexGuard<'_, ClaimIndex> {
        self.claims.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The job holding a claim key, at its latest version: the overlay's claim, else the
    /// file's.
    fn holder(&self, key: &ClaimKey) -> Result<Option<JobRecord>, StoreError> {
        self.holder_with(key, |id| self.job(id))
    }

    /// As [`Shared::holder`], with jobs read by `load` (a group reads its own changes
    /// first).
    fn holder_with(
        &self,
        key: &ClaimKey,
        load: impl Fn(&str) -> Result<Option<JobRecord>, StoreError>,
    ) -> Result<Option<JobRecord>, StoreError> {
        let claimed = self.overlay().claim(&key.bytes);
        match claimed {
            Some(Some(id)) => load(&id),
            Some(None) => Ok(None),
            None => {
                let candidates = self.claims().candidates(key.hash);
                for id in candidates {
                    if let Some(found) = load(&id)?.filter(|found| key.names(found)) {
                        return Ok(Some(found));
                    }
                }
                Ok(None)
            }
        }
    }

    /// Whether job `id`, whose claim key `key` is, holds it in the overlay or the file.
    fn holds(&self, key: &ClaimKey, id: &str) -> bool {
        let claimed = self.overlay().claim(&key.bytes);
        match claimed {
            Some(holder) => holder.as_deref() == Some(id),
            None => self.claims().candidates(key.hash).iter().any(|c| c == id),
        }
    }

    /// The job as the file has it, with its answer if `answer` asks for it.
    fn read(&self, id: &str, answer: Answer) -> Result<Option<JobRecord>, StoreError> {
        let txn = self.db.begin_read().map_err(|e| self.unavailable(e))?;
        let row = row_key(id);
        let jobs = txn.open_table(JOBS).map_err(|e| self.unavailable(e))?;
        let Some(bytes) = jobs.get(row.as_str()).map_err(|e| self.unavailable(e))? else {
            return Ok(None);
        };
        let mut record: JobRecord = decode(bytes.value())?;
        if answer == Answer::With && record.job.state == JobState::Succeeded {
            let responses = txn.open_table(RESPONSES).map_err(|e| self.unavailable(e))?;
            if let Some(bytes) = responses
                .get(row.as_str())
                .map_err(|e| self.unavailable(e))?
            {
                record.job.response = Some(decode(bytes.value())?);
            }
        }
        Ok(Some(record))
    }

    /// Writes every job the overlay holds to the tables in one transaction, commits it
    /// with a sync, then drops from the overlay what did not change meanwhile.
    fn checkpoint(&self) -> Result<(), StoreError> {
        #[cfg(test)]
        if self.failing.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(self.unavailable("the file cannot be written"));
        }
        let mut snapshot = self.overlay().snapshot();
        if !snapshot.jobs.is_empty() {
            // In the order of their rows: the overlay's order is its hash map's, and each
            // put then landed on a leaf of its own among the thousands a checkpoint dirties.
            snapshot.jobs.sort_by_cached_key(|(id, _)| row_key(id));
            let txn = self.db.begin_write().map_err(|e| self.unavailable(e))?;
            let changes = {
                let mut tables = Tables::open(&txn).map_err(|e| self.unavailable(e))?;
                for (id, version) in &snapshot.jobs {
                    match version {
                        Some(record) => tables.put(record),
                        None => tables.delete(id),
                    }
                    .map_err(|e| self.unavailable(e))?;
                }
                tables.into_claim_changes()
            };
            txn.commit().map_err(|e| self.unavailable(e))?;
            // The overlay holds these claims until the retirement below, so readers find
            // them there meanwhile: the index takes them in short holds of its lock, not
            // one as long as a checkpoint's thousands of changes.
            let mut changes = changes.into_iter().peekable();
            while changes.peek().is_some() {
                let mut claims = self.claims();
                for change in changes.by_ref().take(256) {
                    claims.apply(change);
                }
            }
        }
        self.overlay().retire(snapshot.upto);
        Ok(())
    }

    /// Ids in an index, in id order, after `after`, at most `limit`: the file's index with
    /// the jobs the overlay holds judged by their latest version (`listed`) instead.
    fn ids_in<V: redb::Value + 'static>(
        &self,
        index: TableDefinition<&str, V>,
        listed: impl Fn(&JobRecord) -> bool,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        let (overridden, matching) = self.overlay().matching(listed);
        let mut ids: Vec<JobId> = matching
            .into_iter()
            .map(|record| record.job.id.clone())
            .filter(|id| after.is_none_or(|after| id.as_str() > after))
            .collect();
        let table = self.table(index)?;
        let range = match after {
            Some(after) => {
                table.range::<&str>((std::ops::Bound::Excluded(after), std::ops::Bound::Unbounded))
            }
            None => table.range::<&str>(..),
        }
        .map_err(|e| self.unavailable(e))?;
        let mut from_file = 0;
        for entry in range {
            if from_file == limit {
                break;
            }
            let (id, _) = entry.map_err(|e| self.unavailable(e))?;
            if !overridden.contains(id.value()) {
                ids.push(id.value().to_owned());
                from_file += 1;
            }
        }
        ids.sort_unstable();
        ids.truncate(limit);
        Ok(ids)
    }
}

/// Whether a read from the file decodes the job's answer too: a deletion, for one, has no
/// use for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Answer {
    With,
    Without,
}

/// `Database::create`, with redb's assertions on a truncated file turned into an error: its
/// checks run before it writes anything, so the file is left as it was.
fn create(path: &Path) -> Result<Database, String> {
    let opened = quietly(|| Database::create(path));
    match opened {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("the file is truncated or damaged".into()),
    }
}

std::thread_local! {
    /// Set while this thread runs [`quietly`].
    static QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, catching a panic of it without the panic hook's report. The hook is the
/// process's: a silent one swapped in around `f` would silence every other thread's panics
/// meanwhile, and two threads doing so at once could leave it in place for good (each puts
/// back what it took, and the second took the first one's silent hook). So the hook is
/// wrapped once, and the wrapper is silent only on a thread inside `f`.
fn quietly<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    static WRAPPED: std::sync::Once = std::sync::Once::new();
    WRAPPED.call_once(|| {
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(std::cell::Cell::get) {
                report(info);
            }
        }));
    });
    QUIET.with(|quiet| quiet.set(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    QUIET.with(|quiet| quiet.set(false));
    result
}

impl Drop for EmbeddedStore {
    fn drop(&mut self) {
        // Closing the queue ends the writer once it has answered what it holds and made
        // the last checkpoint.
        let (closed, _) = mpsc::unbounded_channel();
        drop(std::mem::replace(&mut self.writer, closed));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl EmbeddedStore {
    /// Opens (or creates) the store at `path`, with its journal beside it, and applies what
    /// the journal holds. A file that is not a redb database, a journal file that is not
    /// one, or a path that cannot be written is refused with its path; nothing is
    /// overwritten.
    pub fn open(path: &Path, policy: ExpiryPolicy) -> Result<Self, StoreError> {
        Self::open_with(path, policy, OVERLAY_LIMIT)
    }

    fn open_with(
        path: &Path,
        policy: ExpiryPolicy,
        overlay_limit: usize,
    ) -> Result<Self, StoreError> {
        let shown = path.display().to_string();
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            StoreError::unavailable(format!("embedded store {shown}: {what}"), e.to_string())
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| fail("cannot create its directory", &e))?;
        }
        let db = create(path).map_err(|e| fail("cannot open it as a database", &e))?;
        let txn = db
            .begin_write()
            .map_err(|e| fail("cannot write to it", &e))?;
        {
            txn.open_table(CLAIM_ROWS)
                .map_err(|e| fail("cannot open table claim_rows", &e))?;
            txn.open_table(JOBS)
                .map_err(|e| fail("cannot open table jobs", &e))?;
            txn.open_table(RESPONSES)
                .map_err(|e| fail("cannot open table responses", &e))?;
            txn.open_table(EXPIRY)
                .map_err(|e| fail("cannot open table expiry", &e))?;
            txn.open_table(UNKNOWN)
                .map_err(|e| fail("cannot open table unknown", &e))?;
            txn.open_table(IN_PROGRESS)
                .map_err(|e| fail("cannot open table in_progress", &e))?;
        }
        let moved = move_legacy_rows(&txn)
            .map_err(|e| fail("cannot move its jobs to the time-ordered layout", &e))?;
        let filed = file_legacy_claims(&txn)
            .map_err(|e| fail("cannot file its claims in time order", &e))?;
        let (mut journal, recovered) = Journal::open(path).map_err(|e| fail("its journal", &e))?;
        let replayed = recovered.len();
        {
            let mut tables = Tables::open(&txn).map_err(|e| fail("cannot write to it", &e))?;
            for (seq, payload) in recovered {
                let change: Change = decode(&payload)
                    .map_err(|e| fail(&format!("journal frame {seq} cannot be read"), &e))?;
                tables
                    .change(change)
                    .map_err(|e| fail("cannot apply its journal", &e))?;
            }
        }
        txn.commit().map_err(|e| fail("cannot write to it", &e))?;
        journal
            .reset_all()
            .map_err(|e| fail("cannot reset its journal", &e))?;
        if moved > 0 {
            info!(path = %shown, jobs = moved, "embedded store: jobs moved to the time-ordered layout");
        }
        if let Some(filed) = filed {
            info!(path = %shown, jobs = filed, "embedded store: claims filed in time order");
        }
        let claims = db
            .begin_read()
            .map_err(|e| fail("cannot read it", &e))
            .and_then(|txn| {
                let expiry = txn
                    .open_table(EXPIRY)
                    .map_err(|e| fail("cannot open table expiry", &e))?;
                let rows = txn
                    .open_table(CLAIM_ROWS)
                    .map_err(|e| fail("cannot open table claim_rows", &e))?;
                ClaimIndex::load(&expiry, &rows).map_err(|e| fail("cannot read its claims", &e))
            })?;
        debug!(
            path = %shown,
            jobs = claims.len(),
            bytes = claims.bytes(),
            "embedded store: claim index loaded"
        );
        if replayed > 0 {
            info!(path = %shown, changes = replayed, "embedded store: changes applied from its journal");
        }

        let shared = Arc::new(Shared {
            db,
            overlay: Mutex::new(Overlay::default()),
            claims: Mutex::new(claims),
            overlay_limit,
            path: shown.clone(),
            #[cfg(test)]
            failing: Default::default(),
        });
        let changed = Arc::new(Changes::new());
        let stats = Arc::new(CommitStats::default());
        let (sender, queue) = mpsc::unbounded_channel();
        let writer = Writer {
            shared: shared.clone(),
            journal,
            changed: changed.clone(),
            policy,
            stats: stats.clone(),
            runtime: tokio::runtime::Handle::try_current().ok(),
        };
        let thread = std::thread::Builder::new()
            .name("idemgate-store".into())
            .spawn(move || writer.run(queue))
            .map_err(|e| fail("cannot start its writer", &e))?;
        let store = Self {
            shared,
            writer: sender,
            thread: Some(thread),
            changed,
            stats,
        };
        store.spawn_sweeper(policy);
        info!(path = %shown, "embedded store open");
        Ok(store)
    }

    /// Commits and operations so far.
    pub fn commit_stats(&self) -> &CommitStats {
        &self.stats
    }

    /// Returns once the tables in the file hold every change made before the call.
    pub async fn checkpoint(&self) -> Result<(), StoreError> {
        self.submit(|reply| Op::Checkpoint { reply }).await
    }

    fn spawn_sweeper(&self, policy: ExpiryPolicy) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let writer = self.writer.downgrade();
        let every =
            (policy.retention / 10).clamp(Duration::from_millis(100), Duration::from_secs(30));
        runtime.spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                match sweep_due(&writer, crate::clock::now()).await {
                    Some(Ok(0)) => {}
                    Some(Ok(n)) => debug!(expired = n, "retention sweep"),
                    Some(Err(e)) => error!(error = %e, "retention sweep failed"),
                    None => return,
                }
            }
        });
    }

    async fn submit<T>(
        &self,
        op: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Op,
    ) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.writer
            .send(op(reply))
            .map_err(|_| self.shared.unavailable("the writer has stopped"))?;
        answer
            .await
            .map_err(|_| self.shared.unavailable("the writer has stopped"))?
    }

    /// The live job of (owner, key), if any.
    fn read_claim(&self, key: &ClaimKey, now: SystemTime) -> Result<Option<JobRecord>, StoreError> {
        Ok(self
            .shared
            .holder(key)?
            .filter(|found| !found.is_expired(now)))
    }
}

/// Moves the rows of a file written before rows were keyed by time into the current
/// tables, and drops the old ones; returns how many jobs it moved.
fn move_legacy_rows(txn: &redb::WriteTransaction) -> tables::TxResult<usize> {
    use redb::TableHandle;
    let present: Vec<String> = txn
        .list_tables()?
        .map(|table| table.name().to_owned())
        .collect();
    let mut moved = 0;
    for (legacy, current) in [(LEGACY_JOBS, JOBS), (LEGACY_RESPONSES, RESPONSES)] {
        if !present.iter().any(|name| name == legacy.name()) {
            continue;
        }
        {
            let from = txn.open_table(legacy)?;
            let mut to = txn.open_table(current)?;
            for row in from.iter()? {
                let (id, value) = row?;
                to.insert(row_key(id.value()).as_str(), value.value())?;
                if legacy.name() == LEGACY_JOBS.name() {
                    moved += 1;
                }
            }
        }
        txn.delete_table(legacy)?;
    }
    Ok(moved)
}

/// Builds `claim_rows` from the rows of a file written with a `claims` table, and drops
/// that; returns how many jobs it filed, `None` for a file that has no `claims` table.
/// `claim_rows` is built anew: a file this version wrote and an earlier one then opened
/// (which creates `claims`, and deletes rows without their `claim_rows` entries) is
/// filed again from its rows alone.
fn file_legacy_claims(txn: &redb::WriteTransaction) -> tables::TxResult<Option<usize>> {
    use redb::TableHandle;
    let present = txn
        .list_tables()?
        .any(|table| table.name() == LEGACY_CLAIMS.name());
    if !present {
        return Ok(None);
    }
    txn.delete_table(CLAIM_ROWS)?;
    let mut filed = 0;
    {
        let jobs = txn.open_table(JOBS)?;
        let mut rows = txn.open_table(CLAIM_ROWS)?;
        for row in jobs.iter()? {
            let (row, value) = row?;
            let record: JobRecord = decode(value.value())?;
            let hash = claims::hash_of(&record.job.owner, &record.job.key);
            if claims::carried_hash(&record.job.id) != Some(hash) {
                rows.insert(row.value(), hash)?;
            }
            filed += 1;
        }
    }
    txn.delete_table(LEGACY_CLAIMS)?;
    Ok(Some(filed))
}

/// The key of a job's rows in `job_rows` and `response_rows`: `t`, the id's time-ordered
/// part, then its shard tag — a permutation of the id, so lookups by id need no index. An
/// id not minted by [`crate::job::new_job_id`] is kept whole behind `i`.
fn row_key(id: &str) -> String {
    match crate::job::id_parts(id) {
        // The tag's length is fixed, so the key still names one id.
        Some((tag, time)) => ["t", time, tag].concat(),
        None => format!("i{id}"),
    }
}

/// The job id of a row key: [`row_key`]'s inverse.
fn id_of_row(row: &str) -> JobId {
    match row.strip_prefix('t') {
        Some(rest) if rest.len() >= crate::job::SHARD_TAG_LEN => {
            let (time, tag) = rest.split_at(rest.len() - crate::job::SHARD_TAG_LEN);
            ["job_", tag, time].concat()
        }
        _ => row.strip_prefix('i').unwrap_or(row).to_owned(),
    }
}

fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Deletes every job due at `now`, [`writer::SWEEP_LIMIT`] at most per operation, so the claims and
/// settles queued meanwhile are answered between the batches. `None` once the store is
/// gone; the writer is held only while a batch is handed over, so dropping the store never
/// waits for a sweep.
async fn sweep_due(
    writer: &mpsc::WeakUnboundedSender<Op>,
    now: SystemTime,
) -> Option<Result<usize, StoreError>> {
    let mut total = 0;
    let mut from = None;
    loop {
        let (reply, answer) = oneshot::channel();
        writer
            .upgrade()?
            .send(Op::Sweep { now, from, reply })
            .ok()?;
        match answer.await.ok()? {
            Ok(swept) => {
                total += swept.removed;
                match swept.next {
                    Some(next) => from = Some(next),
                    None => return Some(Ok(total)),
                }
            }
            Err(e) => return Some(Err(e)),
        }
    }
}

impl EmbeddedStore {
    /// A claim of `record` filed under `key`. A key that names a live job needs no write:
    /// answer from a read, so replays and duplicates never queue behind the writer or pay
    /// for a sync.
    async fn claim_keyed(
        &self,
        key: ClaimKey,
        record: JobRecord,
        now: SystemTime,
    ) -> Result<Claim, StoreError> {
        if let Some(existing) = self.read_claim(&key, now)? {
            return Ok(Claim::Existing(existing));
        }
        self.submit(|reply| Op::Claim {
            record: Box::new(record),
            key,
            now,
            reply,
        })
        .await
    }
}

#[async_trait]
impl JobStore for EmbeddedStore {
    async fn claim(&self, record: JobRecord, now: SystemTime) -> Result<Claim, StoreError> {
        let key = ClaimKey::of(&record);
        self.claim_keyed(key, record, now).await
    }

    async fn claim_identified(
        &self,
        identity: &[u8; 32],
        record: JobRecord,
        now: SystemTime,
    ) -> Result<Claim, StoreError> {
        let key = ClaimKey::with_identity(&record.job.owner, &record.job.key, identity);
        debug_assert_eq!(key, ClaimKey::of(&record));
        self.claim_keyed(key, record, now).await
    }

    /// The claim's own read, without the job a claim is handed: a replay or a duplicate is
    /// answered without minting a job id and a first attempt only for the claim to drop
    /// them. A read that fails is left to the claim to report.
    fn peek(
        &self,
        identity: &[u8; 32],
        owner: &str,
        key: &str,
        now: SystemTime,
        fingerprint: &str,
    ) -> Option<Peeked> {
        let claim = ClaimKey::with_identity(owner, key, identity);
        let live = self.read_claim(&claim, now).ok()??;
        Some(Peeked::of_owned(live, fingerprint, now))
    }

    async fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        self.shared.job(id)
    }

    async fn apply(
        &self,
        id: &str,
        transition: Transition,
        now: SystemTime,
    ) -> Result<Applied, StoreError> {
        self.submit(|reply| Op::Apply {
            id: id.to_owned(),
            transition,
            now,
            reply,
        })
        .await
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
            self.shared.job(id)
        })
        .await
    }

    async fn lapsed_leases(
        &self,
        now: SystemTime,
        limit: usize,
    ) -> Result<Vec<(JobId, u64)>, StoreError> {
        let lapsed = |record: &JobRecord| {
            record.job.state == JobState::InProgress && record.job.lease_until <= now
        };
        let (overridden, matching) = self.shared.overlay().matching(lapsed);
        let mut found: Vec<(JobId, u64)> = matching
            .into_iter()
            .map(|record| (record.job.id.clone(), record.job.version))
            .collect();
        let due: Vec<String> = {
            let leases = self.shared.table(IN_PROGRESS)?;
            let iter = leases.iter().map_err(|e| self.shared.unavailable(e))?;
            iter.filter_map(Result::ok)
                .filter(|(id, lease)| {
                    lease.value() <= millis(now) && !overridden.contains(id.value())
                })
                .map(|(id, _)| id.value().to_owned())
                .take(limit)
                .collect()
        };
        for id in due {
            if let Some(record) = self.shared.job(&id)?.filter(|r| lapsed(r)) {
                found.push((id, record.job.version));
            }
        }
        found.truncate(limit);
        Ok(found)
    }

    async fn in_progress_jobs(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        self.shared.ids_in(
            IN_PROGRESS,
            |r| r.job.state == JobState::InProgress,
            after,
            limit,
        )
    }

    async fn find(&self, owner: &str, key: &str) -> Result<Option<JobRecord>, StoreError> {
        self.shared.holder(&ClaimKey::new(owner, key))
    }

    async fn count_unknown(&self) -> Result<usize, StoreError> {
        use redb::ReadableTableMetadata;
        let (overridden, matching) = self
            .shared
            .overlay()
            .matching(|r| r.job.state == JobState::Unknown);
        let unknown = self.shared.table(UNKNOWN)?;
        let mut count = unknown.len().map_err(|e| self.shared.unavailable(e))?;
        for id in overridden {
            if unknown
                .get(id.as_str())
                .map_err(|e| self.shared.unavailable(e))?
                .is_some()
            {
                count -= 1;
            }
        }
        Ok(usize::try_from(count).unwrap_or(usize::MAX) + matching.len())
    }

    async fn unknown_jobs(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        self.shared
            .ids_in(UNKNOWN, |r| r.job.state == JobState::Unknown, after, limit)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.shared
            .db
            .begin_read()
            .map(drop)
            .map_err(|e| self.shared.unavailable(e))
    }
}

#[cfg(test)]
mod tests {
    use super::writer::SWEEP_LIMIT;
    use super::*;
    use crate::job::{new_job_id, Effect, StoredResponse};
    use redb::ReadableTable;

    const POLICY: ExpiryPolicy = ExpiryPolicy {
        retention: Duration::from_secs(3600),
        late_result_window: Duration::from_secs(600),
    };

    /// A new job for (owner, key), as the engine hands it to a claim.
    fn fresh(owner: &str, key: &str, now: SystemTime) -> JobRecord {
        JobRecord::new(
            new_job_id(owner, key),
            owner.into(),
            key.into(),
            "fp".into(),
            "chat".into(),
            now,
            now + Duration::from_secs(30),
            &POLICY,
        )
    }

    /// A job that won with `body`, as the store would hold it.
    fn settled(owner: &str, key: &str, body: &'static str) -> JobRecord {
        let now = crate::clock::now();
        let mut record = fresh(owner, key, now);
        let start = Transition::StartAttempt {
            version: record.job.version,
            n: 1,
            provider: "p".into(),
        };
        assert!(matches!(
            record.apply(start, now, &POLICY),
            Ok(Effect::AttemptStarted { .. })
        ));
        let complete = Transition::Complete {
            n: 1,
            response: StoredResponse {
                status: 200,
                headers: vec![("content-type".into(), "application/json".into())].into(),
                body: body.into(),
                body_omitted: false,
            },
        };
        assert!(matches!(
            record.apply(complete, now, &POLICY),
            Ok(Effect::Won)
        ));
        record
    }

    /// A row is the record with its answer blanked, field for field: in the store's
    /// encoding and, for the names, in JSON.
    #[test]
    fn a_row_encodes_as_the_record_without_its_answer() {
        let record = settled("owner", "key", "{\"answer\":42}");
        assert!(record.job.response.is_some() && !record.attempts.is_empty());
        let mut blanked = record.clone();
        blanked.job.response = None;
        let row = tables::Unanswered(&record);
        assert_eq!(encode(&row), encode(&blanked));
        assert_eq!(
            serde_json::to_value(&row).unwrap(),
            serde_json::to_value(&blanked).unwrap()
        );
    }

    #[test]
    fn row_keys_put_time_first_and_never_meet_other_ids() {
        let id = new_job_id("owner", "key");
        let key = row_key(&id);
        let tag = crate::job::shard_tag(&id).expect("a minted id has a tag");
        assert_eq!(key.len(), id.len() - 3);
        assert!(key.starts_with('t'));
        assert!(key.ends_with(tag));
        assert_eq!(&key[1..key.len() - tag.len()], &id[4 + tag.len()..]);
        // Same time part, other tags: keys of one instant sort together, apart by tag.
        assert_ne!(row_key(&id), row_key(&new_job_id("owner", "other")));
        assert_eq!(row_key("job_1"), "ijob_1");
        assert_eq!(row_key("anything"), "ianything");
    }

    /// What the index tables hold for `id`, read directly.
    fn indexed(db: &Database, id: &str) -> tables::Indexed {
        let txn = db.begin_read().unwrap();
        let expiry = txn.open_table(EXPIRY).unwrap();
        let expires: Vec<u64> = expiry
            .iter()
            .unwrap()
            .filter_map(|entry| {
                let (key, _) = entry.unwrap();
                let (at, job) = key.value();
                (job == id).then_some(at)
            })
            .collect();
        assert_eq!(expires.len(), 1, "one expiry entry per job: {expires:?}");
        let unknown = txn.open_table(UNKNOWN).unwrap();
        let in_progress = txn.open_table(IN_PROGRESS).unwrap();
        tables::Indexed::new(
            expires[0],
            unknown.get(id).unwrap().is_some(),
            in_progress.get(id).unwrap().map(|v| v.value()),
        )
    }

    /// Writes `versions` to the tables as a checkpoint or the journal's replay does.
    fn write(db: &Database, versions: &[(&str, Option<&JobRecord>)]) {
        let txn = db.begin_write().unwrap();
        {
            let mut tables = Tables::open(&txn).unwrap();
            for (id, version) in versions {
                match version {
                    Some(record) => tables.put(record).unwrap(),
                    None => tables.delete(id).unwrap(),
                }
            }
        }
        txn.commit().unwrap();
    }

    /// Everything the tables hold, as text, for comparing two files.
    fn dump(db: &Database) -> Vec<String> {
        let txn = db.begin_read().unwrap();
        let mut rows = Vec::new();
        for entry in txn.open_table(CLAIM_ROWS).unwrap().iter().unwrap() {
            let (k, v) = entry.unwrap();
            rows.push(format!("claim_rows {} {}", k.value(), v.value()));
        }
        for (name, def) in [("jobs", JOBS), ("responses", RESPONSES)] {
            for entry in txn.open_table(def).unwrap().iter().unwrap() {
                let (k, v) = entry.unwrap();
                rows.push(format!("{name} {} {:?}", k.value(), v.value()));
            }
        }
        for entry in txn.open_table(EXPIRY).unwrap().iter().unwrap() {
            rows.push(format!("expiry {:?}", entry.unwrap().0.value()));
        }
        for entry in txn.open_table(UNKNOWN).unwrap().iter().unwrap() {
            rows.push(format!("unknown {}", entry.unwrap().0.value()));
        }
        for entry in txn.open_table(IN_PROGRESS).unwrap().iter().unwrap() {
            let (k, v) = entry.unwrap();
            rows.push(format!("in_progress {} {}", k.value(), v.value()));
        }
        rows
    }

    fn tables_db(dir: &tempfile::TempDir, name: &str) -> Database {
        let db = Database::create(dir.path().join(name)).unwrap();
        let txn = db.begin_write().unwrap();
        drop(Tables::open(&txn).unwrap());
        txn.commit().unwrap();
        db
    }

    #[tokio::test]
    async fn indexes_follow_the_record_through_every_state() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let db = tables_db(&dir, "idx.db");
        // The memory store walks the job; each version is written as a checkpoint would.
        let memory = crate::store::memory::MemoryStore::new(POLICY);
        let now = crate::clock::now();
        let Claim::Created(record) = memory.claim(fresh("owner", "k", now), now).await.unwrap()
        else {
            panic!("a new job");
        };
        let id = record.job.id.clone();
        let check = |record: &JobRecord| {
            write(&db, &[(&id, Some(record))]);
            assert_eq!(
                indexed(&db, &id),
                tables::Indexed::of(record),
                "indexes of a {:?} job",
                record.job.state
            );
        };
        check(&record);
        crate::store::walk_every_state(&memory, &record, now, check).await;
        write(&db, &[(&id, None)]);
        assert_eq!(dump(&db), Vec::<String>::new(), "a deletion leaves nothing");
    }

    /// Each frame sets what it names outright: replaying frames the tables already hold,
    /// from any point on, ends in the same tables, and so does writing only each job's
    /// latest version, in any order, as a checkpoint does.
    #[test]
    fn frames_applied_again_or_folded_into_a_checkpoint_end_in_the_same_tables() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let now = crate::clock::now();
        // Job a takes key k; b takes key j and settles; a expires and c takes k over.
        let a = fresh("owner", "k", now);
        let b = fresh("owner", "j", now);
        let b_done = settled("owner", "j", r#"{"b":1}"#);
        let b_done = JobRecord {
            job: crate::job::Job {
                id: b.job.id.clone(),
                ..b_done.job
            },
            ..b_done
        };
        let c = fresh("owner", "k", now);
        let frames: Vec<(&str, Option<&JobRecord>)> = vec![
            (&a.job.id, Some(&a)),
            (&b.job.id, Some(&b)),
            (&b.job.id, Some(&b_done)),
            (&a.job.id, None),
            (&c.job.id, Some(&c)),
        ];
        let once = tables_db(&dir, "once.db");
        write(&once, &frames);
        let expected = dump(&once);
        assert!(expected.iter().any(|row| row.contains(&c.job.id)));
        assert!(!expected.iter().any(|row| row.contains(&a.job.id)));

        for from in 0..frames.len() {
            for upto in from..=frames.len() {
                // The tables hold frames ..upto (a checkpoint's), then the journal's frames
                // from `from` on are applied again.
                let db = tables_db(&dir, &format!("again-{from}-{upto}.db"));
                write(&db, &frames[..upto]);
                write(&db, &frames[from..]);
                assert_eq!(dump(&db), expected, "frames {from}.. again over ..{upto}");
            }
        }
        let latest = [
            (&*c.job.id, Some(&c)),
            (&*a.job.id, None),
            (&*b.job.id, Some(&b_done)),
        ];
        for order in [[0, 1, 2], [1, 0, 2], [2, 1, 0]] {
            let db = tables_db(&dir, &format!("folded-{order:?}.db"));
            let versions: Vec<_> = order.iter().map(|&i| latest[i]).collect();
            write(&db, &versions);
            assert_eq!(dump(&db), expected, "folded, in order {order:?}");
        }
    }

    #[tokio::test]
    async fn what_was_answered_before_a_crash_is_there_after_it() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("crash.db");
        let now = crate::clock::now();
        let (settled_id, running_id, swept_key) = {
            let store = EmbeddedStore::open(&path, POLICY).expect("the store opens");
            let Claim::Created(done) = store.claim(fresh("o", "done", now), now).await.unwrap()
            else {
                panic!("a new job");
            };
            crate::store::walk_every_state(&store, &done, now, |_| {}).await;
            // Half of it reaches the tables before the crash, half is only in the journal.
            store.checkpoint().await.unwrap();
            let Claim::Created(running) = store.claim(fresh("o", "run", now), now).await.unwrap()
            else {
                panic!("a new job");
            };
            let start = Transition::StartAttempt {
                version: running.job.version,
                n: 1,
                provider: "p".into(),
            };
            store.apply(&running.job.id, start, now).await.unwrap();
            let long_ago = now - 3 * (POLICY.retention + POLICY.late_result_window);
            store
                .claim(fresh("o", "old", long_ago), long_ago)
                .await
                .unwrap();
            store.checkpoint().await.unwrap();
            assert_eq!(
                sweep_due(&store.writer.downgrade(), now)
                    .await
                    .unwrap()
                    .unwrap(),
                1
            );
            store.writer.send(Op::Crash).unwrap();
            (done.job.id, running.job.id, "old")
        };

        let store = EmbeddedStore::open(&path, POLICY).expect("the store reopens");
        let done = store
            .get(&settled_id)
            .await
            .unwrap()
            .expect("the settled job");
        assert_eq!(done.job.state, JobState::Succeeded);
        assert_eq!(done.job.response.expect("its answer").body, "late");
        let running = store
            .find("o", "run")
            .await
            .unwrap()
            .expect("the running job");
        assert_eq!(running.job.id, running_id);
        assert_eq!(running.job.state, JobState::InProgress);
        assert_eq!(running.attempts.len(), 1);
        assert_eq!(
            store.in_progress_jobs(None, 10).await.unwrap(),
            vec![running_id.clone()]
        );
        assert!(
            store.find("o", swept_key).await.unwrap().is_none(),
            "the sweep holds"
        );
        // And it is all in the tables once the store closes.
        drop(store);
        let db = Database::create(&path).unwrap();
        let rows = dump(&db);
        assert!(rows
            .iter()
            .any(|r| r.starts_with("in_progress") && r.contains(&running_id)));
        // Both jobs' ids carry their claims: the file needs no entry of its own for them.
        assert_eq!(
            rows.iter().filter(|r| r.starts_with("expiry")).count(),
            2,
            "{rows:?}"
        );
        assert!(
            !rows.iter().any(|r| r.starts_with("claim_rows")),
            "{rows:?}"
        );
    }

    #[tokio::test]
    async fn reads_and_listings_see_the_journal_before_the_tables_do() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let store = EmbeddedStore::open(&dir.path().join("o.db"), POLICY).unwrap();
        let now = crate::clock::now();
        let mut ids = Vec::new();
        for key in ["a", "b", "c"] {
            let Claim::Created(record) = store.claim(fresh("o", key, now), now).await.unwrap()
            else {
                panic!("a new job");
            };
            ids.push(record.job.id);
        }
        ids.sort();
        // Two in the tables, one only in the overlay; one of the two changed since.
        store.checkpoint().await.unwrap();
        let Claim::Created(late) = store.claim(fresh("o", "d", now), now).await.unwrap() else {
            panic!("a new job");
        };
        let record = store.get(&ids[0]).await.unwrap().unwrap();
        let gone = Transition::MarkUnknown {
            version: record.job.version,
        };
        store.apply(&ids[0], gone, now).await.unwrap();

        let mut in_progress = vec![ids[1].clone(), ids[2].clone(), late.job.id.clone()];
        in_progress.sort();
        assert_eq!(store.in_progress_jobs(None, 10).await.unwrap(), in_progress);
        assert_eq!(
            store.in_progress_jobs(None, 2).await.unwrap(),
            in_progress[..2]
        );
        assert_eq!(
            store
                .in_progress_jobs(Some(&in_progress[0]), 10)
                .await
                .unwrap(),
            in_progress[1..]
        );
        assert_eq!(
            store.unknown_jobs(None, 10).await.unwrap(),
            vec![ids[0].clone()]
        );
        assert_eq!(store.count_unknown().await.unwrap(), 1);
        let later = now + Duration::from_secs(3600);
        assert_eq!(store.lapsed_leases(later, 10).await.unwrap().len(), 3);

        // The same after a checkpoint, from the tables alone.
        store.checkpoint().await.unwrap();
        assert_eq!(store.in_progress_jobs(None, 10).await.unwrap(), in_progress);
        assert_eq!(
            store.unknown_jobs(None, 10).await.unwrap(),
            vec![ids[0].clone()]
        );
        assert_eq!(store.count_unknown().await.unwrap(), 1);
        assert_eq!(store.lapsed_leases(later, 10).await.unwrap().len(), 3);
    }

    #[tokio::test]
    async fn writes_are_refused_while_checkpoints_fail_and_resume_once_one_succeeds() {
        use std::sync::atomic::Ordering::Relaxed;
        let dir = tempfile::tempdir().expect("a temp dir");
        let store = EmbeddedStore::open_with(&dir.path().join("f.db"), POLICY, 4).unwrap();
        store.shared.failing.store(true, Relaxed);
        let now = crate::clock::now();
        for n in 0..4 {
            let claimed = store.claim(fresh("o", &format!("k{n}"), now), now).await;
            assert!(matches!(claimed, Ok(Claim::Created(_))), "{claimed:?}");
        }
        assert!(store.checkpoint().await.is_err());
        let refused = store.claim(fresh("o", "k4", now), now).await.unwrap_err();
        assert!(refused.to_string().contains("checkpoints"), "{refused}");
        // What is held is still read, and a key that has a job still finds it.
        let held = store.claim(fresh("o", "k0", now), now).await.unwrap();
        assert!(matches!(held, Claim::Existing(_)), "{held:?}");

        store.shared.failing.store(false, Relaxed);
        store.checkpoint().await.unwrap();
        let claimed = store.claim(fresh("o", "k4", now), now).await.unwrap();
        assert!(matches!(claimed, Claim::Created(_)), "{claimed:?}");
        store.checkpoint().await.unwrap();
        assert_eq!(store.shared.overlay().len(), 0);
        for n in 0..5 {
            assert!(store.find("o", &format!("k{n}")).await.unwrap().is_some());
        }
    }

    #[tokio::test]
    async fn a_sweep_takes_every_due_job_in_batches_and_nothing_live() {
        let dir = tempfile::tempdir().expect("a temp dir");
        // Opened outside the runtime, so no background sweeper races the one called here.
        let path = dir.path().join("sweep.db");
        let store = std::thread::spawn(move || EmbeddedStore::open(&path, POLICY))
            .join()
            .unwrap()
            .unwrap();
        let now = crate::clock::now();
        let long_ago = now - 3 * (POLICY.retention + POLICY.late_result_window);
        let due = 2 * SWEEP_LIMIT + 1;
        let mut ids = Vec::new();
        for n in 0..due {
            let Claim::Created(record) = store
                .claim(fresh("owner", &format!("old-{n}"), long_ago), long_ago)
                .await
                .unwrap()
            else {
                panic!("a new job");
            };
            ids.push(record.job.id);
        }
        let Claim::Created(live) = store.claim(fresh("owner", "live", now), now).await.unwrap()
        else {
            panic!("a new job");
        };
        // The sweep finds due jobs through the tables' expiry index.
        store.checkpoint().await.unwrap();

        let swept = sweep_due(&store.writer.downgrade(), now).await;
        assert_eq!(swept.expect("the store is open").unwrap(), due);
        for id in [&ids[0], &ids[SWEEP_LIMIT], &ids[due - 1]] {
            assert!(store.get(id).await.unwrap().is_none(), "{id} is swept");
        }
        assert!(store.get(&live.job.id).await.unwrap().is_some());
        let again = sweep_due(&store.writer.downgrade(), now).await;
        assert_eq!(again.expect("the store is open").unwrap(), 0);
        store.checkpoint().await.unwrap();
        assert!(store.find("owner", "old-0").await.unwrap().is_none());
        assert_eq!(
            store.find("owner", "live").await.unwrap().map(|r| r.job.id),
            Some(live.job.id)
        );
    }

    #[tokio::test]
    async fn a_file_keyed_by_id_is_moved_once_to_time_ordered_rows() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("old.db");
        let old = settled("owner", "k1", r#"{"old":true}"#);
        let id = old.job.id.clone();
        {
            // The layout of earlier files: jobs and responses keyed by the id itself.
            let db = Database::create(&path).expect("a database");
            let txn = db.begin_write().expect("a write");
            {
                let mut row = old.clone();
                let response = row.job.response.take().expect("an answer");
                let mut jobs = txn.open_table(LEGACY_JOBS).unwrap();
                jobs.insert(id.as_str(), encode(&row).as_slice()).unwrap();
                let mut responses = txn.open_table(LEGACY_RESPONSES).unwrap();
                responses
                    .insert(id.as_str(), encode(&response).as_slice())
                    .unwrap();
                let mut claims = txn.open_table(LEGACY_CLAIMS).unwrap();
                claims
                    .insert(ClaimKey::of(&row).bytes.as_slice(), id.as_str())
                    .unwrap();
                // What an earlier version leaves of a file this one wrote: the entry of a
                // job whose row it deleted.
                let mut stale = txn.open_table(CLAIM_ROWS).unwrap();
                stale.insert("ijob_gone", 7).unwrap();
                let mut expiry = txn.open_table(EXPIRY).unwrap();
                expiry
                    .insert((millis(row.job.expires_at), id.as_str()), ())
                    .unwrap();
            }
            txn.commit().unwrap();
        }

        for _ in 0..2 {
            let store = EmbeddedStore::open(&path, POLICY).expect("the store opens");
            let found = store.get(&id).await.unwrap().expect("the job was moved");
            assert_eq!(found.job.state, JobState::Succeeded);
            let answer = found.job.response.expect("with its answer");
            assert_eq!(answer.body, r#"{"old":true}"#);
            let by_identity = store.find("owner", "k1").await.unwrap();
            assert_eq!(by_identity.map(|r| r.job.id), Some(id.clone()));
            // The same intent again is the same job, replayed.
            let retry = settled("owner", "k1", "never stored");
            match store.claim(retry, crate::clock::now()).await.unwrap() {
                Claim::Existing(existing) => assert_eq!(existing.job.id, id),
                Claim::Created(_) => panic!("a moved job lost its identity"),
            }
        }

        let db = Database::create(&path).expect("the file reopens");
        let txn = db.begin_read().unwrap();
        let names: Vec<String> = {
            use redb::TableHandle;
            txn.list_tables()
                .unwrap()
                .map(|t| t.name().to_owned())
                .collect()
        };
        assert!(
            !names
                .iter()
                .any(|n| n == "jobs" || n == "responses" || n == "claims"),
            "{names:?}"
        );
        assert!(names.iter().any(|n| n == "job_rows"), "{names:?}");
        // The job's id carries its claim, and the stale entry is gone.
        let filed = txn.open_table(CLAIM_ROWS).unwrap();
        assert_eq!(filed.iter().unwrap().count(), 0);
    }

    /// A peek reads what a claim would find: the live job of the same owner and key, as its
    /// answer to a request of the same fingerprint and whole to any other, and nothing once
    /// it has expired (the next claim's to replace).
    #[tokio::test]
    async fn a_peek_finds_what_a_claim_would() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let store = EmbeddedStore::open(&dir.path().join("peek.db"), POLICY).unwrap();
        let now = crate::clock::now();
        let identity = crate::job::claim_digest_bytes("owner", "key");
        let peek = |owner, key, at, fingerprint| store.peek(&identity, owner, key, at, fingerprint);
        assert!(peek("owner", "key", now, "fp").is_none());
        let Claim::Created(record) = store.claim(fresh("owner", "key", now), now).await.unwrap()
        else {
            panic!("a new job");
        };
        let id = record.job.id.clone();
        let Some(Peeked::Record(found)) = peek("owner", "key", now, "fp") else {
            panic!("the job in progress, whole");
        };
        assert_eq!(found.job.id, id);
        assert!(peek("other", "key", now, "fp").is_none(), "another owner");
        assert!(peek("owner", "other", now, "fp").is_none(), "another key");

        let start = Transition::StartAttempt {
            version: record.job.version,
            n: 1,
            provider: "p".into(),
        };
        store.apply(&id, start, now).await.unwrap();
        let answer = StoredResponse {
            status: 200,
            headers: vec![("content-type".into(), "application/json".into())].into(),
            body: "{\"ok\":true}".into(),
            body_omitted: false,
        };
        let complete = Transition::Complete {
            n: 1,
            response: answer.clone(),
        };
        store.apply(&id, complete, now).await.unwrap();
        let Some(Peeked::Settled(settled)) = peek("owner", "key", now, "fp") else {
            panic!("the answer of a succeeded job");
        };
        assert_eq!((settled.job_id.as_str(), settled.n), (id.as_str(), 1));
        assert_eq!(settled.response, answer);
        let Some(Peeked::Record(other)) = peek("owner", "key", now, "another payload") else {
            panic!("the record, for a conflict");
        };
        assert_eq!(other.job.state, JobState::Succeeded);
        let later = other.job.expires_at + Duration::from_secs(1);
        assert!(peek("owner", "key", later, "fp").is_none());
    }

    #[tokio::test]
    async fn claims_are_found_again_after_a_reopen_and_a_sweep_files_them_away() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("claims.db");
        let now = crate::clock::now();
        let keys: Vec<String> = (0..300).map(|i| format!("{:08x}-key", i * 7919)).collect();
        let mut ids = Vec::new();
        {
            let store = EmbeddedStore::open(&path, POLICY).unwrap();
            for key in &keys {
                let Claim::Created(record) = store.claim(fresh("o", key, now), now).await.unwrap()
                else {
                    panic!("a new job");
                };
                ids.push(record.job.id);
            }
            // Half reach the file by a checkpoint, half by the journal at the next open.
            store.checkpoint().await.unwrap();
            for key in &keys[..150] {
                let Claim::Existing(found) = store.claim(fresh("o", key, now), now).await.unwrap()
                else {
                    panic!("{key} was claimed");
                };
                assert_eq!(found.job.key, *key);
            }
        }
        let store = EmbeddedStore::open(&path, POLICY).unwrap();
        assert_eq!(store.shared.claims().len(), keys.len());
        for (key, id) in keys.iter().zip(&ids) {
            let found = store
                .find("o", key)
                .await
                .unwrap()
                .expect("the job of its key");
            assert_eq!(&found.job.id, id);
            match store.claim(fresh("o", key, now), now).await.unwrap() {
                Claim::Existing(existing) => assert_eq!(&existing.job.id, id),
                Claim::Created(_) => panic!("{key} was claimed twice"),
            }
            assert!(store.find("other", key).await.unwrap().is_none());
        }
        // Swept jobs leave the index with their rows, once checkpointed.
        let later = now + POLICY.retention + POLICY.late_result_window + Duration::from_secs(1);
        let swept = sweep_due(&store.writer.downgrade(), later).await;
        assert_eq!(swept.expect("the store is open").unwrap(), keys.len());
        store.checkpoint().await.unwrap();
        assert_eq!(store.shared.claims().len(), 0);
        assert!(store.find("o", &keys[0]).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn jobs_whose_ids_do_not_carry_their_claim_are_filed_beside_them() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("odd.db");
        let now = crate::clock::now();
        let mut odd = fresh("o", "odd", now);
        odd.job.id = "job_1".into();
        let mut other = fresh("o", "other", now);
        other.job.id = new_job_id("o", "not-other");
        {
            let store = EmbeddedStore::open(&path, POLICY).unwrap();
            for record in [odd.clone(), other.clone()] {
                assert!(matches!(
                    store.claim(record, now).await.unwrap(),
                    Claim::Created(_)
                ));
            }
            store.checkpoint().await.unwrap();
        }
        let rows = dump(&Database::create(&path).unwrap());
        assert_eq!(
            rows.iter().filter(|r| r.starts_with("claim_rows")).count(),
            2,
            "{rows:?}"
        );
        let store = EmbeddedStore::open(&path, POLICY).unwrap();
        for (key, id) in [("odd", &odd.job.id), ("other", &other.job.id)] {
            let found = store.find("o", key).await.unwrap().expect("its job");
            assert_eq!(&found.job.id, id);
        }
        assert!(store.find("o", "not-other").await.unwrap().is_none());
        let later = now + POLICY.retention + POLICY.late_result_window + Duration::from_secs(1);
        let swept = sweep_due(&store.writer.downgrade(), later).await;
        assert_eq!(swept.expect("the store is open").unwrap(), 2);
        store.checkpoint().await.unwrap();
        assert_eq!(store.shared.claims().len(), 0);
        drop(store);
        let rows = dump(&Database::create(&path).unwrap());
        assert!(rows.is_empty(), "{rows:?}");
    }

    #[tokio::test]
    async fn a_job_filed_under_another_keys_hash_is_not_that_keys_job() {
        // Two identities whose hashes share 64 bits cannot be made on purpose: the file is
        // written as if they did, the job of "k1" filed under the hash of "k2" as well.
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("collide.db");
        let now = crate::clock::now();
        let first = {
            let store = EmbeddedStore::open(&path, POLICY).unwrap();
            let Claim::Created(first) = store.claim(fresh("o", "k1", now), now).await.unwrap()
            else {
                panic!("a new job");
            };
            first
        };
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut rows = txn.open_table(CLAIM_ROWS).unwrap();
                let row = row_key(&first.job.id);
                // The row key names the job; its value, the hash it is filed under.
                rows.insert(row.as_str(), ClaimKey::new("o", "k2").hash)
                    .unwrap();
            }
            txn.commit().unwrap();
        }
        let store = EmbeddedStore::open(&path, POLICY).unwrap();
        let k2 = ClaimKey::new("o", "k2");
        assert_eq!(
            store.shared.claims().candidates(k2.hash),
            vec![first.job.id.clone()]
        );
        assert!(store.find("o", "k2").await.unwrap().is_none());
        let Claim::Created(second) = store.claim(fresh("o", "k2", now), now).await.unwrap() else {
            panic!("k2 is a job of its own");
        };
        assert_ne!(second.job.id, first.job.id);
        let again = store.find("o", "k2").await.unwrap().expect("k2's job");
        assert_eq!(again.job.id, second.job.id);
    }
}

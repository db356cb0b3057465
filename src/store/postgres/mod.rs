//! The PostgreSQL store (SPEC §12): the design's own schema. One `jobs` row per (owner,
//! idempotency key), held by a unique constraint; one `attempts` row per attempt; the
//! stored answer in `responses`, written in the same statement as the completion.
//!
//! # One state machine, one statement per transition
//!
//! The job/attempt rules live once, in [`crate::job`]. A transition is computed in Rust on
//! the record this gateway last saw (cached with its `revision`, a row counter bumped by
//! every write) and written by one statement: a data-modifying CTE whose `UPDATE jobs …
//! WHERE id = $1 AND revision = $2` — plus `AND version = $read_version AND completed_by IS
//! NULL` when the transition takes the result slot, the compare-and-swap of SPEC §2 — gates
//! the attempts upsert and the answer insert. Zero rows
//! updated means someone else wrote first: the record is read again and the transition
//! recomputed on it, so a late finisher's `Complete` becomes its `lost_race`.
//!
//! The claim is one statement too: `INSERT … ON CONFLICT (owner, idempotency_key) DO
//! NOTHING` with the first attempts, and, when it inserted nothing, the existing job read in
//! the same statement. Statements per request on the happy path (prepared once per
//! connection): a new job, 2 (claim with its first attempt, then the completion) and a
//! `NOTIFY` after it that the request does not wait for; a replay, 1 (the claim that finds
//! the job and its answer).
//!
//! # Why deadpool-postgres
//!
//! tokio-postgres is the asynchronous client every PostgreSQL pool builds on, and
//! deadpool-postgres is a small pool over it that caches prepared statements per
//! connection (`prepare_cached`), recycles connections without a test query and needs no
//! compile-time database the way sqlx's checked queries do.
//!
//! # Waiters
//!
//! Every write that changes a job's version or state notifies channel `idemgate_jobs` with
//! `"<job id> <version>"` once it has committed; each gateway holds one connection that
//! `LISTEN`s on it and wakes the waiters of that job. A lost notification (the listening
//! connection broke) costs at most the fallback poll.

mod rows;
pub mod schema;

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::NoTls;

use self::rows::{record_of, select_record, sub_micros, AttemptColumns};
use super::{
    decode, encode, Applied, Changes, Claim, JobStore, MirroredStream, StoreError, StreamHead,
    StreamUpdate,
};
use crate::config::StoreConfig;
use crate::job::{ClaimRule, ExpiryPolicy, JobId, JobRecord, JobState, Transition};

/// The channel every write notifies.
const CHANNEL: &str = "idemgate_jobs";
/// Waiters re-read at least this often, for notifications lost with a broken listener.
const FALLBACK_POLL: Duration = Duration::from_secs(1);
/// How many jobs' last-written records a gateway keeps, to compute the next transition
/// without a read.
const CACHE_LIMIT: usize = 4096;
/// Recomputations of one transition before the store is reported unavailable.
const CAS_RETRIES: usize = 16;
/// Mirrored streams are kept this long after their last write.
const MIRROR_RETENTION: Duration = Duration::from_secs(10 * 60);

/// The SQL of the statements every request sends, built once: `prepare_cached` finds them
/// by their text.
static BY_ID: LazyLock<String> = LazyLock::new(|| select_record("j.id = $1"));
static BY_KEY: LazyLock<String> =
    LazyLock::new(|| select_record("j.owner = $1 AND j.idempotency_key = $2"));
/// The claim: the insert with its attempts, and the holder read when it inserted nothing.
static CLAIM: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH ins AS (
                INSERT INTO jobs (id, owner, idempotency_key, fingerprint, route, state,
                    version, completed_by, created_at, updated_at, expires_at, lease_until,
                    lease_until_ns, revision)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $21, 1)
                ON CONFLICT (owner, idempotency_key) DO NOTHING
                RETURNING id
            ), att AS (
                INSERT INTO attempts (job_id, n, provider, state, read_version, started_at,
                    finished_at, upstream_status, error)
                SELECT ins.id, t.* FROM ins, unnest($13::integer[], $14::text[], $15::text[],
                    $16::bigint[], $17::timestamptz[], $18::timestamptz[], $19::integer[],
                    $20::text[]) AS t
            )
            SELECT (SELECT count(*) FROM ins) AS created, x.*
            FROM (SELECT 1) AS one
            LEFT JOIN LATERAL ({}) AS x ON NOT EXISTS (SELECT 1 FROM ins)",
        select_record("j.owner = $2 AND j.idempotency_key = $3")
    )
});

pub(super) fn unavailable(e: impl Into<crate::body::BoxError>) -> StoreError {
    StoreError::unavailable("postgres", e)
}

pub struct PostgresStore {
    pool: Pool,
    policy: ExpiryPolicy,
    changed: Arc<Changes>,
    cache: Mutex<HashMap<JobId, (i64, JobRecord)>>,
    statements: AtomicU64,
    lost_writes: AtomicU64,
    /// Ends the listener and the sweep with the store.
    _stop: tokio_util::sync::DropGuard,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore").finish_non_exhaustive()
    }
}

/// The connection settings of `store.url`, with connect timeout bounded by `op_timeout`.
fn pg_config(config: &StoreConfig) -> Result<tokio_postgres::Config, StoreError> {
    let url = config
        .urls
        .first()
        .ok_or_else(|| unavailable("store.url is required"))?;
    let mut pg = tokio_postgres::Config::from_str(url).map_err(unavailable)?;
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(config.op_timeout);
    }
    if pg.get_application_name().is_none() {
        pg.application_name("idemgate");
    }
    Ok(pg)
}

impl PostgresStore {
    /// Connects, migrates the schema (SPEC §12) and starts the listener and the expiry
    /// sweep.
    pub async fn open(config: &StoreConfig, policy: ExpiryPolicy) -> Result<Self, StoreError> {
        let pg = pg_config(config)?;
        // Migrations on a connection of their own: the advisory lock is session-scoped.
        let (mut client, connection) = pg.connect(NoTls).await.map_err(unavailable)?;
        let driver = tokio::spawn(connection);
        let migrated = schema::migrate(&mut client).await;
        drop(client);
        let _ = driver.await;
        migrated.map_err(unavailable)?;

        let manager = Manager::from_config(
            pg.clone(),
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(config.pool_size.unwrap_or(16) as usize)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .wait_timeout(Some(config.op_timeout))
            .create_timeout(Some(config.op_timeout))
            .build()
            .map_err(unavailable)?;
        let changed = Arc::new(Changes::new());
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(
            stop.clone()
                .run_until_cancelled_owned(listen(pg, changed.clone())),
        );
        let every = policy
            .retention
            .clamp(Duration::from_secs(1), Duration::from_secs(60));
        tokio::spawn(
            stop.clone()
                .run_until_cancelled_owned(sweep(pool.clone(), every)),
        );
        Ok(Self {
            pool,
            policy,
            changed,
            cache: Mutex::new(HashMap::new()),
            statements: AtomicU64::new(0),
            lost_writes: AtomicU64::new(0),
            _stop: stop.drop_guard(),
        })
    }

    /// A pooled connection for one statement, counted.
    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.statements.fetch_add(1, Ordering::Relaxed);
        self.pool.get().await.map_err(unavailable)
    }

    /// Statements sent to the database so far (each on one pooled connection, one round
    /// trip once prepared).
    pub fn statements(&self) -> u64 {
        self.statements.load(Ordering::Relaxed)
    }

    /// Writes whose `UPDATE` matched zero rows: someone else wrote the job first, and the
    /// transition was recomputed on what they wrote.
    pub fn lost_writes(&self) -> u64 {
        self.lost_writes.load(Ordering::Relaxed)
    }

    fn cached(&self, id: &str) -> Option<(i64, JobRecord)> {
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }

    fn remember(&self, revision: i64, mut record: JobRecord) {
        // Answers can be large and are written once: the cache keeps the job without it.
        record.job.response = None;
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= CACHE_LIMIT && !cache.contains_key(&record.job.id) {
            // Forget an arbitrary entry: a miss only costs a read.
            if let Some(victim) = cache.keys().next().cloned() {
                cache.remove(&victim);
            }
        }
        cache.insert(record.job.id.clone(), (revision, record));
    }

    fn forget(&self, id: &str) {
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    /// Wakes the job's waiters: at once on this gateway, and on the others by a `NOTIFY`
    /// sent after the write committed, in a statement of its own that nobody waits for. A
    /// `NOTIFY` inside the write would hold PostgreSQL's notify lock across the commit's
    /// WAL flush and serialise every writing transaction (measured with pgbench at 16
    /// clients: 7 812 inserts/s alone, 2 612 with the notify inside, 6 238 with it after).
    fn announce(&self, id: &str, version: u64) {
        self.changed.of(id).notify_waiters();
        self.statements.fetch_add(1, Ordering::Relaxed);
        let pool = self.pool.clone();
        let payload = format!("{id} {version}");
        tokio::spawn(async move {
            let sent = async {
                let client = pool.get().await.map_err(unavailable)?;
                let statement = client
                    .prepare_cached("SELECT pg_notify($1, $2)")
                    .await
                    .map_err(unavailable)?;
                client
                    .execute(&statement, &[&CHANNEL, &payload])
                    .await
                    .map_err(unavailable)
            };
            if let Err(e) = sent.await {
                // Waiters elsewhere re-read within the fallback poll.
                tracing::debug!(error = %e, "could not notify a job change");
            }
        });
    }

    /// The job `id` with its answer and revision.
    async fn fetch(&self, id: &str) -> Result<Option<(i64, JobRecord)>, StoreError> {
        let client = self.client().await?;
        let statement = client.prepare_cached(&BY_ID).await.map_err(unavailable)?;
        let rows = client
            .query(&statement, &[&id])
            .await
            .map_err(unavailable)?;
        record_of(&rows)
    }

    /// One claim statement: inserts `record` unless (owner, key) is taken, and reads the
    /// job that holds them when it is. `None` when the holder committed after this
    /// statement's snapshot was taken: the caller claims again.
    async fn try_claim(
        &self,
        record: &JobRecord,
    ) -> Result<Option<Result<(), (i64, JobRecord)>>, StoreError> {
        let client = self.client().await?;
        let statement = client.prepare_cached(&CLAIM).await.map_err(unavailable)?;
        let job = &record.job;
        let a = AttemptColumns::of(&record.attempts);
        let rows = client
            .query(
                &statement,
                &[
                    &job.id,
                    &job.owner,
                    &job.key,
                    &job.fingerprint,
                    &job.route,
                    &job.state.as_str(),
                    &(job.version as i64),
                    &job.completed_by.map(|n| n as i32),
                    &job.created_at,
                    &job.updated_at,
                    &job.expires_at,
                    &job.lease_until,
                    &a.n,
                    &a.provider,
                    &a.state,
                    &a.read_version,
                    &a.started_at,
                    &a.finished_at,
                    &a.upstream_status,
                    &a.error,
                    &sub_micros(job.lease_until),
                ],
            )
            .await
            .map_err(unavailable)?;
        let created: i64 = rows
            .first()
            .ok_or_else(|| unavailable("a claim returned no row"))?
            .try_get("created")
            .map_err(unavailable)?;
        if created == 1 {
            return Ok(Some(Ok(())));
        }
        Ok(record_of(&rows)?.map(Err))
    }

    /// Writes `next` over the record at `revision` in one statement; the new revision, or
    /// `None` when the row is no longer at `revision` (or no longer wins the slot).
    async fn write(
        &self,
        revision: i64,
        before: &JobRecord,
        next: &JobRecord,
        slot: Option<u64>,
    ) -> Result<Option<i64>, StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(
                "WITH j AS (
                    UPDATE jobs SET state = $3, version = $4, completed_by = $5,
                        updated_at = $6, expires_at = $7, lease_until = $8,
                        lease_until_ns = $22, revision = revision + 1
                    WHERE id = $1 AND revision = $2
                      AND ($9::bigint IS NULL OR (version = $9 AND completed_by IS NULL))
                    RETURNING revision
                ), att AS (
                    INSERT INTO attempts (job_id, n, provider, state, read_version,
                        started_at, finished_at, upstream_status, error)
                    SELECT $1, t.* FROM unnest($10::integer[], $11::text[], $12::text[],
                        $13::bigint[], $14::timestamptz[], $15::timestamptz[],
                        $16::integer[], $17::text[]) AS t
                    WHERE EXISTS (SELECT 1 FROM j)
                    ON CONFLICT (job_id, n) DO UPDATE SET state = excluded.state,
                        finished_at = excluded.finished_at,
                        upstream_status = excluded.upstream_status, error = excluded.error
                ), resp AS (
                    INSERT INTO responses (job_id, status, headers, body, body_omitted)
                    SELECT $1, $18, $19, $20, $21 FROM j WHERE $18::integer IS NOT NULL
                    ON CONFLICT (job_id) DO NOTHING
                )
                SELECT revision FROM j",
            )
            .await
            .map_err(unavailable)?;
        let job = &next.job;
        let changed = next
            .attempts
            .iter()
            .filter(|a| !before.attempts.contains(a));
        let a = AttemptColumns::of(changed);
        // The answer is written once, by the transition that set it.
        let response = next
            .job
            .response
            .as_ref()
            .filter(|_| before.job.response.is_none());
        let rows = client
            .query(
                &statement,
                &[
                    &job.id,
                    &revision,
                    &job.state.as_str(),
                    &(job.version as i64),
                    &job.completed_by.map(|n| n as i32),
                    &job.updated_at,
                    &job.expires_at,
                    &job.lease_until,
                    &slot.map(|v| v as i64),
                    &a.n,
                    &a.provider,
                    &a.state,
                    &a.read_version,
                    &a.started_at,
                    &a.finished_at,
                    &a.upstream_status,
                    &a.error,
                    &response.map(|r| i32::from(r.status)),
                    &response.map(|r| encode(&r.headers)),
                    &response.map(|r| r.body.as_ref()),
                    &response.map(|r| r.body_omitted),
                    &sub_micros(job.lease_until),
                ],
            )
            .await
            .map_err(unavailable)?;
        rows.first()
            .map(|row| row.try_get("revision").map_err(unavailable))
            .transpose()
    }
}

/// The version a transition reads when it takes the result slot: the attempt's fencing
/// token, for the SQL compare-and-swap.
fn slot_of(record: &JobRecord, transition: &Transition) -> Option<u64> {
    let n = match transition {
        Transition::Complete { n, .. } | Transition::BeginStream { n } => *n,
        _ => return None,
    };
    record
        .attempts
        .iter()
        .find(|a| a.n == n)
        .filter(|a| record.job.may_complete(a))
        .map(|a| a.read_version)
}

#[async_trait]
impl JobStore for PostgresStore {
    async fn claim(&self, record: JobRecord, now: SystemTime) -> Result<Claim, StoreError> {
        for _ in 0..CAS_RETRIES {
            match self.try_claim(&record).await? {
                Some(Ok(())) => {
                    self.remember(1, record.clone());
                    return Ok(Claim::Created(record));
                }
                Some(Err((revision, existing))) => {
                    if JobRecord::claim_rule(Some(&existing), now) == ClaimRule::Keep {
                        self.remember(revision, existing.clone());
                        return Ok(Claim::Existing(existing));
                    }
                    // Expired, not yet swept: remove it if it is still what was read.
                    let client = self.client().await?;
                    let statement = client
                        .prepare_cached("DELETE FROM jobs WHERE id = $1 AND revision = $2")
                        .await
                        .map_err(unavailable)?;
                    client
                        .execute(&statement, &[&existing.job.id, &revision])
                        .await
                        .map_err(unavailable)?;
                    self.forget(&existing.job.id);
                }
                // The holder committed after this statement's snapshot: read it next time.
                None => {}
            }
        }
        Err(unavailable(format!(
            "the claim of job {} kept racing; gave up after {CAS_RETRIES} tries",
            record.job.id
        )))
    }

    async fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        Ok(self.fetch(id).await?.map(|(revision, record)| {
            self.remember(revision, record.clone());
            record
        }))
    }

    async fn apply(
        &self,
        id: &str,
        transition: Transition,
        now: SystemTime,
    ) -> Result<Applied, StoreError> {
        let (mut revision, mut record, mut fresh) = match self.cached(id) {
            Some((revision, record)) => (revision, record, false),
            None => {
                let (revision, record) = self
                    .fetch(id)
                    .await?
                    .ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
                (revision, record, true)
            }
        };
        for _ in 0..CAS_RETRIES {
            let mut next = record.clone();
            let outcome = next.apply(transition.clone(), now, &self.policy);
            let written = match (&outcome, fresh) {
                // A refusal computed on a cached record may be stale: confirm it on a read.
                (Err(_), false) => None,
                (Err(_), true) => Some(revision),
                (Ok(_), _) => {
                    self.write(revision, &record, &next, slot_of(&record, &transition))
                        .await?
                }
            };
            if let Some(new_revision) = written {
                self.remember(new_revision, next.clone());
                if (next.job.version, next.job.state) != (record.job.version, record.job.state) {
                    self.announce(id, next.job.version);
                }
                if next.job.response.is_none() && next.job.state == JobState::Succeeded {
                    // The answer was stored by an earlier transition: read it back.
                    if let Some((_, full)) = self.fetch(id).await? {
                        next.job.response = full.job.response;
                    }
                }
                return Ok(Applied {
                    outcome,
                    record: next,
                });
            }
            if outcome.is_ok() {
                self.lost_writes.fetch_add(1, Ordering::Relaxed);
            }
            let (current_revision, current) = self.fetch(id).await?.ok_or_else(|| {
                self.forget(id);
                StoreError::NotFound(id.to_owned())
            })?;
            revision = current_revision;
            record = current;
            record.job.response = None;
            fresh = true;
        }
        self.forget(id);
        Err(unavailable(format!(
            "job {id} kept changing; gave up after {CAS_RETRIES} tries"
        )))
    }

    async fn wait_change(
        &self,
        id: &str,
        seen_version: u64,
        seen_state: JobState,
        timeout: Duration,
    ) -> Result<JobRecord, StoreError> {
        let seen = (seen_version, seen_state);
        super::wait_for_change(
            &self.changed,
            id,
            seen,
            timeout,
            Some(FALLBACK_POLL),
            || async { self.get(id).await },
        )
        .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        client.simple_query("SELECT 1").await.map_err(unavailable)?;
        Ok(())
    }

    async fn unknown_jobs(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        self.ids_in_state("unknown", after, limit).await
    }

    async fn lapsed_leases(
        &self,
        now: SystemTime,
        limit: usize,
    ) -> Result<Vec<(JobId, u64)>, StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(
                "SELECT id, version FROM jobs
                 WHERE state = 'in_progress' AND lease_until <= $1
                 ORDER BY lease_until LIMIT $2",
            )
            .await
            .map_err(unavailable)?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = client
            .query(&statement, &[&now, &limit])
            .await
            .map_err(unavailable)?;
        rows.iter()
            .map(|row| {
                let version: i64 = row.try_get(1).map_err(unavailable)?;
                Ok((row.try_get(0).map_err(unavailable)?, version as u64))
            })
            .collect()
    }

    async fn in_progress_jobs(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        self.ids_in_state("in_progress", after, limit).await
    }

    async fn find(&self, owner: &str, key: &str) -> Result<Option<JobRecord>, StoreError> {
        let client = self.client().await?;
        let statement = client.prepare_cached(&BY_KEY).await.map_err(unavailable)?;
        let rows = client
            .query(&statement, &[&owner, &key])
            .await
            .map_err(unavailable)?;
        Ok(record_of(&rows)?.map(|(_, record)| record))
    }

    async fn count_unknown(&self) -> Result<usize, StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached("SELECT count(*) FROM jobs WHERE state = 'unknown'")
            .await
            .map_err(unavailable)?;
        let count: i64 = client
            .query_one(&statement, &[])
            .await
            .map_err(unavailable)?
            .get(0);
        Ok(count as usize)
    }

    async fn mirror_stream(&self, id: &str, update: StreamUpdate) -> Result<(), StoreError> {
        let mut client = self.client().await?;
        // Every step locks the head's row before it touches the chunks, and chunks and ends
        // are written only while the head is their attempt's: an earlier attempt's late
        // writes either land before a new head, which then deletes them, or find the new
        // head and are dropped.
        let (sql, params): (
            &str,
            Vec<Box<dyn tokio_postgres::types::ToSql + Sync + Send>>,
        ) = match update {
            // A new attempt's stream replaces an earlier one's whole: head, end and chunks.
            // Two statements, so that the delete (a snapshot of its own) sees every chunk
            // written before the head's row was locked. The head of an earlier attempt than
            // the mirror's changes nothing: a cut attempt's mirror can start late, after its
            // retry's.
            StreamUpdate::Head(head) => {
                let attempt = i32::try_from(head.n).map_err(unavailable)?;
                let transaction = client.transaction().await.map_err(unavailable)?;
                let upsert = transaction
                    .prepare_cached(
                        "INSERT INTO stream_heads (job_id, head, attempt) VALUES ($1, $2, $3)
                         ON CONFLICT (job_id) DO UPDATE SET head = excluded.head,
                             attempt = excluded.attempt, ended = NULL, updated_at = now()
                         WHERE stream_heads.attempt <= excluded.attempt",
                    )
                    .await
                    .map_err(unavailable)?;
                let replaced = transaction
                    .execute(&upsert, &[&id, &encode(&head), &attempt])
                    .await
                    .map_err(unavailable)?;
                if replaced == 0 {
                    return transaction.commit().await.map_err(unavailable);
                }
                let clear = transaction
                    .prepare_cached("DELETE FROM stream_chunks WHERE job_id = $1")
                    .await
                    .map_err(unavailable)?;
                transaction
                    .execute(&clear, &[&id])
                    .await
                    .map_err(unavailable)?;
                return transaction.commit().await.map_err(unavailable);
            }
            StreamUpdate::Chunks { n, from, chunks } => {
                if chunks.is_empty() {
                    return Ok(());
                }
                let data: Vec<Vec<u8>> = chunks.iter().map(|c| c.to_vec()).collect();
                let from = i32::try_from(from).map_err(unavailable)?;
                let attempt = i32::try_from(n).map_err(unavailable)?;
                (
                    "WITH touched AS (
                            UPDATE stream_heads SET updated_at = now()
                            WHERE job_id = $1 AND attempt = $4
                            RETURNING job_id
                         )
                         INSERT INTO stream_chunks (job_id, seq, data)
                         SELECT touched.job_id, $3 + t.ord::integer - 1, t.data
                         FROM touched, unnest($2::bytea[]) WITH ORDINALITY AS t(data, ord)
                         ON CONFLICT (job_id, seq) DO NOTHING",
                    vec![
                        Box::new(id.to_owned()),
                        Box::new(data),
                        Box::new(from),
                        Box::new(attempt),
                    ],
                )
            }
            StreamUpdate::End { n, end } => (
                "UPDATE stream_heads SET ended = $2, updated_at = now()
                 WHERE job_id = $1 AND attempt = $3",
                vec![
                    Box::new(id.to_owned()),
                    Box::new(match end {
                        Ok(()) => "ok".to_owned(),
                        Err(reason) => format!("cut:{reason}"),
                    }),
                    Box::new(i32::try_from(n).map_err(unavailable)?),
                ],
            ),
        };
        let statement = client.prepare_cached(sql).await.map_err(unavailable)?;
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params
            .iter()
            .map(|p| p.as_ref() as &(dyn tokio_postgres::types::ToSql + Sync))
            .collect();
        client
            .execute(&statement, &params)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn read_stream(
        &self,
        id: &str,
        from: usize,
    ) -> Result<Option<MirroredStream>, StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(
                "SELECT h.head, h.ended,
                        coalesce(array_agg(c.data ORDER BY c.seq)
                            FILTER (WHERE c.seq IS NOT NULL), '{}') AS chunks
                 FROM stream_heads h
                 LEFT JOIN stream_chunks c ON c.job_id = h.job_id AND c.seq >= $2
                 WHERE h.job_id = $1
                 GROUP BY h.job_id, h.head, h.ended",
            )
            .await
            .map_err(unavailable)?;
        let from = i32::try_from(from).unwrap_or(i32::MAX);
        let Some(row) = client
            .query_opt(&statement, &[&id, &from])
            .await
            .map_err(unavailable)?
        else {
            return Ok(None);
        };
        let head: StreamHead = decode(&row.try_get::<_, Vec<u8>>(0).map_err(unavailable)?)?;
        let ended: Option<String> = row.try_get(1).map_err(unavailable)?;
        let chunks: Vec<Vec<u8>> = row.try_get(2).map_err(unavailable)?;
        Ok(Some(MirroredStream {
            head,
            chunks: chunks.into_iter().map(bytes::Bytes::from).collect(),
            end: ended.map(|marker| match marker.strip_prefix("cut:") {
                Some(reason) => Err(reason.to_owned()),
                None => Ok(()),
            }),
        }))
    }
}

impl PostgresStore {
    async fn ids_in_state(
        &self,
        state: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        let client = self.client().await?;
        // Two statements rather than one with `$1 IS NULL OR`, so each uses its partial
        // index.
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = match after {
            Some(after) => {
                let statement = client
                    .prepare_cached(&format!(
                        "SELECT id FROM jobs WHERE state = '{state}' AND id > $1
                         ORDER BY id LIMIT $2"
                    ))
                    .await
                    .map_err(unavailable)?;
                client.query(&statement, &[&after, &limit]).await
            }
            None => {
                let statement = client
                    .prepare_cached(&format!(
                        "SELECT id FROM jobs WHERE state = '{state}' ORDER BY id LIMIT $1"
                    ))
                    .await
                    .map_err(unavailable)?;
                client.query(&statement, &[&limit]).await
            }
        }
        .map_err(unavailable)?;
        rows.iter()
            .map(|row| row.try_get(0).map_err(unavailable))
            .collect()
    }
}

/// Holds one connection that `LISTEN`s on [`CHANNEL`] and wakes the waiters of each job
/// named; reconnects after a break, waking every waiter (a notification may have been lost).
async fn listen(config: tokio_postgres::Config, changed: Arc<Changes>) {
    use futures_util::StreamExt;
    loop {
        match config.connect(NoTls).await {
            Ok((client, mut connection)) => {
                let mut messages =
                    futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
                let statement = format!("LISTEN {CHANNEL}");
                let listening = client.batch_execute(&statement);
                tokio::pin!(listening);
                let mut subscribed = false;
                loop {
                    tokio::select! {
                        result = &mut listening, if !subscribed => {
                            if result.is_err() {
                                break;
                            }
                            subscribed = true;
                            changed.wake_all();
                        }
                        message = messages.next() => match message {
                            Some(Ok(tokio_postgres::AsyncMessage::Notification(n))) => {
                                if let Some((id, _version)) = n.payload().split_once(' ') {
                                    changed.of(id).notify_waiters();
                                }
                            }
                            Some(Ok(_)) => {}
                            Some(Err(_)) | None => break,
                        },
                    }
                }
                changed.wake_all();
                tracing::warn!("the PostgreSQL listener lost its connection; reconnecting");
            }
            Err(e) => tracing::debug!(error = %e, "the PostgreSQL listener cannot connect"),
        }
        tokio::time::sleep(FALLBACK_POLL).await;
    }
}

/// Deletes expired jobs (their attempts, answers and streams go with them) and streams
/// mirrored long ago, in batches of 1000 so no statement holds locks for long.
async fn sweep(pool: Pool, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Ok(client) = pool.get().await else {
            continue;
        };
        let now = crate::clock::now();
        let old_streams = now - MIRROR_RETENTION;
        loop {
            let deleted = client
                .execute(
                    "DELETE FROM jobs WHERE id IN (
                        SELECT id FROM jobs WHERE expires_at <= $1 LIMIT 1000)",
                    &[&now],
                )
                .await;
            match deleted {
                Ok(1000) => continue,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "expiry sweep failed");
                    break;
                }
            }
        }
        if let Err(e) = client
            .execute(
                "DELETE FROM stream_heads WHERE updated_at <= $1",
                &[&old_streams],
            )
            .await
        {
            tracing::warn!(error = %e, "stream sweep failed");
        }
    }
}

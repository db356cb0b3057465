//! The Redis store: several gateways (replicas behind a load balancer, or sidecars) share
//! one identity for every intent, on Redis or Redis Cluster.
//!
//! # Keys
//!
//! Every key of a job carries the job's shard tag in braces, so on a Cluster they all live in
//! one hash slot and every script runs on one node:
//!
//! - `P:{tag}:claim:<sha256(owner NUL key)>` → job id — the identity, claimed atomically;
//! - `P:{tag}:job:<id>` → hash `rev` (revision) and `blob` (the job and its attempts);
//! - `P:{tag}:resp:<id>` → the stored answer, written once, when an attempt wins;
//! - channel `P:{tag}:chan:<id>` — published on a change while `P:{tag}:watch:<id>` exists,
//!   to wake waiters anywhere. A waiter sets the watch key (for [`WATCH_TTL_MS`]) in the
//!   same round trip as each read of the job, so a change after the read is published and a
//!   change before it is seen by it; a job nobody waits on is changed without a publish.
//!   Waiters also re-read every [`FALLBACK_POLL`], so a lapsed watch, a lost message, or a
//!   gateway of an earlier version that does not set it only delays a wake-up.
//!
//! The tag is part of the job id ([`crate::job::new_job_id`]), so a job is found from its id
//! in one round trip.
//!
//! # One state machine, applied atomically by compare-and-swap
//!
//! The job/attempt rules live once, in [`crate::job`]. Rather than re-writing them in Lua,
//! each transition is computed in Rust on the record this gateway last saw and written by
//! one script that succeeds only if the record's revision is still the one computed from —
//! otherwise it writes nothing and returns the current record, and the transition is
//! recomputed on that. Every transition is thus applied to the exact current record,
//! atomically; SPEC §2's compare-and-swap (`version`, `completed_by`, `state`) is evaluated
//! on it by the same code every store uses. The gateway that runs a job keeps the record
//! it last wrote, so on the happy path each transition is one round trip: a new job costs two
//! (claim with its first attempt, then settle) and a replay one.
//!
//! # Connections
//!
//! Standalone Redis uses the crate's multiplexed `ConnectionManager`: every task's commands
//! are pipelined on one socket with no pool checkout, and it reconnects by itself after a
//! blip — for single-command scripts this beats a pool of exclusive connections, which
//! would only add checkout latency. A Cluster uses the crate's async cluster connection,
//! which multiplexes per node the same way and follows slot moves.
//!
//! # Expiry and replication
//!
//! Keys get the job's TTL on every write: `retention` once settled, `retention +
//! late_result_window` while unsettled, so no newcomer's claim can slip in while an attempt
//! may still land. Redis replicates asynchronously: a failover can lose an acknowledged
//! write. `store.wait_replicas = N` makes every claim and settle wait (`WAIT N`) until `N`
//! replicas have it, trading a round trip for that guarantee.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, Pipeline, RedisFuture, Script, ServerErrorKind, Value};
use tracing::warn;

use super::{
    decode, encode, Applied, Changes, Claim, JobStore, MirroredStream, StoreError, StreamUpdate,
};
mod indexes;
mod listen;
mod mirror;
mod scripts;

use crate::config::StoreConfig;
use crate::job::{
    claim_digest, claim_digest_bytes, hex_of, shard_tag, ClaimRule, ExpiryPolicy, JobId, JobRecord,
    JobState, StoredResponse, Transition,
};

/// How long one command may take before the store counts as unavailable.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Waiters re-read at least this often, in case a notification was lost with a connection.
const FALLBACK_POLL: Duration = Duration::from_millis(250);
/// How long one read by a waiter keeps its job watched: several [`FALLBACK_POLL`]s, so a
/// waiter's next read renews it before it lapses.
const WATCH_TTL_MS: u64 = 1_000;
/// How long a mirrored stream outlives its last update: duplicates elsewhere read it while
/// it is live; once the job settles they replay the stored answer instead.
const MIRROR_TTL_MS: u64 = 10 * 60 * 1000;
/// Records of the jobs in flight that this gateway touched; a miss costs one extra read.
const CACHE_LIMIT: usize = 10_000;
/// Retries of a transition whose record changed underneath it.
const CAS_RETRIES: usize = 16;

/// One connection to standalone Redis or to a Cluster.
#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

pub struct RedisStore {
    connection: Connection,
    prefix: String,
    policy: ExpiryPolicy,
    wait_replicas: u32,
    claim: Script,
    replace: Script,
    apply: Script,
    /// job id → the job as this gateway last saw it.
    cache: Mutex<HashMap<String, Cached, foldhash::fast::RandomState>>,
    /// The store-wide indexes' keys, named once.
    unknown_index: String,
    in_progress_index: String,
    changed: Arc<Changes>,
    round_trips: AtomicU64,
    /// On a Cluster the store-wide indexes are kept outside the job scripts.
    cluster: bool,
}

/// A job in flight as this gateway last saw it: what its next transition is computed on.
struct Cached {
    rev: u64,
    /// Without its answer.
    record: JobRecord,
    /// Its claim's key, which every transition extends with the job: kept rather than digested
    /// again from (owner, key) for each.
    claim_key: String,
}

/// A wall-clock instant as milliseconds since the epoch, the indexes' score.
fn millis(t: SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// An `EVALSHA` of `script` on `keys`, with room for `args` arguments of `bytes` in all,
/// which the caller appends. Written straight into the command: the crate's
/// `ScriptInvocation` copies each key and argument (a job's whole record among them) into a
/// list of its own first, and then into the command.
fn evalsha(script: &Script, keys: &[&str], args: usize, bytes: usize) -> Cmd {
    let key_bytes: usize = keys.iter().map(|k| k.len()).sum();
    let mut call = Cmd::with_capacity(3 + keys.len() + args, 64 + key_bytes + bytes);
    call.arg("EVALSHA")
        .arg(script.get_hash())
        .arg(keys.len())
        .arg(keys);
    call
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn unavailable(e: impl Into<crate::body::BoxError>) -> StoreError {
    StoreError::unavailable("redis", e)
}

impl RedisStore {
    /// Connects to the configured Redis or Redis Cluster and starts listening for changes.
    pub async fn open(config: &StoreConfig, policy: ExpiryPolicy) -> Result<Self, StoreError> {
        let connection = if config.cluster {
            let client = redis::cluster::ClusterClient::builder(config.urls.clone())
                .connection_timeout(CONNECT_TIMEOUT)
                .response_timeout(RESPONSE_TIMEOUT)
                .retries(2)
                .build()
                .map_err(unavailable)?;
            Connection::Cluster(client.get_async_connection().await.map_err(unavailable)?)
        } else {
            let client = redis::Client::open(config.urls[0].as_str()).map_err(unavailable)?;
            let manager_config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(CONNECT_TIMEOUT))
                .set_response_timeout(Some(RESPONSE_TIMEOUT))
                .set_number_of_retries(2)
                .set_max_delay(Duration::from_millis(500));
            Connection::Single(
                ConnectionManager::new_with_config(client, manager_config)
                    .await
                    .map_err(unavailable)?,
            )
        };
        let changed = Arc::new(Changes::new());
        let store = Self {
            connection,
            prefix: config.key_prefix.clone(),
            policy,
            wait_replicas: config.wait_replicas,
            claim: Script::new(scripts::CLAIM),
            replace: Script::new(scripts::REPLACE),
            apply: Script::new(scripts::APPLY),
            cache: Mutex::new(HashMap::default()),
            unknown_index: format!("{}:unknown-jobs", config.key_prefix),
            in_progress_index: format!("{}:in-progress-jobs", config.key_prefix),
            changed: changed.clone(),
            round_trips: AtomicU64::new(0),
            cluster: config.cluster,
        };
        // Classic pub/sub reaches every node of a Cluster, so one subscriber sees all jobs.
        let pattern = format!("{}:*:chan:*", store.prefix);
        tokio::spawn(listen::listen(
            config.urls.clone(),
            pattern,
            Arc::downgrade(&changed),
        ));
        Ok(store)
    }

    /// The set of `unknown` job ids. One key for the whole store, so it is kept by separate
    /// commands after a job's transition (never inside the job's script, which on a
    /// Cluster may only touch the job's own slot); readers drop stale entries.
    fn unknown_index(&self) -> &str {
        &self.unknown_index
    }

    /// Commands sent to Redis so far (each script call is one round trip).
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    fn keys(&self, tag: &str) -> Keys {
        Keys {
            base: format!("{}:{{{tag}}}:", self.prefix),
        }
    }

    fn ttl_ms(record: &JobRecord, now: SystemTime) -> u64 {
        record
            .job
            .expires_at
            .duration_since(now)
            .map_or(1, |d| d.as_millis().max(1) as u64)
    }

    /// Runs a script call built by [`evalsha`]; a server that does not hold the script (a
    /// restart, a flush, a Cluster node new to this slot) gets it loaded and the call again.
    async fn invoke(&self, script: &Script, call: &Cmd) -> Result<Value, StoreError> {
        let mut connection = self.connection.clone();
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        match call.query_async(&mut connection).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.round_trips.fetch_add(2, Ordering::Relaxed);
                script
                    .load_async(&mut connection)
                    .await
                    .map_err(unavailable)?;
                call.query_async(&mut connection).await.map_err(unavailable)
            }
            reply => reply.map_err(unavailable),
        }
    }

    async fn wait_for_replicas(&self, key: &str) -> Result<(), StoreError> {
        if self.wait_replicas == 0 {
            return Ok(());
        }
        let mut connection = self.connection.clone();
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        // On a Cluster, WAIT goes to the node owning `key`: route it by a key-bearing no-op.
        let mut pipe = redis::pipe();
        pipe.cmd("EXISTS")
            .arg(key)
            .ignore()
            .cmd("WAIT")
            .arg(self.wait_replicas)
            .arg(1000);
        let (acked,): (u32,) = pipe
            .query_async(&mut connection)
            .await
            .map_err(unavailable)?;
        if acked < self.wait_replicas {
            warn!(
                acked,
                wanted = self.wait_replicas,
                "fewer replicas than store.wait_replicas acknowledged a write"
            );
        }
        Ok(())
    }

    /// The job as this gateway last saw it, taken out of the cache: the transition computed
    /// on it puts back what it wrote (a copy would be the whole record, attempts and all). A
    /// second transition of the job on this gateway meanwhile reads it instead.
    fn take_cached(&self, id: &str) -> Option<Cached> {
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id)
    }

    /// Keeps `record` at `rev` for the next transition; `claim_key` is its claim's key when
    /// the caller holds it, digested here otherwise.
    fn remember(&self, id: &str, rev: u64, record: &JobRecord, claim_key: Option<&str>) {
        if record.job.state != JobState::InProgress {
            // The cache is for the jobs in flight, whose next transition is near. Anything
            // else is applied to again rarely (a late answer, a retry's re-open, a cancel)
            // and a miss only costs a read; kept, such jobs crowded out the ones in flight.
            self.forget(id);
            return;
        }
        let mut record = record.clone();
        record.job.response = None;
        let claim_key = match claim_key {
            Some(key) => key.to_owned(),
            None => self.claim_key(&record),
        };
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= CACHE_LIMIT && !cache.contains_key(id) {
            // Forget an arbitrary entry: a miss only costs a read.
            if let Some(victim) = cache.keys().next().cloned() {
                cache.remove(&victim);
            }
        }
        cache.insert(
            id.to_owned(),
            Cached {
                rev,
                record,
                claim_key,
            },
        );
    }

    /// The key of the claim naming `record`'s (owner, key), under the job's tag as
    /// [`JobStore::claim`] wrote it (the digest's own tag for an id without one).
    fn claim_key(&self, record: &JobRecord) -> String {
        let digest = claim_digest(&record.job.owner, &record.job.key);
        let tag = shard_tag(&record.job.id).unwrap_or(&digest[..crate::job::SHARD_TAG_LEN]);
        self.keys(tag).claim(&digest)
    }

    fn forget(&self, id: &str) {
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    /// Reads a job (revision, record without answer, answer).
    async fn fetch(
        &self,
        id: &str,
    ) -> Result<Option<(u64, JobRecord, Option<StoredResponse>)>, StoreError> {
        self.read_job(id, false).await
    }

    /// Reads a job; `watch` first marks it watched, so its changes from then on are
    /// published (see the module's keys).
    async fn read_job(
        &self,
        id: &str,
        watch: bool,
    ) -> Result<Option<(u64, JobRecord, Option<StoredResponse>)>, StoreError> {
        let Some(tag) = shard_tag(id) else {
            return Ok(None);
        };
        let keys = self.keys(tag);
        let mut connection = self.connection.clone();
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let mut pipe = redis::pipe();
        if watch {
            pipe.cmd("SET")
                .arg(keys.watch(id))
                .arg(1)
                .arg("PX")
                .arg(WATCH_TTL_MS)
                .ignore();
        }
        pipe.cmd("HMGET").arg(keys.job(id)).arg("rev").arg("blob");
        pipe.cmd("GET").arg(keys.resp(id));
        let ((rev, blob), resp): (RawJob, Option<Vec<u8>>) = pipe
            .query_async(&mut connection)
            .await
            .map_err(unavailable)?;
        let (Some(rev), Some(blob)) = (rev, blob) else {
            return Ok(None);
        };
        let record: JobRecord = decode(&blob)?;
        let response = resp.map(|r| decode(&r)).transpose()?;
        Ok(Some((rev, record, response)))
    }

    /// A job as [`JobStore::get`] returns it, remembered for this gateway's next transition.
    async fn read_record(&self, id: &str, watch: bool) -> Result<Option<JobRecord>, StoreError> {
        Ok(self
            .read_job(id, watch)
            .await?
            .map(|(rev, record, response)| {
                self.remember(id, rev, &record, None);
                Self::with_answer(record, response)
            }))
    }

    fn with_answer(mut record: JobRecord, response: Option<StoredResponse>) -> JobRecord {
        if record.job.state == JobState::Succeeded {
            record.job.response = response;
        }
        record
    }
}

/// A job hash as read: revision and blob, each absent when the job is.
type RawJob = (Option<u64>, Option<Vec<u8>>);

struct Keys {
    /// `<prefix>:{<tag>}:`, which every key of one job starts with.
    base: String,
}

impl Keys {
    fn key(&self, kind: &str, name: &str) -> String {
        let mut key = String::with_capacity(self.base.len() + kind.len() + name.len());
        key.push_str(&self.base);
        key.push_str(kind);
        key.push_str(name);
        key
    }

    /// The job's record; `job("")` is the prefix a script appends an id to.
    fn job(&self, id: &str) -> String {
        self.key("job:", id)
    }

    fn resp(&self, id: &str) -> String {
        self.key("resp:", id)
    }

    fn claim(&self, digest: &str) -> String {
        self.key("claim:", digest)
    }

    fn chan(&self, id: &str) -> String {
        self.key("chan:", id)
    }

    fn watch(&self, id: &str) -> String {
        self.key("watch:", id)
    }

    /// A mirrored stream's keys: `shead`, `schunks`, `send`, `sattempt`.
    fn stream(&self, part: &str, id: &str) -> String {
        let mut key = self.key(part, ":");
        key.push_str(id);
        key
    }
}

#[async_trait]
impl JobStore for RedisStore {
    async fn claim(&self, record: JobRecord, now: SystemTime) -> Result<Claim, StoreError> {
        let identity = claim_digest_bytes(&record.job.owner, &record.job.key);
        self.claim_identified(&identity, record, now).await
    }

    async fn claim_identified(
        &self,
        identity: &[u8; 32],
        record: JobRecord,
        now: SystemTime,
    ) -> Result<Claim, StoreError> {
        debug_assert_eq!(
            *identity,
            claim_digest_bytes(&record.job.owner, &record.job.key)
        );
        let id = record.job.id.clone();
        let tag = shard_tag(&id)
            .ok_or_else(|| unavailable(format!("job id {id} carries no shard tag")))?;
        let keys = self.keys(tag);
        let claim_key = keys.claim(&hex_of(identity));
        let blob = encode(&record);
        let ttl = Self::ttl_ms(&record, now);
        let lease = millis(record.job.lease_until);
        let job_key = keys.job(&id);
        // On a Cluster the store-wide index lives in another slot: kept outside the script.
        let all_keys = [claim_key.as_str(), &job_key, self.in_progress_index()];
        let script_keys = if self.cluster {
            &all_keys[..2]
        } else {
            &all_keys[..]
        };
        let mut call = evalsha(&self.claim, script_keys, 6, blob.len() + 256);
        call.arg(&id)
            .arg(&blob)
            .arg(ttl)
            .arg(keys.job(""))
            .arg(keys.resp(""))
            .arg(lease);
        let reply = self.invoke(&self.claim, &call).await?;
        let found: (
            i64,
            Option<String>,
            Option<u64>,
            Option<Vec<u8>>,
            Option<Vec<u8>>,
        ) = match reply {
            Value::Array(items) if items.len() == 1 => (1, None, None, None, None),
            other => redis::from_redis_value(other).map_err(unavailable)?,
        };
        if found.0 == 1 {
            self.wait_for_replicas(&claim_key).await?;
            self.index_created(&id, lease).await;
            self.remember(&id, 1, &record, Some(&claim_key));
            return Ok(Claim::Created(record));
        }
        let (_, Some(existing_id), Some(rev), Some(existing_blob), resp) = found else {
            return Err(unavailable("malformed claim reply"));
        };
        let existing: JobRecord = decode(&existing_blob)?;
        if JobRecord::claim_rule(Some(&existing), now) == ClaimRule::Keep {
            let response = resp
                .filter(|r| !r.is_empty())
                .map(|r| decode(&r))
                .transpose()?;
            self.remember(&existing_id, rev, &existing, Some(&claim_key));
            return Ok(Claim::Existing(Self::with_answer(existing, response)));
        }
        // Expired by the caller's clock but not yet by Redis's TTL: replace it, if the claim
        // still names it.
        let mut call = evalsha(&self.replace, script_keys, 7, blob.len() + 256);
        call.arg(&id)
            .arg(&blob)
            .arg(ttl)
            .arg(keys.job(""))
            .arg(keys.resp(""))
            .arg(&existing_id)
            .arg(lease);
        let replaced: Vec<i64> = redis::from_redis_value(self.invoke(&self.replace, &call).await?)
            .map_err(unavailable)?;
        if replaced.first() == Some(&1) {
            self.index_created(&id, lease).await;
            self.forget(&existing_id);
            self.remember(&id, 1, &record, Some(&claim_key));
            Ok(Claim::Created(record))
        } else {
            Box::pin(self.claim(record, now)).await
        }
    }

    async fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        self.read_record(id, false).await
    }

    async fn apply(
        &self,
        id: &str,
        transition: Transition,
        now: SystemTime,
    ) -> Result<Applied, StoreError> {
        let tag = shard_tag(id).ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
        let keys = self.keys(tag);
        let Cached {
            mut rev,
            mut record,
            claim_key,
        } = match self.take_cached(id) {
            Some(cached) => cached,
            None => {
                let (rev, record, _) = self
                    .fetch(id)
                    .await?
                    .ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
                let claim_key = self.claim_key(&record);
                Cached {
                    rev,
                    record,
                    claim_key,
                }
            }
        };
        for _ in 0..CAS_RETRIES {
            let mut next = record.clone();
            let outcome = next.apply(transition.clone(), now, &self.policy);
            let response = next.job.response.take();
            let blob = if outcome.is_ok() {
                encode(&next)
            } else {
                Vec::new()
            };
            let response_blob = response.as_ref().map(encode).unwrap_or_default();
            let (job_key, resp_key, watch_key) = (keys.job(id), keys.resp(id), keys.watch(id));
            let all_keys = [
                job_key.as_str(),
                &resp_key,
                &claim_key,
                &watch_key,
                self.unknown_index(),
                self.in_progress_index(),
            ];
            let script_keys = if self.cluster {
                &all_keys[..4]
            } else {
                &all_keys[..]
            };
            let mut call = evalsha(
                &self.apply,
                script_keys,
                7,
                blob.len() + response_blob.len() + 256,
            );
            call.arg(rev)
                .arg(&blob)
                .arg(Self::ttl_ms(&next, now))
                .arg(&response_blob)
                .arg(keys.chan(id))
                .arg(id)
                .arg(Self::index_op(&next));
            let reply: (i64, Option<u64>, Option<Vec<u8>>) =
                match self.invoke(&self.apply, &call).await? {
                    Value::Array(items) if items.len() == 1 => (-1, None, None),
                    Value::Array(items) if items.len() == 2 => {
                        let (status, rev): (i64, String) =
                            redis::from_redis_value(Value::Array(items)).map_err(unavailable)?;
                        (status, rev.parse().ok(), None)
                    }
                    other => redis::from_redis_value(other).map_err(unavailable)?,
                };
            match reply {
                (-1, ..) => {
                    self.forget(id);
                    return Err(StoreError::NotFound(id.to_owned()));
                }
                (1, Some(new_rev), _) => {
                    if outcome.is_ok() {
                        self.wait_for_replicas(&claim_key).await?;
                        self.index_outside(id, &record, &next).await;
                    }
                    self.remember(id, new_rev, &next, Some(&claim_key));
                    let record = if next.job.state == JobState::Succeeded && response.is_none() {
                        // The answer was stored by an earlier transition: read it back.
                        self.fetch(id)
                            .await?
                            .map_or(next, |(_, r, answer)| Self::with_answer(r, answer))
                    } else {
                        next.job.response = response;
                        next
                    };
                    return Ok(Applied { outcome, record });
                }
                (0, Some(current_rev), Some(current_blob)) => {
                    // Someone else changed the job: recompute on what is there now.
                    rev = current_rev;
                    record = decode(&current_blob)?;
                }
                _ => return Err(unavailable("malformed apply reply")),
            }
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
            || self.read_record(id, true),
        )
        .await
    }

    async fn mirror_stream(&self, id: &str, update: StreamUpdate) -> Result<(), StoreError> {
        self.mirror(id, update).await
    }

    async fn read_stream(
        &self,
        id: &str,
        from: usize,
    ) -> Result<Option<MirroredStream>, StoreError> {
        self.read_mirror(id, from).await
    }

    async fn lapsed_leases(
        &self,
        now: SystemTime,
        limit: usize,
    ) -> Result<Vec<(JobId, u64)>, StoreError> {
        let mut connection = self.connection.clone();
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let due: Vec<String> = redis::cmd("ZRANGEBYSCORE")
            .arg(self.in_progress_index())
            .arg("-inf")
            .arg(millis(now))
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(&mut connection)
            .await
            .map_err(unavailable)?;
        let mut lapsed = Vec::new();
        for id in due {
            match self.fetch(&id).await? {
                Some((_, record, _))
                    if record.job.state == JobState::InProgress
                        && record.job.lease_until <= now =>
                {
                    lapsed.push((id, record.job.version));
                }
                // The index went stale (a crash between a job's script and its index update
                // on a Cluster): repair it from the job itself.
                Some((_, record, _)) => self.index_outside_repair(&id, &record).await,
                None => {
                    let _: Result<(), _> = redis::cmd("ZREM")
                        .arg(self.in_progress_index())
                        .arg(&id)
                        .query_async(&mut connection)
                        .await;
                }
            }
        }
        Ok(lapsed)
    }

    async fn in_progress_jobs(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        let mut members = redis::cmd("ZRANGE");
        members.arg(self.in_progress_index()).arg(0).arg(-1);
        self.listed(members, JobState::InProgress, after, limit)
            .await
    }

    async fn find(&self, owner: &str, key: &str) -> Result<Option<JobRecord>, StoreError> {
        let digest = claim_digest(owner, key);
        let keys = self.keys(&digest[..crate::job::SHARD_TAG_LEN]);
        let mut connection = self.connection.clone();
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let id: Option<String> = redis::cmd("GET")
            .arg(keys.claim(&digest))
            .query_async(&mut connection)
            .await
            .map_err(unavailable)?;
        match id {
            Some(id) => self.get(&id).await,
            None => Ok(None),
        }
    }

    async fn count_unknown(&self) -> Result<usize, StoreError> {
        let mut connection = self.connection.clone();
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        redis::cmd("SCARD")
            .arg(self.unknown_index())
            .query_async(&mut connection)
            .await
            .map_err(unavailable)
    }

    async fn unknown_jobs(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        let mut members = redis::cmd("SMEMBERS");
        members.arg(self.unknown_index());
        self.listed(members, JobState::Unknown, after, limit).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut connection = self.connection.clone();
        redis::cmd("PING")
            .query_async::<String>(&mut connection)
            .await
            .map(drop)
            .map_err(unavailable)
    }
}

//! The store-wide indexes beside the jobs: unknown jobs (a set) and in-progress jobs by the
//! end of their lease (a sorted set). On a standalone server the job scripts keep them; on
//! a Cluster they live in other slots and are kept here, by separate commands, and
//! repaired from the jobs themselves whenever a reader finds an entry gone stale.

use std::sync::atomic::Ordering;

use tracing::warn;

use super::{millis, unavailable, RedisStore};
use crate::job::{JobId, JobRecord, JobState};
use crate::store::StoreError;

impl RedisStore {
    /// The jobs `in_progress`, scored by their lease's end (ms): what the lease sweep reads.
    pub(super) fn in_progress_index(&self) -> &str {
        &self.in_progress_index
    }

    /// A new job on a Cluster: into the in-progress index, by a separate command.
    pub(super) async fn index_created(&self, id: &str, lease: u64) {
        if !self.cluster {
            return;
        }
        let mut connection = self.connection.clone();
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let added: Result<(), _> = redis::cmd("ZADD")
            .arg(self.in_progress_index())
            .arg(lease)
            .arg(id)
            .query_async(&mut connection)
            .await;
        if let Err(e) = added {
            warn!(job_id = %id, error = %e, "could not index the new job; a request for its key still finds it");
        }
    }

    /// The index update a record's state asks for, as the apply script reads it.
    pub(super) fn index_op(record: &JobRecord) -> String {
        match record.job.state {
            JobState::InProgress => format!("p{}", millis(record.job.lease_until)),
            JobState::Unknown => "u".into(),
            _ => "s".into(),
        }
    }

    /// The members of an index (read by `members`) whose jobs are in `state`, in id order,
    /// after `after`, at most `limit`. The indexes are kept beside the jobs, not with them:
    /// an entry that went stale is repaired from its job on the way.
    pub(super) async fn listed(
        &self,
        members: redis::Cmd,
        state: JobState,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<JobId>, StoreError> {
        let mut connection = self.connection.clone();
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let mut ids: Vec<String> = members
            .query_async(&mut connection)
            .await
            .map_err(unavailable)?;
        ids.sort_unstable();
        ids.retain(|id| after.is_none_or(|after| id.as_str() > after));
        let mut live = Vec::new();
        for id in ids {
            if live.len() == limit {
                break;
            }
            match self.fetch(&id).await? {
                Some((_, record, _)) if record.job.state == state => live.push(id),
                Some((_, record, _)) => self.index_outside_repair(&id, &record).await,
                None => {
                    let _: Result<(), _> = redis::pipe()
                        .cmd("ZREM")
                        .arg(self.in_progress_index())
                        .arg(&id)
                        .ignore()
                        .cmd("SREM")
                        .arg(self.unknown_index())
                        .arg(&id)
                        .ignore()
                        .query_async(&mut connection)
                        .await;
                }
            }
        }
        Ok(live)
    }

    /// Puts a job's index entries right, whatever they were.
    pub(super) async fn index_outside_repair(&self, id: &str, record: &JobRecord) {
        if let Err(e) = self.set_indexes(id, record).await {
            warn!(job_id = %id, error = %e, "could not repair the job indexes");
        }
    }

    /// The index entries a record's state asks for. One command per index key: on a
    /// Cluster the two indexes may live in different slots, which one pipeline cannot span.
    pub(super) async fn set_indexes(
        &self,
        id: &str,
        record: &JobRecord,
    ) -> Result<(), redis::RedisError> {
        let mut connection = self.connection.clone();
        let (progress, unknown) = match record.job.state {
            JobState::InProgress => {
                let mut add = redis::cmd("ZADD");
                add.arg(self.in_progress_index())
                    .arg(millis(record.job.lease_until))
                    .arg(id);
                (add, "SREM")
            }
            state => {
                let mut rem = redis::cmd("ZREM");
                rem.arg(self.in_progress_index()).arg(id);
                (
                    rem,
                    if state == JobState::Unknown {
                        "SADD"
                    } else {
                        "SREM"
                    },
                )
            }
        };
        self.round_trips.fetch_add(2, Ordering::Relaxed);
        progress.query_async::<()>(&mut connection).await?;
        redis::cmd(unknown)
            .arg(self.unknown_index())
            .arg(id)
            .query_async::<()>(&mut connection)
            .await
    }

    /// On a Cluster the indexes live outside the job's slot: kept here, after the script,
    /// only when membership or the lease changed. A crash in between is repaired by the
    /// lease sweep.
    pub(super) async fn index_outside(&self, id: &str, before: &JobRecord, after: &JobRecord) {
        if !self.cluster {
            return;
        }
        let moved = before.job.state != after.job.state
            || (after.job.state == JobState::InProgress
                && before.job.lease_until != after.job.lease_until);
        if !moved {
            return;
        }
        if let Err(e) = self.set_indexes(id, after).await {
            warn!(job_id = %id, error = %e, "could not update the job indexes; the lease sweep repairs them");
        }
    }
}

//! The changes that are durable in the journal but not yet in the tables: what every read
//! looks at before the database file.
//!
//! Readers look here first and only then open a read transaction on the file. A checkpoint
//! commits its changes to the file before it retires them from here, so a reader that
//! misses a change here, because it was just retired, finds it in the file.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::job::{JobId, JobRecord};

/// A job as the overlay holds it: `None` once it was deleted (an expired job swept, or
/// replaced by a new claim of its key).
pub(super) type Version = Option<Arc<JobRecord>>;

#[derive(Debug, Default)]
pub(super) struct Overlay {
    jobs: HashMap<JobId, Slot<Version>, foldhash::fast::RandomState>,
    /// (owner, key) as the claims table keys it → the job that holds it, `None` once the
    /// job that held it was deleted.
    claims: HashMap<Vec<u8>, Slot<Option<JobId>>, foldhash::fast::RandomState>,
    /// The group that published last: every slot's group is at most this.
    published: u64,
}

#[derive(Debug)]
struct Slot<T> {
    value: T,
    /// The group that wrote it: a checkpoint retires only what it saw.
    group: u64,
}

/// A group's changes, staged by the writer while the group is built and published here
/// once its journal frames are synced.
#[derive(Debug, Default)]
pub(super) struct Staged {
    pub(super) jobs: HashMap<JobId, Version, foldhash::fast::RandomState>,
    pub(super) claims: HashMap<Vec<u8>, Option<JobId>, foldhash::fast::RandomState>,
}

impl Staged {
    pub(super) fn is_empty(&self) -> bool {
        self.jobs.is_empty() && self.claims.is_empty()
    }
}

/// What a checkpoint takes: every job the overlay holds, and the group it was taken at.
#[derive(Debug)]
pub(super) struct Snapshot {
    pub(super) jobs: Vec<(JobId, Version)>,
    pub(super) upto: u64,
}

impl Overlay {
    /// `Some` when the overlay knows the job: its latest version, or `None` if deleted;
    /// `None` when the file has the latest.
    pub(super) fn job(&self, id: &str) -> Option<Version> {
        self.jobs.get(id).map(|slot| slot.value.clone())
    }

    /// As [`Overlay::job`], for the job holding a claim key.
    pub(super) fn claim(&self, key: &[u8]) -> Option<Option<JobId>> {
        self.claims.get(key).map(|slot| slot.value.clone())
    }

    pub(super) fn len(&self) -> usize {
        self.jobs.len()
    }

    /// For a listing that merges the overlay with one of the file's indexes: the ids of
    /// every job the overlay holds (the file's entries for them are out of date), and those
    /// of its jobs that `listed` takes.
    pub(super) fn matching(
        &self,
        listed: impl Fn(&JobRecord) -> bool,
    ) -> (HashSet<JobId>, Vec<Arc<JobRecord>>) {
        let held = self.jobs.keys().cloned().collect();
        let matching = self
            .jobs
            .values()
            .filter_map(|slot| slot.value.clone())
            .filter(|record| listed(record))
            .collect();
        (held, matching)
    }

    /// Makes a synced group's changes visible.
    pub(super) fn publish(&mut self, staged: Staged) {
        self.published += 1;
        let group = self.published;
        for (id, value) in staged.jobs {
            self.jobs.insert(id, Slot { value, group });
        }
        for (key, value) in staged.claims {
            self.claims.insert(key, Slot { value, group });
        }
    }

    pub(super) fn snapshot(&self) -> Snapshot {
        Snapshot {
            jobs: self
                .jobs
                .iter()
                .map(|(id, slot)| (id.clone(), slot.value.clone()))
                .collect(),
            upto: self.published,
        }
    }

    /// Forgets what a checkpoint taken at `upto` has committed to the file; what was
    /// written after it stays.
    pub(super) fn retire(&mut self, upto: u64) {
        self.jobs.retain(|_, slot| slot.group > upto);
        self.claims.retain(|_, slot| slot.group > upto);
        if self.jobs.capacity() > 4 * self.jobs.len().max(1024) {
            self.jobs.shrink_to_fit();
            self.claims.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> Version {
        let now = crate::clock::now();
        let policy = crate::job::ExpiryPolicy {
            retention: std::time::Duration::from_secs(60),
            late_result_window: std::time::Duration::from_secs(60),
        };
        Some(Arc::new(JobRecord::new(
            id.into(),
            "o".into(),
            "k".into(),
            "fp".into(),
            "r".into(),
            now,
            now,
            &policy,
        )))
    }

    fn staged(jobs: &[(&str, Version)], claims: &[(&[u8], Option<&str>)]) -> Staged {
        let mut staged = Staged::default();
        for (id, v) in jobs {
            staged.jobs.insert((*id).into(), v.clone());
        }
        for (key, id) in claims {
            staged.claims.insert(key.to_vec(), id.map(Into::into));
        }
        staged
    }

    #[test]
    fn a_checkpoint_retires_what_it_saw_and_keeps_what_came_after() {
        let mut overlay = Overlay::default();
        overlay.publish(staged(
            &[("a", record("a")), ("b", record("b"))],
            &[(b"k-a", Some("a"))],
        ));
        let snapshot = overlay.snapshot();
        assert_eq!(snapshot.jobs.len(), 2);
        // Written while the checkpoint runs: b again, and a deletion of c.
        overlay.publish(staged(
            &[("b", record("b")), ("c", None)],
            &[(b"k-c", None)],
        ));
        overlay.retire(snapshot.upto);

        assert!(overlay.job("a").is_none(), "a is in the file now");
        assert!(overlay.claim(b"k-a").is_none());
        assert!(
            overlay.job("b").unwrap().is_some(),
            "b's newer version stays"
        );
        assert!(overlay.job("c").unwrap().is_none(), "c's deletion stays");
        assert_eq!(overlay.claim(b"k-c"), Some(None));
        overlay.retire(overlay.snapshot().upto);
        assert_eq!(overlay.len(), 0);
        assert!(overlay.claim(b"k-c").is_none());
    }
}

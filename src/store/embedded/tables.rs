//! The embedded store's tables inside one write transaction: where a checkpoint (or the
//! replay of the journal at open) writes each job's latest version, with the indexes kept in
//! step with it.

use redb::{ReadableTable, Table, WriteTransaction};

use super::writer::Change;
use super::*;

pub(super) struct Tables<'t> {
    claim_rows: Table<'t, &'static str, u64>,
    jobs: Table<'t, &'static str, &'static [u8]>,
    responses: Table<'t, &'static str, &'static [u8]>,
    expiry: Table<'t, (u64, &'static str), ()>,
    unknown: Table<'t, &'static str, ()>,
    in_progress: Table<'t, &'static str, u64>,
    /// What the claim index must take once the transaction is committed.
    claim_changes: Vec<claims::Change>,
}

/// What the secondary indexes (`expiry`, `unknown`, `in_progress`) hold for one job; all
/// three follow from its record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Indexed {
    /// In ms.
    expires_at: u64,
    unknown: bool,
    /// The lease's end in ms, while the job is `in_progress`.
    lease: Option<u64>,
}

impl Indexed {
    #[cfg(test)]
    pub(super) fn new(expires_at: u64, unknown: bool, lease: Option<u64>) -> Self {
        Self {
            expires_at,
            unknown,
            lease,
        }
    }

    pub(super) fn of(record: &JobRecord) -> Self {
        Self {
            expires_at: millis(record.job.expires_at),
            unknown: record.job.state == JobState::Unknown,
            lease: (record.job.state == JobState::InProgress)
                .then(|| millis(record.job.lease_until)),
        }
    }
}

pub(super) type TxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

impl<'t> Tables<'t> {
    pub(super) fn open(txn: &'t WriteTransaction) -> Result<Self, redb::TableError> {
        Ok(Self {
            claim_rows: txn.open_table(CLAIM_ROWS)?,
            jobs: txn.open_table(JOBS)?,
            responses: txn.open_table(RESPONSES)?,
            expiry: txn.open_table(EXPIRY)?,
            unknown: txn.open_table(UNKNOWN)?,
            in_progress: txn.open_table(IN_PROGRESS)?,
            claim_changes: Vec::new(),
        })
    }

    /// The changes the claim index must take once the transaction is committed.
    pub(super) fn into_claim_changes(self) -> Vec<claims::Change> {
        self.claim_changes
    }

    /// Applies one journal frame.
    pub(super) fn change(&mut self, change: Change) -> TxResult<()> {
        match change {
            Change::Put(record) => self.put(&record),
            Change::Delete(id) => self.delete(&id),
        }
    }

    /// The job's row (at its [`row_key`]), without its answer.
    fn load(&self, row: &str) -> TxResult<Option<JobRecord>> {
        match self.jobs.get(row)? {
            None => Ok(None),
            Some(bytes) => Ok(Some(decode(bytes.value())?)),
        }
    }

    /// Writes `record` as its job's latest version, its answer to its own table, and moves
    /// the index entries that change. Every job the tables hold holds its key (a claim
    /// that replaces an expired job deletes it), so a new job's claim is filed with it: in
    /// its id, or in `claim_rows` if the id does not carry its hash. Replayed from an
    /// earlier point, the frames of a job that a later one replaced file it again for a
    /// while, until its deletion's frame.
    pub(super) fn put(&mut self, record: &JobRecord) -> TxResult<()> {
        let id = record.job.id.as_str();
        let row = row_key(id);
        let before = self.load(&row)?.map(|job| Indexed::of(&job));
        if before.is_none() {
            let hash = claims::hash_of(&record.job.owner, &record.job.key);
            if claims::carried_hash(id) != Some(hash) {
                self.claim_rows.insert(row.as_str(), hash)?;
            }
            let holder = claims::Holder::new(hash, id);
            self.claim_changes.push(claims::Change::Add(hash, holder));
        }
        self.save(record, &row, before)
    }

    /// Writes the rows and keeps the indexes in step. `before` is what the indexes hold for
    /// the job (nothing for a new one): an entry that does not change is not touched, since
    /// each insert or remove in a table walks its tree and may copy a page, even when it
    /// changes nothing.
    fn save(&mut self, record: &JobRecord, row: &str, before: Option<Indexed>) -> TxResult<()> {
        let id = record.job.id.as_str();
        if let Some(response) = &record.job.response {
            self.responses.insert(row, encode(response).as_slice())?;
        }
        self.jobs
            .insert(row, encode(&Unanswered(record)).as_slice())?;
        let after = Indexed::of(record);
        let expired_at = before.map(|b| b.expires_at);
        if expired_at != Some(after.expires_at) {
            if let Some(previous) = expired_at {
                self.expiry.remove((previous, id))?;
            }
            self.expiry.insert((after.expires_at, id), ())?;
        }
        match (before.is_some_and(|b| b.unknown), after.unknown) {
            (false, true) => drop(self.unknown.insert(id, ())?),
            (true, false) => drop(self.unknown.remove(id)?),
            _ => {}
        }
        match (before.and_then(|b| b.lease), after.lease) {
            (Some(old), Some(new)) if old == new => {}
            (_, Some(lease)) => drop(self.in_progress.insert(id, lease)?),
            (Some(_), None) => drop(self.in_progress.remove(id)?),
            (None, None) => {}
        }
        Ok(())
    }

    /// Deletes the job, its answer, its index entries and its claim. A job the tables
    /// never had is nothing to delete.
    pub(super) fn delete(&mut self, id: &str) -> TxResult<()> {
        let row = row_key(id);
        let Some(record) = self.load(&row)? else {
            return Ok(());
        };
        self.jobs.remove(row.as_str())?;
        self.responses.remove(row.as_str())?;
        self.expiry.remove((millis(record.job.expires_at), id))?;
        self.unknown.remove(id)?;
        self.in_progress.remove(id)?;
        let filed = self
            .claim_rows
            .remove(row.as_str())?
            .map(|hash| hash.value());
        if let Some(hash) = filed.or_else(|| claims::carried_hash(id)) {
            let holder = claims::Holder::new(hash, id);
            self.claim_changes
                .push(claims::Change::Remove(hash, holder));
        }
        Ok(())
    }
}

/// A record encoded as its row: everything but its answer, which has a table of its own
/// (written once, when an attempt wins, and read only by replays). The same encoding as
/// the record with `response: None`, written field by field from the record itself: a
/// checkpoint writes every job it takes, and a copy of each record only to blank its answer
/// was a tenth of a checkpoint's allocations. A test holds the two encodings equal.
pub(super) struct Unanswered<'a>(pub(super) &'a JobRecord);

impl serde::Serialize for Unanswered<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut record = serializer.serialize_struct("JobRecord", 2)?;
        record.serialize_field("job", &UnansweredJob(&self.0.job))?;
        record.serialize_field("attempts", &self.0.attempts)?;
        record.end()
    }
}

/// [`crate::job::Job`]'s fields in their order, its answer left out.
struct UnansweredJob<'a>(&'a crate::job::Job);

impl serde::Serialize for UnansweredJob<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let job = self.0;
        let mut out = serializer.serialize_struct("Job", 13)?;
        out.serialize_field("id", &job.id)?;
        out.serialize_field("owner", &job.owner)?;
        out.serialize_field("key", &job.key)?;
        out.serialize_field("fingerprint", &job.fingerprint)?;
        out.serialize_field("route", &job.route)?;
        out.serialize_field("state", &job.state)?;
        out.serialize_field("version", &job.version)?;
        out.serialize_field("completed_by", &job.completed_by)?;
        out.serialize_field("created_at", &job.created_at)?;
        out.serialize_field("updated_at", &job.updated_at)?;
        out.serialize_field("expires_at", &job.expires_at)?;
        out.serialize_field("lease_until", &job.lease_until)?;
        out.serialize_field("response", &None::<crate::job::StoredResponse>)?;
        out.end()
    }
}

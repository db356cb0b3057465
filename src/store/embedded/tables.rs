//! The embedded store's tables inside one write transaction: every operation of a group
//! commit runs here, each atomic, each seeing the writes of the ones before it.

use redb::{ReadableTable, Table, WriteTransaction};

use super::*;

pub(super) struct Tables<'t> {
    claims: Table<'t, &'static [u8], &'static str>,
    jobs: Table<'t, &'static str, &'static [u8]>,
    responses: Table<'t, &'static str, &'static [u8]>,
    expiry: Table<'t, (u64, &'static str), ()>,
    unknown: Table<'t, &'static str, ()>,
    in_progress: Table<'t, &'static str, u64>,
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
            claims: txn.open_table(CLAIMS)?,
            jobs: txn.open_table(JOBS)?,
            responses: txn.open_table(RESPONSES)?,
            expiry: txn.open_table(EXPIRY)?,
            unknown: txn.open_table(UNKNOWN)?,
            in_progress: txn.open_table(IN_PROGRESS)?,
        })
    }

    pub(super) fn run(&mut self, op: Op, policy: &ExpiryPolicy, touched: &mut Vec<JobId>) -> Done {
        let wrap = |e: Box<dyn std::error::Error + Send + Sync>| {
            StoreError::unavailable("embedded store", e)
        };
        match op {
            Op::Claim { record, now, reply } => {
                Done::Claim(reply, self.claim(*record, now).map_err(wrap))
            }
            Op::Apply {
                id,
                transition,
                now,
                reply,
            } => {
                let result = self
                    .apply(&id, transition, now, policy)
                    .map_err(wrap)
                    .and_then(|applied| applied.ok_or_else(|| StoreError::NotFound(id.clone())));
                if matches!(&result, Ok(a) if a.outcome.is_ok()) {
                    touched.push(id);
                }
                Done::Apply(reply, result)
            }
            Op::Sweep { now, reply } => Done::Sweep(reply, self.sweep(now, touched).map_err(wrap)),
        }
    }

    pub(super) fn load(&self, id: &str) -> TxResult<Option<JobRecord>> {
        match self.jobs.get(row_key(id).as_str())? {
            None => Ok(None),
            Some(bytes) => Ok(Some(decode(bytes.value())?)),
        }
    }

    pub(super) fn with_response(&self, mut record: JobRecord) -> TxResult<JobRecord> {
        if record.job.state == JobState::Succeeded && record.job.response.is_none() {
            if let Some(bytes) = self.responses.get(row_key(&record.job.id).as_str())? {
                record.job.response = Some(decode::<StoredResponse>(bytes.value())?);
            }
        }
        Ok(record)
    }

    /// Writes a record and keeps the indexes in step with it. The answer goes to its own
    /// table, once. `before` is what the indexes hold for the job (nothing for a new one):
    /// an entry that does not change is not touched, since each insert or remove in a table
    /// walks its tree and may copy a page, even when it changes nothing.
    pub(super) fn save(
        &mut self,
        mut record: JobRecord,
        before: Option<Indexed>,
    ) -> TxResult<JobRecord> {
        let id = record.job.id.clone();
        let row = row_key(&id);
        let response = record.job.response.take();
        if let Some(response) = &response {
            self.responses
                .insert(row.as_str(), encode(response).as_slice())?;
        }
        self.jobs.insert(row.as_str(), encode(&record).as_slice())?;
        let after = Indexed::of(&record);
        let expired_at = before.map(|b| b.expires_at);
        if expired_at != Some(after.expires_at) {
            if let Some(previous) = expired_at {
                self.expiry.remove((previous, id.as_str()))?;
            }
            self.expiry.insert((after.expires_at, id.as_str()), ())?;
        }
        match (before.is_some_and(|b| b.unknown), after.unknown) {
            (false, true) => drop(self.unknown.insert(id.as_str(), ())?),
            (true, false) => drop(self.unknown.remove(id.as_str())?),
            _ => {}
        }
        match (before.and_then(|b| b.lease), after.lease) {
            (Some(old), Some(new)) if old == new => {}
            (_, Some(lease)) => drop(self.in_progress.insert(id.as_str(), lease)?),
            (Some(_), None) => drop(self.in_progress.remove(id.as_str())?),
            (None, None) => {}
        }
        record.job.response = response;
        Ok(record)
    }

    pub(super) fn delete(&mut self, record: &JobRecord) -> TxResult<()> {
        let id = record.job.id.as_str();
        let row = row_key(id);
        self.jobs.remove(row.as_str())?;
        self.responses.remove(row.as_str())?;
        self.expiry.remove((millis(record.job.expires_at), id))?;
        self.unknown.remove(id)?;
        self.in_progress.remove(id)?;
        let key = claim_key(record);
        let owned = self
            .claims
            .get(key.as_slice())?
            .is_some_and(|v| v.value() == id);
        if owned {
            self.claims.remove(key.as_slice())?;
        }
        Ok(())
    }

    pub(super) fn claim(&mut self, record: JobRecord, now: SystemTime) -> TxResult<Claim> {
        let key = claim_key(&record);
        let existing = self
            .claims
            .get(key.as_slice())?
            .map(|id| id.value().to_owned());
        if let Some(id) = existing {
            let found = self.load(&id)?;
            match (JobRecord::claim_rule(found.as_ref(), now), found) {
                (ClaimRule::Keep, Some(found)) => {
                    return Ok(Claim::Existing(self.with_response(found)?));
                }
                (ClaimRule::Replace, Some(expired)) => self.delete(&expired)?,
                _ => {}
            }
        }
        self.claims.insert(key.as_slice(), record.job.id.as_str())?;
        Ok(Claim::Created(self.save(record, None)?))
    }

    pub(super) fn apply(
        &mut self,
        id: &str,
        transition: Transition,
        now: SystemTime,
        policy: &ExpiryPolicy,
    ) -> TxResult<Option<Applied>> {
        let Some(mut record) = self.load(id)? else {
            return Ok(None);
        };
        let before = Indexed::of(&record);
        let outcome = record.apply(transition, now, policy);
        if outcome.is_ok() {
            record = self.save(record, Some(before))?;
        }
        let record = self.with_response(record)?;
        Ok(Some(Applied { outcome, record }))
    }

    /// Deletes up to [`SWEEP_LIMIT`] due jobs; returns how many expiry entries it took away,
    /// so a batch that removed fewer than the limit is the last one due.
    pub(super) fn sweep(&mut self, now: SystemTime, touched: &mut Vec<JobId>) -> TxResult<usize> {
        let due: Vec<(u64, String)> = self
            .expiry
            .range((0, "")..(millis(now), ""))?
            .take(SWEEP_LIMIT)
            .map(|entry| entry.map(|(k, _)| (k.value().0, k.value().1.to_owned())))
            .collect::<Result<_, _>>()?;
        let mut removed = 0;
        for (at, id) in &due {
            match self.load(id)? {
                Some(record) if record.is_expired(now) => {
                    self.delete(&record)?;
                    removed += 1;
                }
                Some(_) => {}
                // An index entry without its job: drop it.
                None => {
                    self.expiry.remove((*at, id.as_str()))?;
                    removed += 1;
                }
            }
            touched.push(id.clone());
        }
        Ok(removed)
    }
}

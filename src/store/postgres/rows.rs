//! Records to and from rows: the one query every read uses, and the decoding of its rows.

use std::time::SystemTime;

use bytes::Bytes;
use tokio_postgres::Row;

use super::unavailable;
use crate::job::{Attempt, Job, JobRecord, StoredResponse};
use crate::store::{decode, StoreError};

/// A job with its answer and attempts: one row per attempt (one row when there is none),
/// in attempt order. `{where}` selects the job.
pub(super) const SELECT_RECORD: &str = "
SELECT j.id, j.owner, j.idempotency_key, j.fingerprint, j.route, j.state, j.version,
       j.completed_by, j.created_at, j.updated_at, j.expires_at, j.lease_until,
       j.lease_until_ns, j.revision,
       r.status AS r_status, r.headers AS r_headers, r.body AS r_body,
       r.body_omitted AS r_body_omitted,
       a.n AS a_n, a.provider AS a_provider, a.state AS a_state,
       a.read_version AS a_read_version, a.started_at AS a_started_at,
       a.finished_at AS a_finished_at, a.upstream_status AS a_upstream_status,
       a.error AS a_error
FROM jobs j
LEFT JOIN responses r ON r.job_id = j.id
LEFT JOIN attempts a ON a.job_id = j.id
WHERE {where}
ORDER BY a.n";

pub(super) fn select_record(condition: &str) -> String {
    SELECT_RECORD.replace("{where}", condition)
}

/// The record the rows describe, with its revision; `None` when there are no rows or the
/// job columns are null (an outer join that found nothing).
pub(super) fn record_of(rows: &[Row]) -> Result<Option<(i64, JobRecord)>, StoreError> {
    let Some(first) = rows.first() else {
        return Ok(None);
    };
    let Some(id) = first
        .try_get::<_, Option<String>>("id")
        .map_err(unavailable)?
    else {
        return Ok(None);
    };
    let state: String = get(first, "state")?;
    let response = match get::<Option<i32>>(first, "r_status")? {
        None => None,
        Some(status) => Some(StoredResponse {
            status: u16::try_from(status).map_err(unavailable)?,
            headers: decode(&get::<Vec<u8>>(first, "r_headers")?)?,
            body: Bytes::from(get::<Vec<u8>>(first, "r_body")?),
            body_omitted: get(first, "r_body_omitted")?,
        }),
    };
    let job = Job {
        id,
        owner: get(first, "owner")?,
        key: get(first, "idempotency_key")?,
        fingerprint: get(first, "fingerprint")?,
        route: get(first, "route")?,
        state: state.parse().map_err(unavailable)?,
        version: unsigned(get::<i64>(first, "version")?)?,
        completed_by: get::<Option<i32>>(first, "completed_by")?
            .map(unsigned)
            .transpose()?,
        created_at: get(first, "created_at")?,
        updated_at: get(first, "updated_at")?,
        expires_at: get(first, "expires_at")?,
        lease_until: get::<SystemTime>(first, "lease_until")?
            + std::time::Duration::from_nanos(unsigned(get::<i32>(first, "lease_until_ns")?)?),
        response,
    };
    let mut attempts = Vec::new();
    for row in rows {
        let Some(n) = get::<Option<i32>>(row, "a_n")? else {
            continue;
        };
        let state: String = get(row, "a_state")?;
        attempts.push(Attempt {
            n: unsigned(n)?,
            provider: get(row, "a_provider")?,
            state: state.parse().map_err(unavailable)?,
            read_version: unsigned(get::<i64>(row, "a_read_version")?)?,
            started_at: get(row, "a_started_at")?,
            finished_at: get(row, "a_finished_at")?,
            upstream_status: get::<Option<i32>>(row, "a_upstream_status")?
                .map(|s| u16::try_from(s).map_err(unavailable))
                .transpose()?,
            error: get(row, "a_error")?,
        });
    }
    let revision = get(first, "revision")?;
    Ok(Some((revision, JobRecord { job, attempts })))
}

fn get<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a Row,
    column: &str,
) -> Result<T, StoreError> {
    row.try_get(column).map_err(unavailable)
}

fn unsigned<T: TryFrom<i64>, S: Into<i64>>(value: S) -> Result<T, StoreError>
where
    T::Error: std::error::Error + Send + Sync + 'static,
{
    T::try_from(value.into()).map_err(unavailable)
}

/// `value` as PostgreSQL `text` can hold it: NUL is the one character it refuses, and an
/// attempt's error can quote a provider (an error code from its body), so a hostile one
/// must not make the write fail. NUL becomes U+FFFD.
pub(super) fn text(value: &str) -> String {
    if value.contains('\0') {
        value.replace('\0', "\u{FFFD}")
    } else {
        value.to_owned()
    }
}

/// The nanoseconds of `t` below its microsecond, which `timestamptz` does not keep.
pub(super) fn sub_micros(t: SystemTime) -> i32 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| (d.subsec_nanos() % 1000) as i32)
}

/// Attempts as the column arrays `unnest` takes, in the order of the attempts table.
#[derive(Default)]
pub(super) struct AttemptColumns {
    pub n: Vec<i32>,
    pub provider: Vec<String>,
    pub state: Vec<&'static str>,
    pub read_version: Vec<i64>,
    pub started_at: Vec<SystemTime>,
    pub finished_at: Vec<Option<SystemTime>>,
    pub upstream_status: Vec<Option<i32>>,
    pub error: Vec<Option<String>>,
}

impl AttemptColumns {
    pub(super) fn of<'a>(attempts: impl IntoIterator<Item = &'a Attempt>) -> Self {
        let mut columns = Self::default();
        for a in attempts {
            columns.n.push(a.n as i32);
            columns.provider.push(text(&a.provider));
            columns.state.push(a.state.as_str());
            columns.read_version.push(a.read_version as i64);
            columns.started_at.push(a.started_at);
            columns.finished_at.push(a.finished_at);
            columns
                .upstream_status
                .push(a.upstream_status.map(i32::from));
            columns.error.push(a.error.as_deref().map(text));
        }
        columns
    }
}

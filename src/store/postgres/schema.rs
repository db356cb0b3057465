//! The schema of SPEC §12, as versioned migrations embedded in the binary. Each runs once,
//! in its own transaction, under an advisory lock, so gateways starting together never race:
//! one migrates, the others wait for the lock and then find nothing to do. Migrations only
//! ever add; none drops or rewrites what an operator may be reading.

use tokio_postgres::Client;

/// The advisory lock every migrating gateway takes: "idemgate" in ASCII.
const LOCK: i64 = 0x6964_656d_6761_7465;

/// (version, name, SQL), in order. Never edit one that has shipped: add the next.
pub(super) const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "jobs, attempts, responses, mirrored streams",
        r#"
CREATE TABLE jobs (
    id              text        PRIMARY KEY,
    owner           text        NOT NULL,
    idempotency_key text        NOT NULL,
    fingerprint     text        NOT NULL,
    route           text        NOT NULL,
    state           text        NOT NULL CHECK (state IN
                        ('in_progress', 'succeeded', 'failed', 'unknown', 'cancelled')),
    version         bigint      NOT NULL,
    completed_by    integer,
    created_at      timestamptz NOT NULL,
    updated_at      timestamptz NOT NULL,
    expires_at      timestamptz NOT NULL,
    lease_until     timestamptz NOT NULL,
    -- The nanoseconds below lease_until's microsecond: a retried re-open recognises itself
    -- by its exact lease instant.
    lease_until_ns  integer     NOT NULL DEFAULT 0,
    revision        bigint      NOT NULL,
    UNIQUE (owner, idempotency_key)
);
CREATE INDEX jobs_in_progress ON jobs (id) WHERE state = 'in_progress';
CREATE INDEX jobs_in_progress_lease ON jobs (lease_until) WHERE state = 'in_progress';
CREATE INDEX jobs_unknown ON jobs (id) WHERE state = 'unknown';
CREATE INDEX jobs_expires_at ON jobs (expires_at);

CREATE TABLE attempts (
    job_id          text        NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    n               integer     NOT NULL,
    provider        text        NOT NULL,
    state           text        NOT NULL CHECK (state IN ('started', 'succeeded', 'failed',
                        'unknown', 'lost_race', 'contract_rejected', 'cancelled')),
    read_version    bigint      NOT NULL,
    started_at      timestamptz NOT NULL,
    finished_at     timestamptz,
    upstream_status integer,
    error           text,
    PRIMARY KEY (job_id, n)
);
CREATE INDEX attempts_started_at ON attempts (started_at);

CREATE TABLE responses (
    job_id          text        PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
    status          integer     NOT NULL,
    headers         bytea       NOT NULL,
    body            bytea       NOT NULL,
    body_omitted    boolean     NOT NULL
);

CREATE TABLE stream_heads (
    job_id          text        PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
    head            bytea       NOT NULL,
    ended           text,
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX stream_heads_updated_at ON stream_heads (updated_at);

CREATE TABLE stream_chunks (
    job_id          text        NOT NULL REFERENCES stream_heads (job_id) ON DELETE CASCADE,
    seq             integer     NOT NULL,
    data            bytea       NOT NULL,
    PRIMARY KEY (job_id, seq)
);
"#,
    ),
    (
        2,
        "the attempt a mirrored stream is of",
        // Chunks and ends are written only to the mirror of their own attempt, so a cut
        // attempt's late writes cannot land in its retry's stream. 0 for a head written
        // before: no attempt is numbered 0, so such a mirror takes no more writes.
        r#"
ALTER TABLE stream_heads ADD COLUMN attempt integer NOT NULL DEFAULT 0;
"#,
    ),
];

/// Brings the database up to the latest migration; the versions this call applied (none
/// when another gateway already did).
pub async fn migrate(client: &mut Client) -> Result<Vec<i32>, tokio_postgres::Error> {
    client
        .execute("SELECT pg_advisory_lock($1)", &[&LOCK])
        .await?;
    let result = apply_missing(client).await;
    // Released on every path; a dropped connection releases it too.
    let unlocked = client
        .execute("SELECT pg_advisory_unlock($1)", &[&LOCK])
        .await;
    let applied = result?;
    unlocked?;
    Ok(applied)
}

async fn apply_missing(client: &mut Client) -> Result<Vec<i32>, tokio_postgres::Error> {
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS idemgate_migrations (
                version    integer     PRIMARY KEY,
                name       text        NOT NULL,
                applied_at timestamptz NOT NULL DEFAULT now()
            )",
        )
        .await?;
    let current: i32 = client
        .query_one(
            "SELECT coalesce(max(version), 0) FROM idemgate_migrations",
            &[],
        )
        .await?
        .get(0);
    let mut applied = Vec::new();
    for &(version, name, sql) in MIGRATIONS.iter().filter(|(v, ..)| *v > current) {
        let transaction = client.transaction().await?;
        transaction.batch_execute(sql).await?;
        transaction
            .execute(
                "INSERT INTO idemgate_migrations (version, name) VALUES ($1, $2)",
                &[&version, &name],
            )
            .await?;
        transaction.commit().await?;
        tracing::info!(version, name, "applied a PostgreSQL migration");
        applied.push(version);
    }
    Ok(applied)
}

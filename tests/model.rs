//! Model-based tests of the job protocol: thousands of generated histories of store
//! operations — claims (also racing ones), attempts starting, answering, failing, timing out,
//! streams, cancels, re-opens, lease lapses, expiry — applied to every store and to a
//! reference model, with the protocol's invariants checked after every step.
//!
//! Each history comes from a seed and replays exactly: a failure prints its seed, and
//! `MODEL_SEED=<seed> cargo test --test model` reruns that one history. `cargo test` runs a
//! bounded number of seeds per store (3000 memory, 60 embedded, 300 Redis, 100 Redis
//! Cluster: seconds); `MODEL_SCALE=20 cargo test --release --test model -- --nocapture`
//! runs twenty times as many (minutes), for before a release; `MODEL_FROM=<seed>` starts
//! them there instead of at 0, to explore seeds not run before.
//!
//! The invariants, written once here:
//! 1. At most one attempt of a job ever wins: `completed_by` is set once, and a settled
//!    answer never changes.
//! 2. The stored answer is byte-identical to the answer the winning attempt offered.
//! 3. No attempt of a later round starts while an attempt of an earlier round may still be
//!    running — started, and neither answered nor cancelled, whatever the store calls it
//!    (attempts of one round may overlap: that is hedging).
//! 4. A late answer after a cancel or a lost race is never stored.
//! 5. One (owner, key) has one job within retention; different (owner, key) never share one.
//! 6. Every attempt belongs to exactly one job: ordinals are 1, 2, … with no gaps, and a
//!    winner's fencing token is the version it completed (`read_version + 1`).
//!
//! Now and then two transitions of one job are sent at once (`Op::Race`): the store's result
//! must be one of the two orders, each step of it lawful.
//!
//! Every step is also checked against `reference`, SPEC §2 written as a small table of its
//! own (not `JobRecord::apply`): a rule bug that the store and the crate's model would share
//! is caught there. Histories also run through a store that loses replies (`tests/faults`),
//! each failed write retried as the engine retries it.

mod common;
mod faults;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use common::redis_server::{RedisCluster, RedisServer};
use idemgate::config::{StoreConfig, StoreKind};
use idemgate::job::{
    new_job_id, AttemptState, Effect, ExpiryPolicy, Failure, JobRecord, JobState, StoredResponse,
    Transition,
};
use idemgate::store::{Claim, JobStore};

const POLICY: ExpiryPolicy = ExpiryPolicy {
    retention: Duration::from_secs(100),
    late_result_window: Duration::from_secs(50),
};
const STEPS: usize = 60;

/// One step of a history. Jobs and attempts are picked by index among the known ones.
#[derive(Clone, Debug)]
enum Op {
    Claim {
        owner: u8,
        key: u8,
        payload: u8,
    },
    /// Several claims of one fresh (owner, key) at once.
    ClaimRace {
        owner: u8,
        key: u8,
        racers: u8,
    },
    Start {
        job: usize,
        provider: u8,
        stale: bool,
    },
    Complete {
        job: usize,
        attempt: usize,
        body: u8,
    },
    Fail {
        job: usize,
        attempt: usize,
        contract: bool,
    },
    AttemptUnknown {
        job: usize,
        attempt: usize,
    },
    MarkUnknown {
        job: usize,
        stale: bool,
    },
    FailRound {
        job: usize,
        stale: bool,
    },
    Cancel {
        job: usize,
    },
    Reopen {
        job: usize,
        stale: bool,
    },
    RenewLease {
        job: usize,
    },
    ExpireLease {
        job: usize,
    },
    BeginStream {
        job: usize,
        attempt: usize,
    },
    EndStream {
        job: usize,
        attempt: usize,
        body: u8,
    },
    CutStream {
        job: usize,
        attempt: usize,
    },
    /// The clock moves past retention: every settled job may expire.
    Later,
    /// Two transitions of one job sent at once, as two gateways (or a round and a late
    /// answer) would: the store must serialise them in one order or the other.
    Race(Box<Op>, Box<Op>),
}

/// A transition of the same job as `op` (a racer for it), when `op` is a transition.
fn transition_op(rng: &mut fastrand::Rng, op: &Op) -> Option<Op> {
    let job = match op {
        Op::Start { job, .. }
        | Op::Complete { job, .. }
        | Op::Fail { job, .. }
        | Op::AttemptUnknown { job, .. }
        | Op::MarkUnknown { job, .. }
        | Op::FailRound { job, .. }
        | Op::Cancel { job }
        | Op::Reopen { job, .. }
        | Op::BeginStream { job, .. }
        | Op::EndStream { job, .. }
        | Op::CutStream { job, .. } => *job,
        _ => return None,
    };
    let attempt = rng.usize(0..4);
    Some(match rng.u8(0..7) {
        0 => Op::Complete {
            job,
            attempt,
            body: rng.u8(0..255),
        },
        1 => Op::Fail {
            job,
            attempt,
            contract: false,
        },
        2 => Op::Cancel { job },
        3 => Op::MarkUnknown { job, stale: false },
        4 => Op::Start {
            job,
            provider: rng.u8(0..3),
            stale: false,
        },
        5 => Op::BeginStream { job, attempt },
        _ => Op::Reopen { job, stale: false },
    })
}

fn generate(rng: &mut fastrand::Rng) -> Vec<Op> {
    let mut ops = Vec::with_capacity(STEPS);
    for _ in 0..rng.usize(1..=STEPS) {
        // Now and then the last transition races the next one of the same job.
        if rng.u8(0..10) == 0 {
            if let Some(last) = ops.pop() {
                let other = transition_op(rng, &last);
                ops.push(match other {
                    Some(other) => Op::Race(Box::new(last), Box::new(other)),
                    None => last,
                });
                continue;
            }
        }
        let job = rng.usize(0..6);
        let attempt = rng.usize(0..4);
        let op = match rng.u32(0..100) {
            0..=13 => Op::Claim {
                owner: rng.u8(0..2),
                key: rng.u8(0..3),
                payload: rng.u8(0..2),
            },
            14..=16 => Op::ClaimRace {
                owner: rng.u8(0..3),
                key: rng.u8(3..40),
                racers: rng.u8(2..8),
            },
            17..=29 => Op::Start {
                job,
                provider: rng.u8(0..3),
                stale: rng.u8(0..8) == 0,
            },
            30..=41 => Op::Complete {
                job,
                attempt,
                body: rng.u8(0..255),
            },
            42..=49 => Op::Fail {
                job,
                attempt,
                contract: rng.bool(),
            },
            50..=56 => Op::AttemptUnknown { job, attempt },
            57..=61 => Op::MarkUnknown {
                job,
                stale: rng.u8(0..4) == 0,
            },
            62..=66 => Op::FailRound {
                job,
                stale: rng.u8(0..4) == 0,
            },
            67..=71 => Op::Cancel { job },
            72..=78 => Op::Reopen {
                job,
                stale: rng.u8(0..4) == 0,
            },
            79..=80 => Op::RenewLease { job },
            81..=83 => Op::ExpireLease { job },
            84..=88 => Op::BeginStream { job, attempt },
            89..=92 => Op::EndStream {
                job,
                attempt,
                body: rng.u8(0..255),
            },
            93..=95 => Op::CutStream { job, attempt },
            _ => Op::Later,
        };
        ops.push(op);
    }
    ops
}

fn body(tag: u8) -> StoredResponse {
    StoredResponse {
        status: 200,
        headers: vec![(
            "content-type".into(),
            Bytes::from_static(b"application/json"),
        )]
        .into(),
        body: Bytes::from(format!("{{\"answer\":{tag}}}")),
        body_omitted: false,
    }
}

/// What happened to one job, as the invariants need it.
#[derive(Default, Debug)]
struct History {
    /// The attempt that won and the answer it offered.
    winner: Option<(u32, StoredResponse)>,
    /// Attempts that were cancelled or lost a race: their late answers must never land.
    dead: Vec<u32>,
    /// Attempts whose call may still be running, with the version they read: started, and
    /// no answer (success, failure, cut) has come back and no cancel resolved them. A
    /// timeout does not end a call.
    alive: Vec<(u32, u64)>,
}

/// The reference model: the pure state machine, one record per job, plus the claims index.
#[derive(Default)]
struct Model {
    claims: HashMap<(String, String), String>,
    jobs: HashMap<String, JobRecord>,
}

struct Runner {
    store: Arc<dyn JobStore>,
    model: Model,
    /// Job ids in the order they were created.
    ids: Vec<String>,
    histories: HashMap<String, History>,
    now: SystemTime,
    log: Vec<String>,
}

impl Runner {
    fn fail(&self, seed: u64, store: &str, why: String) -> ! {
        panic!(
            "{store}: seed {seed} broke an invariant: {why}\nhistory:\n  {}\nrerun: MODEL_SEED={seed} cargo test --test model",
            self.log.join("\n  ")
        );
    }

    async fn claim(&mut self, owner: &str, key: &str, payload: u8) -> Result<(), String> {
        let fingerprint = format!("fp-{payload}");
        let record = JobRecord::new(
            new_job_id(owner, key),
            owner.into(),
            key.into(),
            fingerprint.clone(),
            "chat".into(),
            self.now,
            self.now + Duration::from_secs(30),
            &POLICY,
        );
        let claimed = self
            .store
            .claim(record.clone(), self.now)
            .await
            .map_err(|e| e.to_string())?;
        let index = (owner.to_owned(), key.to_owned());
        let live = self
            .model
            .claims
            .get(&index)
            .and_then(|id| self.model.jobs.get(id))
            .filter(|r| !r.is_expired(self.now))
            .map(|r| r.job.id.clone());
        match (claimed, live) {
            (Claim::Existing(found), Some(id)) if found.job.id == id => Ok(()),
            (Claim::Existing(found), expected) => Err(format!(
                "claim of ({owner}, {key}) found {} but the model has {expected:?}",
                found.job.id
            )),
            (Claim::Created(created), None) => {
                if self.model.jobs.values().any(|r| r.job.id == created.job.id) {
                    return Err("a claim reused another job's id".into());
                }
                self.model.claims.insert(index, created.job.id.clone());
                self.model
                    .jobs
                    .insert(created.job.id.clone(), created.clone());
                self.ids.push(created.job.id.clone());
                self.histories
                    .insert(created.job.id.clone(), History::default());
                Ok(())
            }
            (Claim::Created(created), Some(id)) => Err(format!(
                "claim of ({owner}, {key}) created {} while {id} is live: two jobs for one intent",
                created.job.id
            )),
        }
    }

    async fn claim_race(&mut self, owner: &str, key: &str, racers: u8) -> Result<(), String> {
        let fresh = !self
            .model
            .claims
            .contains_key(&(owner.to_owned(), key.to_owned()));
        if !fresh {
            return self.claim(owner, key, 0).await;
        }
        let mut tasks = Vec::new();
        for _ in 0..racers {
            let store = self.store.clone();
            let record = JobRecord::new(
                new_job_id(owner, key),
                owner.into(),
                key.into(),
                "fp-0".into(),
                "chat".into(),
                self.now,
                self.now + Duration::from_secs(30),
                &POLICY,
            );
            let now = self.now;
            tasks.push(tokio::spawn(async move { store.claim(record, now).await }));
        }
        let mut created = Vec::new();
        let mut seen = Vec::new();
        for task in tasks {
            match task.await.unwrap().map_err(|e| e.to_string())? {
                Claim::Created(r) => {
                    seen.push(r.job.id.clone());
                    created.push(r);
                }
                Claim::Existing(r) => seen.push(r.job.id),
            }
        }
        if created.len() != 1 || seen.iter().any(|id| *id != seen[0]) {
            return Err(format!(
                "{racers} racing claims created {} jobs: {seen:?}",
                created.len()
            ));
        }
        let record = created.pop().unwrap();
        self.model
            .claims
            .insert((owner.to_owned(), key.to_owned()), record.job.id.clone());
        self.model
            .jobs
            .insert(record.job.id.clone(), record.clone());
        self.ids.push(record.job.id.clone());
        self.histories
            .insert(record.job.id.clone(), History::default());
        Ok(())
    }

    fn transition(&self, op: &Op) -> Option<(String, Transition)> {
        let pick = |job: usize| self.ids.get(job % self.ids.len().max(1)).cloned();
        let id = match op {
            Op::Claim { .. } | Op::ClaimRace { .. } | Op::Later | Op::Race(..) => return None,
            Op::Start { job, .. }
            | Op::Complete { job, .. }
            | Op::Fail { job, .. }
            | Op::AttemptUnknown { job, .. }
            | Op::MarkUnknown { job, .. }
            | Op::FailRound { job, .. }
            | Op::Cancel { job }
            | Op::Reopen { job, .. }
            | Op::RenewLease { job }
            | Op::ExpireLease { job }
            | Op::BeginStream { job, .. }
            | Op::EndStream { job, .. }
            | Op::CutStream { job, .. } => pick(*job)?,
        };
        let record = self.model.jobs.get(&id)?;
        let version = |stale: bool| record.job.version - u64::from(stale && record.job.version > 1);
        let n = |attempt: usize| {
            let count = record.attempts.len().max(1);
            (attempt % count) as u32 + 1
        };
        let transition = match *op {
            Op::Start {
                provider, stale, ..
            } => Transition::StartAttempt {
                version: version(stale),
                n: record.attempts.last().map_or(1, |a| a.n + 1),
                provider: format!("p{provider}"),
            },
            Op::Complete {
                attempt, body: b, ..
            } => Transition::Complete {
                n: n(attempt),
                response: body(b),
            },
            Op::Fail {
                attempt, contract, ..
            } => Transition::FailAttempt {
                n: n(attempt),
                kind: if contract {
                    Failure::ContractRejected
                } else {
                    Failure::Failed
                },
                upstream_status: Some(503),
                error: None,
            },
            Op::AttemptUnknown { attempt, .. } => Transition::AttemptUnknown {
                n: n(attempt),
                error: "timeout".into(),
            },
            Op::MarkUnknown { stale, .. } => Transition::MarkUnknown {
                version: version(stale),
            },
            Op::FailRound { stale, .. } => Transition::FailRound {
                version: version(stale),
            },
            Op::Cancel { .. } => Transition::CancelAt {
                version: record.job.version,
            },
            Op::Reopen { stale, .. } => Transition::Reopen {
                version: version(stale),
                lease_until: self.now + Duration::from_secs(30),
            },
            Op::RenewLease { .. } => Transition::RenewLease {
                version: record.job.version,
                until: self.now + Duration::from_secs(30),
            },
            Op::ExpireLease { .. } => Transition::ExpireLease {
                version: record.job.version,
            },
            Op::BeginStream { attempt, .. } => Transition::BeginStream { n: n(attempt) },
            Op::EndStream {
                attempt, body: b, ..
            } => Transition::EndStream {
                n: n(attempt),
                response: body(b),
            },
            Op::CutStream { attempt, .. } => Transition::CutStream {
                n: n(attempt),
                error: "cut".into(),
            },
            Op::Claim { .. } | Op::ClaimRace { .. } | Op::Later | Op::Race(..) => return None,
        };
        if record.attempts.is_empty()
            && matches!(
                transition,
                Transition::Complete { .. }
                    | Transition::FailAttempt { .. }
                    | Transition::AttemptUnknown { .. }
                    | Transition::BeginStream { .. }
                    | Transition::EndStream { .. }
                    | Transition::CutStream { .. }
            )
        {
            return None;
        }
        Some((id, transition))
    }

    async fn step(&mut self, op: &Op) -> Result<(), String> {
        match *op {
            Op::Claim {
                owner,
                key,
                payload,
            } => {
                return self
                    .claim(&format!("o{owner}"), &format!("k{key}"), payload)
                    .await
            }
            Op::ClaimRace { owner, key, racers } => {
                return self
                    .claim_race(&format!("o{owner}"), &format!("race{key}"), racers)
                    .await
            }
            Op::Later => {
                self.now += POLICY.retention + POLICY.late_result_window + Duration::from_secs(1);
                return Ok(());
            }
            Op::Race(ref a, ref b) => return self.race(a, b).await,
            _ => {}
        }
        let Some((id, transition)) = self.transition(op) else {
            return Ok(());
        };
        let model = self.model.jobs.get_mut(&id).expect("picked from the model");
        if model.is_expired(self.now) {
            return Ok(());
        }
        let before = model.clone();
        let expected = model.apply(transition.clone(), self.now, &POLICY);
        // A store that blipped is retried, as the engine does: with a lost reply, the retry
        // must be recognised as already applied, or store and model part ways.
        let (applied, _) = apply_retrying(&*self.store, &id, &transition, self.now).await?;
        if applied.outcome != expected {
            return Err(format!(
                "the store answered {:?}, the model {expected:?}",
                applied.outcome
            ));
        }
        check_same(&applied.record, model)?;
        reference::check(&before, &transition, &applied.record)?;
        check_invariants(
            &before,
            &applied.record,
            &transition,
            &applied.outcome,
            self.histories.get_mut(&id).unwrap(),
        )
    }
}

impl Runner {
    /// Two transitions of one job at once: the store's result must be one of the two
    /// orders, each step of it lawful by the reference and the invariants.
    async fn race(&mut self, a: &Op, b: &Op) -> Result<(), String> {
        let (Some((id, ta)), Some((id_b, tb))) = (self.transition(a), self.transition(b)) else {
            return Ok(());
        };
        let before = self
            .model
            .jobs
            .get(&id)
            .expect("picked from the model")
            .clone();
        if id != id_b || before.is_expired(self.now) {
            return Ok(());
        }
        let (store, now) = (self.store.clone(), self.now);
        let (ra, rb) = tokio::join!(
            apply_retrying(&*store, &id, &ta, now),
            apply_retrying(&*store, &id, &tb, now)
        );
        let (ra, rb) = (ra?, rb?);
        let after = store
            .get(&id)
            .await
            .map_err(|e| e.to_string())?
            .ok_or("the raced job vanished")?;
        // Which order did the store take? Replay both on the model. A write whose reply
        // was lost may have landed before the other one and been retried after it: its
        // answer is then what its retry found, the job as the other one left it.
        for (first, second, out_first, out_second, first_retried) in [
            (&ta, &tb, &ra.0.outcome, &rb.0.outcome, ra.1),
            (&tb, &ta, &rb.0.outcome, &ra.0.outcome, rb.1),
        ] {
            let mut model = before.clone();
            let e1 = model.apply(first.clone(), now, &POLICY);
            let middle = model.clone();
            let e2 = model.apply(second.clone(), now, &POLICY);
            if &e2 != out_second {
                continue;
            }
            let settled = model.clone();
            let retry = if &e1 == out_first && check_same(&after, &model).is_ok() {
                None
            } else if first_retried {
                let e3 = model.apply(first.clone(), now, &POLICY);
                if &e3 != out_first || check_same(&after, &model).is_err() {
                    continue;
                }
                Some(e3)
            } else {
                continue;
            };
            reference::check(&before, first, &middle)?;
            reference::check(&middle, second, &settled)?;
            let history = self.histories.get_mut(&id).unwrap();
            check_invariants(&before, &middle, first, &e1, history)?;
            check_invariants(&middle, &settled, second, out_second, history)?;
            if let Some(e3) = retry {
                reference::check(&settled, first, &model)?;
                check_invariants(&settled, &model, first, &e3, history)?;
            }
            self.model.jobs.insert(id, model);
            return Ok(());
        }
        Err(format!(
            "a race of {ta:?} and {tb:?} left {:?} v{} (answers {:?}, {:?}): neither order gives that",
            after.job.state, after.job.version, ra.0.outcome, rb.0.outcome
        ))
    }
}

/// Applies a transition, retrying a store that blipped as the engine does: with a lost
/// reply, the retry must be recognised as already applied, or store and model part ways.
/// Also says whether a reply was lost, so that the write may have landed before the retry.
async fn apply_retrying(
    store: &dyn JobStore,
    id: &str,
    transition: &Transition,
    now: SystemTime,
) -> Result<(idemgate::store::Applied, bool), String> {
    let mut tries = 0;
    let mut lost_reply = false;
    loop {
        match store.apply(id, transition.clone(), now).await {
            Ok(applied) => return Ok((applied, lost_reply)),
            Err(e) if tries < 20 => {
                lost_reply |= e.to_string().contains(faults::REPLY_LOST);
                tries += 1;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The store holds exactly what the model says.
fn check_same(store: &JobRecord, model: &JobRecord) -> Result<(), String> {
    let (s, m) = (&store.job, &model.job);
    if (s.state, s.version, s.completed_by) != (m.state, m.version, m.completed_by) {
        return Err(format!(
            "store has ({}, v{}, {:?}), the model ({}, v{}, {:?})",
            s.state, s.version, s.completed_by, m.state, m.version, m.completed_by
        ));
    }
    if s.response.as_ref().map(|r| &r.body) != m.response.as_ref().map(|r| &r.body) {
        return Err("the stored answer differs from the model's".into());
    }
    let states = |r: &JobRecord| {
        r.attempts
            .iter()
            .map(|a| (a.n, a.state, a.read_version))
            .collect::<Vec<_>>()
    };
    if states(store) != states(model) {
        return Err(format!(
            "attempts differ: store {:?}, model {:?}",
            states(store),
            states(model)
        ));
    }
    Ok(())
}

fn check_invariants(
    before: &JobRecord,
    after: &JobRecord,
    transition: &Transition,
    outcome: &Result<Effect, idemgate::job::Rejection>,
    history: &mut History,
) -> Result<(), String> {
    // 1 and 2: one winner, and the stored answer is the winner's own, forever.
    if let Some((n, offered)) = &history.winner {
        if after.job.completed_by != Some(*n) {
            return Err(format!(
                "completed_by changed from {n} to {:?}",
                after.job.completed_by
            ));
        }
        if after.job.response.as_ref().map(|r| &r.body) != Some(&offered.body) {
            return Err("a settled answer changed after the job succeeded".into());
        }
    }
    if after.job.state == JobState::Succeeded && before.job.state != JobState::Succeeded {
        let n = after
            .job
            .completed_by
            .ok_or("succeeded without completed_by")?;
        let offered = match transition {
            Transition::Complete { n: m, response } | Transition::EndStream { n: m, response }
                if *m == n =>
            {
                response.clone()
            }
            _ => {
                return Err(format!(
                    "the job succeeded on {transition:?}, not on attempt {n}'s answer"
                ))
            }
        };
        if after.job.response.as_ref().map(|r| &r.body) != Some(&offered.body) {
            return Err("the stored answer is not the winning attempt's".into());
        }
        if history.dead.contains(&n) {
            return Err(format!(
                "attempt {n} was cancelled or lost, yet its late answer was stored"
            ));
        }
        // 6: the winner completed exactly the round it read.
        let winner = after
            .attempt(n)
            .ok_or("the winner is not an attempt of the job")?;
        if after.job.version != winner.read_version + 1 {
            return Err(format!(
                "attempt {n} read version {} but completed the job at version {}: it won another round",
                winner.read_version, after.job.version
            ));
        }
        history.winner = Some((n, offered));
    }
    // 4: remember which attempts may never land again.
    for a in &after.attempts {
        if matches!(a.state, AttemptState::Cancelled | AttemptState::LostRace)
            && !history.dead.contains(&a.n)
        {
            history.dead.push(a.n);
        }
    }
    // 3: a new round's attempt never starts beside a call of an earlier round that may
    // still be running.
    match (transition, outcome) {
        (Transition::StartAttempt { .. }, Ok(Effect::AttemptStarted { n, read_version })) => {
            if let Some((old, old_version)) = history.alive.iter().find(|(_, v)| v < read_version) {
                return Err(format!(
                    "attempt {n} started at version {read_version} while attempt {old} of version {old_version} may still be running"
                ));
            }
            history.alive.push((*n, *read_version));
        }
        (
            Transition::Complete { n, .. }
            | Transition::FailAttempt { n, .. }
            | Transition::EndStream { n, .. }
            | Transition::CutStream { n, .. },
            _,
        ) => history.alive.retain(|(a, _)| a != n),
        (Transition::Cancel | Transition::CancelAt { .. }, Ok(_)) => history.alive.clear(),
        _ => {}
    }
    // 6: ordinals are 1..=len.
    if after
        .attempts
        .iter()
        .enumerate()
        .any(|(i, a)| a.n != i as u32 + 1)
    {
        return Err("attempt ordinals have a gap".into());
    }
    Ok(())
}

fn seeds(default: u64) -> Vec<u64> {
    if let Ok(seed) = std::env::var("MODEL_SEED") {
        return vec![seed.parse().expect("MODEL_SEED is a number")];
    }
    let scale: u64 = std::env::var("MODEL_SCALE")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    let from: u64 = std::env::var("MODEL_FROM")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    (from..from + default * scale).collect()
}

/// Runs `count` seeded histories against stores from `open`.
async fn run<F, Fut, G>(name: &str, default: u64, open: F)
where
    F: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = (Arc<dyn JobStore>, G)>,
{
    run_with(name, default, open, None).await;
}

/// Like [`run`], every transition through a store that fails a fifth of them — before the
/// write, or after it with the reply lost — and retried until it answers.
async fn run_faulty<F, Fut, G>(name: &str, default: u64, open: F)
where
    F: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = (Arc<dyn JobStore>, G)>,
{
    run_with(name, default, open, Some(200)).await;
}

async fn run_with<F, Fut, G>(name: &str, default: u64, open: F, faults: Option<u32>)
where
    F: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = (Arc<dyn JobStore>, G)>,
{
    // Real run time, for the report: deliberately not the paused clock.
    #[allow(clippy::disallowed_methods)]
    let started = std::time::Instant::now();
    let seeds = seeds(default);
    let mut steps = 0;
    // Counted as each history ends: a history's store (its connections, on PostgreSQL)
    // closes with it.
    let total = faults::Fired::default();
    let mut races = 0;
    for &seed in &seeds {
        let (store, _guard) = open(seed).await;
        let faulty =
            faults.map(|per_mille| faults::Faulty::seeded(store.clone(), seed, per_mille, false));
        let store = match &faulty {
            None => store,
            Some(faulty) => faulty.clone() as Arc<dyn JobStore>,
        };
        let mut rng = fastrand::Rng::with_seed(seed);
        let ops = generate(&mut rng);
        let mut runner = Runner {
            store,
            model: Model::default(),
            ids: Vec::new(),
            histories: HashMap::new(),
            now: SystemTime::UNIX_EPOCH + Duration::from_secs(2_000_000_000),
            log: Vec::new(),
        };
        for op in &ops {
            races += usize::from(matches!(op, Op::Race(..)));
            runner.log.push(format!("{op:?}"));
            if let Err(why) = runner.step(op).await {
                runner.fail(seed, name, why);
            }
            steps += 1;
        }
        if let Some(faulty) = faulty {
            use std::sync::atomic::Ordering::Relaxed;
            let fired = &faulty.fired;
            total
                .error_before
                .fetch_add(fired.error_before.load(Relaxed), Relaxed);
            total
                .error_after
                .fetch_add(fired.error_after.load(Relaxed), Relaxed);
            total.delay.fetch_add(fired.delay.load(Relaxed), Relaxed);
        }
    }
    println!(
        "model {name}: {} histories, {steps} steps ({races} of them two transitions at once), {:.1?}",
        seeds.len(),
        started.elapsed()
    );
    if faults.is_some() {
        println!("model {name}: {}", faults::report(&total));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histories_on_the_memory_store() {
    run("memory", 3000, |_| async {
        let store: Arc<dyn JobStore> = Arc::new(idemgate::store::memory::MemoryStore::new(POLICY));
        (store, ())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histories_on_a_memory_store_that_loses_replies() {
    run_faulty("memory, faulty", 1500, |_| async {
        let store: Arc<dyn JobStore> = Arc::new(idemgate::store::memory::MemoryStore::new(POLICY));
        (store, ())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histories_on_a_redis_that_loses_replies() {
    let server = RedisServer::start().await;
    run_faulty("redis, faulty", 150, |seed| {
        let url = server.url();
        async move {
            let store = idemgate::store::redis::RedisStore::open(
                &redis_config(vec![url], false, seed + 1_000_000),
                POLICY,
            )
            .await
            .unwrap();
            (Arc::new(store) as Arc<dyn JobStore>, ())
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histories_on_the_embedded_store() {
    run("embedded", 60, |_| async {
        let dir = tempfile::tempdir().unwrap();
        let store =
            idemgate::store::embedded::EmbeddedStore::open(&dir.path().join("model.db"), POLICY)
                .unwrap();
        (Arc::new(store) as Arc<dyn JobStore>, dir)
    })
    .await;
}

fn redis_config(urls: Vec<String>, cluster: bool, seed: u64) -> StoreConfig {
    StoreConfig {
        kind: StoreKind::Redis,
        path: Default::default(),
        urls,
        cluster,
        // A prefix per history: histories never see each other's keys.
        key_prefix: format!("model-{seed}"),
        pool_size: None,
        wait_replicas: 0,
        op_timeout: std::time::Duration::from_secs(2),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histories_on_redis() {
    let server = RedisServer::start().await;
    let url = server.url();
    run("redis", 300, |seed| {
        let url = url.clone();
        async move {
            let store = idemgate::store::redis::RedisStore::open(
                &redis_config(vec![url], false, seed),
                POLICY,
            )
            .await
            .unwrap();
            (Arc::new(store) as Arc<dyn JobStore>, ())
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histories_on_a_redis_cluster() {
    let cluster = RedisCluster::start().await;
    let urls = cluster.urls();
    run("redis-cluster", 100, |seed| {
        let urls = urls.clone();
        async move {
            let store =
                idemgate::store::redis::RedisStore::open(&redis_config(urls, true, seed), POLICY)
                    .await
                    .unwrap();
            (Arc::new(store) as Arc<dyn JobStore>, ())
        }
    })
    .await;
}

/// A fresh database per history, on the test binary's own PostgreSQL server.
async fn postgres_store() -> (Arc<dyn JobStore>, ()) {
    let url = common::pg_server::shared().database().await;
    let store = idemgate::store::postgres::PostgresStore::open(
        &common::pg_server::store_config(&url, 4),
        POLICY,
    )
    .await
    .unwrap();
    (Arc::new(store) as Arc<dyn JobStore>, ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histories_on_postgres() {
    run("postgres", 60, |_| postgres_store()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histories_on_a_postgres_that_loses_replies() {
    run_faulty("postgres, faulty", 40, |_| postgres_store()).await;
}

/// An independent reference of SPEC §2, written as the spec states it rather than as
/// `JobRecord::apply` computes it: from a job as it was and one transition, the job state,
/// version, winner and attempt states that must follow. A transition that does not apply
/// (or was applied before) changes nothing.
mod reference {
    use idemgate::job::{AttemptState as A, Failure, JobRecord, JobState as J, Transition as T};

    #[derive(Debug, PartialEq, Eq)]
    pub(crate) struct Expected {
        pub(crate) state: J,
        pub(crate) version: u64,
        pub(crate) completed_by: Option<u32>,
        pub(crate) attempts: Vec<A>,
    }

    fn live(a: A) -> bool {
        matches!(a, A::Started | A::Unknown)
    }

    pub(crate) fn after(before: &JobRecord, transition: &T) -> Expected {
        let job = &before.job;
        let mut e = Expected {
            state: job.state,
            version: job.version,
            completed_by: job.completed_by,
            attempts: before.attempts.iter().map(|a| a.state).collect(),
        };
        let at = |n: u32| before.attempts.iter().position(|a| a.n == n);
        let read = |n: u32| {
            before
                .attempts
                .iter()
                .find(|a| a.n == n)
                .map(|a| a.read_version)
        };
        let open = matches!(job.state, J::InProgress | J::Unknown);
        // The compare-and-swap, as SPEC §2 writes it.
        let may_win = |n: u32| read(n) == Some(job.version) && job.completed_by.is_none() && open;
        match transition {
            T::StartAttempt { version, n, .. } => {
                let next = before.attempts.last().map_or(1, |a| a.n + 1);
                if at(*n).is_none()
                    && job.state == J::InProgress
                    && *version == job.version
                    && *n == next
                {
                    e.attempts.push(A::Started);
                }
            }
            T::Complete { n, .. } => {
                if let Some(i) = at(*n).filter(|&i| live(e.attempts[i])) {
                    if may_win(*n) {
                        e.attempts[i] = A::Succeeded;
                        e.state = J::Succeeded;
                        e.version += 1;
                        e.completed_by = Some(*n);
                    } else {
                        e.attempts[i] = A::LostRace;
                    }
                }
            }
            T::FailAttempt { n, kind, .. } => {
                if let Some(i) = at(*n).filter(|&i| live(e.attempts[i])) {
                    let was_unknown = e.attempts[i] == A::Unknown;
                    e.attempts[i] = match kind {
                        Failure::Failed => A::Failed,
                        Failure::ContractRejected => A::ContractRejected,
                    };
                    let others_live = e.attempts.iter().any(|&a| live(a));
                    if was_unknown
                        && job.state == J::Unknown
                        && read(*n) == Some(job.version)
                        && !others_live
                    {
                        e.state = J::Failed;
                        e.version += 1;
                    }
                }
            }
            T::AttemptUnknown { n, .. } => {
                if let Some(i) = at(*n).filter(|&i| e.attempts[i] == A::Started) {
                    e.attempts[i] = A::Unknown;
                }
            }
            T::MarkUnknown { version } | T::ExpireLease { version } => {
                if job.state == J::InProgress && *version == job.version {
                    e.state = J::Unknown;
                    for a in &mut e.attempts {
                        if *a == A::Started {
                            *a = A::Unknown;
                        }
                    }
                }
            }
            T::FailRound { version } => {
                if job.state == J::InProgress
                    && *version == job.version
                    && !e.attempts.iter().any(|&a| live(a))
                {
                    e.state = J::Failed;
                    e.version += 1;
                }
            }
            T::Cancel | T::CancelAt { .. } => {
                if !matches!(job.state, J::Succeeded | J::Failed | J::Cancelled) {
                    e.state = J::Cancelled;
                    e.version += 1;
                    e.completed_by = None;
                    for a in &mut e.attempts {
                        if live(*a) {
                            *a = A::Cancelled;
                        }
                    }
                }
            }
            T::Reopen { version, .. } => {
                if matches!(job.state, J::Failed | J::Cancelled) && *version == job.version {
                    e.state = J::InProgress;
                    e.version += 1;
                }
            }
            T::RenewLease { .. } => {}
            T::BeginStream { n } => {
                if let Some(i) = at(*n).filter(|&i| live(e.attempts[i])) {
                    if job.completed_by != Some(*n) {
                        if may_win(*n) {
                            e.completed_by = Some(*n);
                        } else {
                            e.attempts[i] = A::LostRace;
                        }
                    }
                }
            }
            T::EndStream { n, .. } | T::CutStream { n, .. } => {
                let holds_slot = job.completed_by == Some(*n) && open;
                if let Some(i) = at(*n).filter(|&i| live(e.attempts[i]) && holds_slot) {
                    if matches!(transition, T::EndStream { .. }) {
                        e.attempts[i] = A::Succeeded;
                        e.state = J::Succeeded;
                        e.version += 1;
                    } else {
                        e.attempts[i] = A::Failed;
                        e.completed_by = None;
                        if !e.attempts.iter().any(|&a| live(a)) {
                            e.state = J::Failed;
                            e.version += 1;
                        }
                    }
                }
            }
        }
        e
    }

    /// The store's job after the transition, as the reference expects it.
    pub(crate) fn check(
        before: &JobRecord,
        transition: &T,
        store: &JobRecord,
    ) -> Result<(), String> {
        let expected = after(before, transition);
        let got = Expected {
            state: store.job.state,
            version: store.job.version,
            completed_by: store.job.completed_by,
            attempts: store.attempts.iter().map(|a| a.state).collect(),
        };
        if got == expected {
            Ok(())
        } else {
            Err(format!(
                "{transition:?}: SPEC §2 expects {expected:?}, the store holds {got:?}"
            ))
        }
    }
}

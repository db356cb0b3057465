//! The embedded store's two threads: the writer, which turns each group of queued
//! operations into journal frames, syncs them and answers, and the checkpointer, which
//! brings the tables in the database file up to date with what the journal holds.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::{error, warn};

use super::journal::{Journal, Segment};
use super::overlay::Staged;
use super::{
    millis, Answer, Applied, Changes, Claim, ClaimKey, CommitStats, Shared, StoreError, EXPIRY,
};
use crate::job::{ClaimRule, ExpiryPolicy, JobId, JobRecord, Transition};

/// Most operations in one group.
const MAX_GROUP: usize = 512;
/// The smallest group after which the next one gathers: until the runtime's workers run
/// out of work (they queue every operation), at most twice…
const GATHER_FROM: usize = 4;
/// …this long per operation the group before carried, and at most [`GATHER_MAX`]; in a
/// runtime without the park hooks ([`crate::idle`]), for that long: 0.5 ms after a group of
/// 32. At 32 clients on one core (`benches/overhead.sh`), groups of ~17 operations gathered
/// for 0.5 ms answered 7 040–7 150 new jobs a second; gathered for 0.1 ms, groups of ~10,
/// 6 000–6 700; for 1 and 1.5 ms the writer waited on operations that were not coming
/// (6 600–7 000 and 5 300–5 900). The bound keeps a worker that never runs out of work (on
/// a runtime of several, one busy with other requests) from holding a small group the
/// whole millisecond.
const GATHER_PER_OPERATION: Duration = Duration::from_micros(15);
const GATHER_MAX: Duration = Duration::from_millis(1);
/// Most expired jobs one sweep operation deletes. A deletion is a lookup and a small frame,
/// so a batch adds well under a millisecond to the group it shares.
pub(super) const SWEEP_LIMIT: usize = 256;
/// A checkpoint is started once the active journal file holds this much…
const CHECKPOINT_BYTES: u64 = 8 << 20;
/// …or this long after the last one, if anything was written since. Each checkpoint is one
/// transaction on the tables: the longer apart, the more of a job's writes (its claim, its
/// settle) it folds into one, and the more page writes it shares between jobs; the overlay
/// holds what it has not taken yet.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);

/// One write, queued for the writer thread.
pub(super) enum Op {
    Claim {
        record: Box<JobRecord>,
        /// The record's, worked out already by the read that found no live job.
        key: ClaimKey,
        now: SystemTime,
        reply: oneshot::Sender<Result<Claim, StoreError>>,
    },
    Apply {
        id: JobId,
        transition: Transition,
        now: SystemTime,
        reply: oneshot::Sender<Result<Applied, StoreError>>,
    },
    /// One batch of a retention sweep, from after the expiry entry `from` (the one the
    /// batch before stopped at).
    Sweep {
        now: SystemTime,
        from: Option<Position>,
        reply: oneshot::Sender<Result<Swept, StoreError>>,
    },
    /// Answered once the tables hold every change made before it.
    Checkpoint {
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    /// Stops the writer as a crash would, between two groups: no last checkpoint, the
    /// journal left as it is.
    #[cfg(test)]
    Crash,
}

impl Op {
    fn fail(self, e: StoreError) {
        match self {
            Self::Claim { reply, .. } => drop(reply.send(Err(e))),
            Self::Apply { reply, .. } => drop(reply.send(Err(e))),
            Self::Sweep { reply, .. } => drop(reply.send(Err(e))),
            Self::Checkpoint { reply } => drop(reply.send(Err(e))),
            #[cfg(test)]
            Self::Crash => {}
        }
    }
}

/// A change as the journal holds it: a job's whole new record (its answer included), or
/// its deletion. Each frame sets what it names outright, so frames applied again over
/// tables that already hold them leave the same tables.
#[derive(Deserialize)]
pub(super) enum Change {
    Put(Box<JobRecord>),
    Delete(JobId),
}

/// [`Change`] as it is written, borrowing the record: the same encoding.
#[derive(Serialize)]
enum ChangeRef<'a> {
    Put(&'a JobRecord),
    Delete(&'a str),
}

/// An entry of the expiry index: (expires_at in ms, job id).
pub(super) type Position = (u64, JobId);

/// What one batch of a sweep did.
#[derive(Debug)]
pub(super) struct Swept {
    pub(super) removed: usize,
    /// Where the next batch starts; `None` once nothing more is due.
    pub(super) next: Option<Position>,
}

/// An operation's result, held until the group's frames are synced.
enum Done {
    Claim(
        oneshot::Sender<Result<Claim, StoreError>>,
        Result<Claim, StoreError>,
    ),
    Apply(
        oneshot::Sender<Result<Applied, StoreError>>,
        Result<Applied, StoreError>,
    ),
    Sweep(
        oneshot::Sender<Result<Swept, StoreError>>,
        Result<Swept, StoreError>,
    ),
}

impl Done {
    fn send(self) {
        match self {
            Self::Claim(reply, r) => drop(reply.send(r)),
            Self::Apply(reply, r) => drop(reply.send(r)),
            Self::Sweep(reply, r) => drop(reply.send(r)),
        }
    }

    /// The group was not made durable: every operation in it fails as a whole.
    fn fail(self, e: StoreError) {
        match self {
            Self::Claim(reply, _) => drop(reply.send(Err(e))),
            Self::Apply(reply, _) => drop(reply.send(Err(e))),
            Self::Sweep(reply, _) => drop(reply.send(Err(e))),
        }
    }
}

/// A synced group's answers and the jobs whose waiters it wakes, handed to the runtime as
/// one task. Sent from the writer thread, each answer woke the runtime's worker on its own:
/// on a gateway pinned to one core the woken worker ran at once, handled that one answer and
/// slept again before the writer sent the next — an `eventfd` write and two context switches
/// per operation. Sent from a task, the answers wake their tasks inside the runtime, and the
/// group costs one wake-up. Whatever is not delivered when dropped (the task never ran: the
/// runtime had shut down) is delivered by the drop, from whichever thread drops it.
struct Delivery {
    done: Vec<Done>,
    touched: Vec<JobId>,
    changed: Arc<Changes>,
}

impl Drop for Delivery {
    fn drop(&mut self) {
        for reply in self.done.drain(..) {
            reply.send();
        }
        for id in self.touched.drain(..) {
            self.changed.of(&id).notify_waiters();
        }
    }
}

/// One group being built: its changes, seen by the operations after them in the group but
/// by no one else until they are synced.
struct Group<'a> {
    shared: &'a Shared,
    journal: &'a mut Journal,
    staged: Staged,
    /// Jobs whose waiters are woken once the group is durable.
    touched: Vec<JobId>,
}

impl Group<'_> {
    fn job(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        self.latest(id, Answer::With)
    }

    /// The job as the group sees it: its own change, else the overlay's or the file's.
    fn latest(&self, id: &str, answer: Answer) -> Result<Option<JobRecord>, StoreError> {
        match self.staged.jobs.get(id) {
            Some(version) => Ok(version.as_deref().cloned()),
            None => self.shared.latest(id, answer),
        }
    }

    /// The job holding a claim key, as the group sees it.
    fn holder(&self, key: &ClaimKey) -> Result<Option<JobRecord>, StoreError> {
        match self.staged.claims.get(&key.bytes) {
            Some(Some(id)) => self.job(id),
            Some(None) => Ok(None),
            None => self.shared.holder_with(key, |id| self.job(id)),
        }
    }

    fn put(&mut self, record: JobRecord) {
        self.journal
            .frame(|buf| super::encode_into(&ChangeRef::Put(&record), buf));
        self.touched.push(record.job.id.clone());
        self.staged
            .jobs
            .insert(record.job.id.clone(), Some(Arc::new(record)));
    }

    fn delete(&mut self, record: &JobRecord) -> Result<(), StoreError> {
        let id = record.job.id.as_str();
        let key = ClaimKey::of(record);
        let held = match self.staged.claims.get(&key.bytes) {
            Some(holder) => holder.as_deref() == Some(id),
            None => self.shared.holds(&key, id),
        };
        if held {
            self.staged.claims.insert(key.bytes, None);
        }
        self.journal
            .frame(|buf| super::encode_into(&ChangeRef::Delete(id), buf));
        self.staged.jobs.insert(id.to_owned(), None);
        self.touched.push(id.to_owned());
        Ok(())
    }

    fn claim(
        &mut self,
        record: JobRecord,
        key: ClaimKey,
        now: SystemTime,
    ) -> Result<Claim, StoreError> {
        let found = self.holder(&key)?;
        match (JobRecord::claim_rule(found.as_ref(), now), found) {
            (ClaimRule::Keep, Some(found)) => return Ok(Claim::Existing(found)),
            (ClaimRule::Replace, Some(expired)) => self.delete(&expired)?,
            _ => {}
        }
        self.staged
            .claims
            .insert(key.bytes, Some(record.job.id.clone()));
        self.put(record.clone());
        Ok(Claim::Created(record))
    }

    fn apply(
        &mut self,
        id: &str,
        transition: Transition,
        now: SystemTime,
        policy: &ExpiryPolicy,
    ) -> Result<Applied, StoreError> {
        let mut record = self
            .job(id)?
            .ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
        let outcome = record.apply(transition, now, policy);
        if outcome.is_ok() {
            self.put(record.clone());
        }
        Ok(Applied { outcome, record })
    }

    /// Deletes up to [`SWEEP_LIMIT`] jobs due at `now`, walking the file's expiry index from
    /// after `from`. A job the overlay changed is judged by its latest version: one
    /// deleted already (its entry stays in the file until the checkpoint), or given a later
    /// expiry, is passed over, and the next batch starts after it.
    fn sweep(&mut self, now: SystemTime, from: Option<Position>) -> Result<Swept, StoreError> {
        use std::ops::Bound::{Excluded, Unbounded};
        let shared = self.shared;
        let expiry = shared.table(EXPIRY)?;
        let start = match &from {
            Some((at, id)) => Excluded((*at, id.as_str())),
            None => Unbounded,
        };
        let range = expiry
            .range::<(u64, &str)>((start, Excluded((millis(now), ""))))
            .map_err(|e| shared.unavailable(e))?;
        let mut removed = 0;
        for entry in range {
            let (key, _) = entry.map_err(|e| shared.unavailable(e))?;
            let (at, id) = key.value();
            // A deletion needs no answer.
            if let Some(record) = self.latest(id, Answer::Without)? {
                if record.is_expired(now) {
                    self.delete(&record)?;
                    removed += 1;
                    if removed == SWEEP_LIMIT {
                        let next = Some((at, id.to_owned()));
                        return Ok(Swept { removed, next });
                    }
                }
            }
        }
        Ok(Swept {
            removed,
            next: None,
        })
    }

    fn run(&mut self, op: Op, policy: &ExpiryPolicy) -> Done {
        match op {
            Op::Claim {
                record,
                key,
                now,
                reply,
            } => Done::Claim(reply, self.claim(*record, key, now)),
            Op::Apply {
                id,
                transition,
                now,
                reply,
            } => Done::Apply(reply, self.apply(&id, transition, now, policy)),
            Op::Sweep { now, from, reply } => Done::Sweep(reply, self.sweep(now, from)),
            Op::Checkpoint { .. } => unreachable!("checkpoints are not part of a group"),
            #[cfg(test)]
            Op::Crash => unreachable!("a crash is not part of a group"),
        }
    }
}

/// What the writer hands the checkpointer.
pub(super) struct Request {
    /// The journal file the writer moved away from, and what to reset it to once the
    /// tables hold its frames.
    retire: Option<(Arc<Segment>, u64)>,
    replies: Vec<oneshot::Sender<Result<(), StoreError>>>,
}

/// The writer thread's state beyond the queue.
pub(super) struct Writer {
    pub(super) shared: Arc<Shared>,
    pub(super) journal: Journal,
    pub(super) changed: Arc<Changes>,
    pub(super) policy: ExpiryPolicy,
    pub(super) stats: Arc<CommitStats>,
    /// The runtime the store was opened in, where a group's answers are delivered.
    pub(super) runtime: Option<tokio::runtime::Handle>,
}

impl Writer {
    /// Runs until the queue closes, then checkpoints everything and empties the journal,
    /// so a cleanly closed store is whole in its database file.
    pub(super) fn run(mut self, mut queue: mpsc::UnboundedReceiver<Op>) {
        let (requests, incoming) = std::sync::mpsc::channel::<Request>();
        // Set while a retired journal file waits for its checkpoint: the writer cannot move
        // back to it before it is reset.
        let busy = Arc::new(AtomicBool::new(false));
        let checkpointer = {
            let shared = self.shared.clone();
            let busy = busy.clone();
            std::thread::Builder::new()
                .name("idemgate-ckpt".into())
                .spawn(move || checkpoint_loop(&shared, incoming, &busy))
        };
        let checkpointer = match checkpointer {
            Ok(thread) => thread,
            Err(e) => {
                error!(error = %e, "embedded store: cannot start its checkpointer");
                let e = self.shared.unavailable("the checkpointer did not start");
                while let Some(op) = queue.blocking_recv() {
                    op.fail(e.clone());
                }
                return;
            }
        };
        let mut last_checkpoint = Instant::now();
        let mut ops = Vec::with_capacity(MAX_GROUP);
        let mut last_group = 0;
        while let Some(first) = queue.blocking_recv() {
            ops.push(first);
            // Under load, let the group fill before its sync: a sync costs the same whatever
            // it carries (tens of µs of the kernel's CPU, ~100 µs in all, for 4 KiB as for
            // 64), and woken at once the writer takes the one or two operations that woke
            // it. The workers queue every operation: once they have nothing left to do,
            // nothing more is coming before the sync answers. A lone request, or a few,
            // never wait.
            if last_group >= GATHER_FROM {
                let wait = GATHER_PER_OPERATION * last_group.min(MAX_GROUP) as u32;
                if !crate::idle::wait_for_idle((wait * 2).min(GATHER_MAX)) {
                    std::thread::sleep(wait.min(GATHER_MAX));
                }
            }
            while ops.len() < MAX_GROUP {
                match queue.try_recv() {
                    Ok(op) => ops.push(op),
                    Err(_) => break,
                }
            }
            #[cfg(test)]
            if let Some(at) = ops.iter().position(|op| matches!(op, Op::Crash)) {
                ops.truncate(at);
                let mut replies = Vec::new();
                self.commit_group(&mut ops, &mut replies);
                drop(requests);
                let _ = checkpointer.join();
                return;
            }
            last_group = ops.len();
            let mut replies = Vec::new();
            self.commit_group(&mut ops, &mut replies);
            let written = self.journal.active_len() > 0;
            let waited = last_checkpoint.elapsed() >= CHECKPOINT_EVERY;
            // Writes refused for a full overlay write nothing: its checkpoint is asked for
            // all the same.
            let full = self.shared.overlay().len() >= self.shared.overlay_limit;
            let due =
                self.journal.active_len() >= CHECKPOINT_BYTES || ((written || full) && waited);
            let idle = !busy.load(Ordering::Acquire);
            let retire = (idle && written && (due || !replies.is_empty())).then(|| {
                busy.store(true, Ordering::Release);
                self.journal.rotate()
            });
            // A checkpoint still running (or failed, to be retried) is asked again at most
            // once per interval, however much is written meanwhile.
            if retire.is_some() || !replies.is_empty() || (due && waited) {
                last_checkpoint = Instant::now();
                let _ = requests.send(Request { retire, replies });
            }
        }
        // Closed: what is published goes to the tables, then the journal is emptied.
        let (reply, done) = oneshot::channel();
        let _ = requests.send(Request {
            retire: None,
            replies: vec![reply],
        });
        drop(requests);
        let _ = checkpointer.join();
        match done.blocking_recv() {
            Ok(Ok(())) => {
                if let Err(e) = self.journal.reset_all() {
                    warn!(error = %e, "embedded store: journal not emptied at close; it is replayed at the next open");
                }
            }
            _ => warn!(
                "embedded store: last checkpoint failed; the journal is replayed at the next open"
            ),
        }
    }

    /// Runs `ops` as one group, syncs its frames, makes its changes visible and answers.
    /// Checkpoint requests among them are handed back in `replies`.
    fn commit_group(
        &mut self,
        ops: &mut Vec<Op>,
        replies: &mut Vec<oneshot::Sender<Result<(), StoreError>>>,
    ) {
        let held = self.shared.overlay().len();
        if held >= self.shared.overlay_limit {
            let e = self.shared.unavailable(format!(
                "its checkpoints are failing: {held} jobs wait for the database file, and \
                 writes resume once a checkpoint succeeds"
            ));
            for op in ops.drain(..) {
                match op {
                    Op::Checkpoint { reply } => replies.push(reply),
                    op => op.fail(e.clone()),
                }
            }
            return;
        }
        let count = ops.len();
        let mut group = Group {
            shared: &self.shared,
            journal: &mut self.journal,
            staged: Staged::default(),
            touched: Vec::new(),
        };
        let mut done = Vec::with_capacity(count);
        for op in ops.drain(..) {
            match op {
                Op::Checkpoint { reply } => replies.push(reply),
                op => done.push(group.run(op, &self.policy)),
            }
        }
        let Group {
            staged,
            mut touched,
            ..
        } = group;
        // A group that claims and starts a job wakes its waiters once.
        touched.sort_unstable();
        touched.dedup();
        match self.journal.commit() {
            Ok(()) => {
                if !staged.is_empty() {
                    self.shared.overlay().publish(staged);
                }
                use std::sync::atomic::Ordering::Relaxed;
                self.stats.commits.fetch_add(1, Relaxed);
                self.stats.operations.fetch_add(done.len() as u64, Relaxed);
                let delivery = Delivery {
                    done,
                    touched,
                    changed: self.changed.clone(),
                };
                match &self.runtime {
                    // One answer wakes the runtime once either way.
                    Some(runtime) if delivery.done.len() > 1 => {
                        drop(runtime.spawn(async move { drop(delivery) }));
                    }
                    _ => drop(delivery),
                }
            }
            Err(e) => {
                error!(error = %e, "embedded store: journal write failed");
                let e = self.shared.unavailable(e);
                for reply in done {
                    reply.fail(e.clone());
                }
            }
        }
    }
}

/// The checkpointer thread: one checkpoint per request, in order.
fn checkpoint_loop(
    shared: &Shared,
    requests: std::sync::mpsc::Receiver<Request>,
    busy: &AtomicBool,
) {
    // A retired file whose checkpoint failed: reset after the next one that succeeds.
    let mut pending: Option<(Arc<Segment>, u64)> = None;
    for request in requests {
        if let Some(retire) = request.retire {
            pending = Some(retire);
        }
        let result = shared.checkpoint();
        if let Err(e) = &result {
            error!(error = %e, "embedded store: checkpoint failed; the journal keeps its changes");
        } else if let Some((segment, start)) = pending.take() {
            match segment.reset(start) {
                Ok(()) => busy.store(false, Ordering::Release),
                Err(e) => {
                    error!(error = %e, "embedded store: journal file not reset; retried at the next checkpoint");
                    pending = Some((segment, start));
                }
            }
        }
        for reply in request.replies {
            let _ = reply.send(result.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn swept(n: usize) -> (Done, oneshot::Receiver<Result<Swept, StoreError>>) {
        let (reply, answer) = oneshot::channel();
        let result = Ok(Swept {
            removed: n,
            next: None,
        });
        (Done::Sweep(reply, result), answer)
    }

    fn removed(answer: oneshot::Receiver<Result<Swept, StoreError>>) -> usize {
        answer.blocking_recv().unwrap().unwrap().removed
    }

    /// A delivery spawned on a runtime that has shut down is never run: its drop answers.
    #[test]
    fn a_delivery_the_runtime_never_runs_still_answers() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let handle = runtime.handle().clone();
        drop(runtime);
        let (first, first_answer) = swept(1);
        let (second, second_answer) = swept(2);
        let delivery = Delivery {
            done: vec![first, second],
            touched: vec!["job".into()],
            changed: Arc::new(Changes::new()),
        };
        drop(handle.spawn(async move { drop(delivery) }));
        assert_eq!(removed(first_answer), 1);
        assert_eq!(removed(second_answer), 2);
    }

    /// On a running runtime the answers are sent from its task, and a waiter of a touched
    /// job is woken after them.
    #[test]
    fn a_delivery_answers_and_wakes_from_a_task() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let changed = Arc::new(Changes::new());
        let (first, first_answer) = swept(1);
        let (second, second_answer) = swept(2);
        let delivery = Delivery {
            done: vec![first, second],
            touched: vec!["job".into()],
            changed: changed.clone(),
        };
        let handle = runtime.handle().clone();
        runtime.block_on(async move {
            let woken = changed.of("job").notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            // From another thread, as the writer spawns it.
            std::thread::spawn(move || drop(handle.spawn(async move { drop(delivery) })))
                .join()
                .unwrap();
            let bound = std::time::Duration::from_secs(10);
            tokio::time::timeout(bound, woken).await.expect("woken");
            assert_eq!(first_answer.await.unwrap().unwrap().removed, 1);
            assert_eq!(second_answer.await.unwrap().unwrap().removed, 2);
        });
    }
}

//! Whether the runtime's workers have run out of work, for a thread beside the runtime that
//! batches what the workers hand it: the embedded store's writer syncs a group of
//! operations once the workers that queue them have nothing left to do, since until then
//! more may come for the same sync.
//!
//! The binary installs the runtime's park hooks with [`install`]. Without them (a test's
//! runtime, a library user's), [`wait_for_idle`] says so at once and its caller falls back
//! to waiting a fixed time.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// Set once the hooks are installed.
static HOOKED: AtomicBool = AtomicBool::new(false);
/// Worker threads of the hooked runtime; until it is built, more than any count of parks.
static WORKERS: AtomicUsize = AtomicUsize::new(usize::MAX);
/// Workers parked right now.
static PARKED: AtomicUsize = AtomicUsize::new(0);
/// Threads in [`wait_for_idle`]: a park looks for them only when there are any, so a
/// runtime whose store has no writer pays one atomic load per park.
static WAITERS: AtomicUsize = AtomicUsize::new(0);
/// Counts the times every worker was parked while someone waited.
static IDLE: Mutex<u64> = Mutex::new(0);
static WOKEN: Condvar = Condvar::new();

/// Installs the park hooks on a runtime's builder, with `also` run first before each park
/// (the log's batch). They count once [`started`] has been told the built runtime.
pub fn install(
    builder: &mut tokio::runtime::Builder,
    also: Option<fn()>,
) -> &mut tokio::runtime::Builder {
    builder
        .on_thread_park(move || {
            if let Some(also) = also {
                also();
            }
            before_park();
        })
        .on_thread_unpark(after_unpark)
}

/// The runtime built with the hooks: its worker count, as tokio settled it (1 for a
/// current-thread runtime), is how many parked workers make it idle.
pub fn started(runtime: &tokio::runtime::Runtime) {
    WORKERS.store(runtime.metrics().num_workers().max(1), SeqCst);
    HOOKED.store(true, SeqCst);
}

fn before_park() {
    let parked = PARKED.fetch_add(1, SeqCst) + 1;
    // SeqCst on both sides: either this park sees the waiter, or the waiter sees it parked.
    if parked >= WORKERS.load(SeqCst) && WAITERS.load(SeqCst) > 0 {
        *IDLE.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        WOKEN.notify_all();
    }
}

fn after_unpark() {
    PARKED.fetch_sub(1, SeqCst);
}

fn all_parked() -> bool {
    PARKED.load(SeqCst) >= WORKERS.load(SeqCst)
}

/// Waits until every worker is parked (at once if they are), at most `most`. `false`, at
/// once, when no runtime has the hooks.
pub fn wait_for_idle(most: Duration) -> bool {
    if !HOOKED.load(SeqCst) {
        return false;
    }
    let deadline = Instant::now() + most;
    WAITERS.fetch_add(1, SeqCst);
    let mut idle = IDLE.lock().unwrap_or_else(PoisonError::into_inner);
    let seen = *idle;
    while !all_parked() && *idle == seen {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        idle = WOKEN
            .wait_timeout(idle, left)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
    drop(idle);
    WAITERS.fetch_sub(1, SeqCst);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test for the whole module: its state is the process's.
    #[test]
    fn a_waiter_returns_once_the_workers_run_out_of_work() {
        const LONG: Duration = Duration::from_secs(60);
        assert!(!wait_for_idle(LONG), "no runtime has the hooks: at once");
        let mut builder = tokio::runtime::Builder::new_current_thread();
        let runtime = install(&mut builder, None).enable_all().build().unwrap();
        started(&runtime);
        let (done, mut returned) = tokio::sync::oneshot::channel();
        let waiter = std::thread::spawn(move || {
            let started = Instant::now();
            assert!(wait_for_idle(LONG));
            let _ = done.send(started.elapsed());
        });
        let waited = runtime.block_on(async move {
            // Busy, never parking: the waiter keeps waiting.
            let spun = Instant::now();
            while WAITERS.load(SeqCst) == 0 || spun.elapsed() < Duration::from_millis(20) {
                assert!(spun.elapsed() < LONG, "the waiter never waited");
                std::hint::spin_loop();
            }
            assert!(
                returned.try_recv().is_err(),
                "returned while the worker was busy"
            );
            // Nothing to do but wait for it: the worker parks, and the waiter returns.
            tokio::time::timeout(LONG / 2, returned)
                .await
                .expect("the waiter returns once the worker parks")
                .unwrap()
        });
        waiter.join().unwrap();
        assert!(waited < LONG / 2, "{waited:?}");
    }
}

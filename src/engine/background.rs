//! The engine's background loops: the lease sweep that turns crash orphans `unknown`, and
//! the probes of open breakers. Each holds the engine weakly and ends when it is dropped or
//! stopped.

use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, warn};

use super::Engine;
use crate::config::Route;
use crate::job::Transition;
use crate::store::Applied;

/// While provider `index`'s breaker is open, sends `route`'s probe to it every cool-down: a
/// pass closes the breaker, so a recovered provider is back in use within about one
/// cool-down of its recovery without real traffic paying for the test; a failure re-opens
/// it with a doubled cool-down. Ends when the engine is dropped or stopped.
pub(super) async fn probe_open_breaker(
    engine: std::sync::Weak<Engine>,
    index: usize,
    route: Arc<Route>,
) {
    loop {
        let Some(strong) = engine.upgrade() else {
            return;
        };
        let Some(at) = strong.breakers.due(index) else {
            // Closed: wait for a breaker to open (re-checking now and then).
            let opened = strong.breakers.opened();
            let _ = tokio::time::timeout(Duration::from_secs(1), opened).await;
            continue;
        };
        drop(strong);
        tokio::time::sleep_until(at).await;
        let Some(engine) = engine.upgrade() else {
            return;
        };
        if engine.breakers.due(index) != Some(at) {
            continue;
        }
        let problem =
            crate::probe::probe_provider(&engine.config, &engine.upstream, &route, index).await;
        debug!(provider = %engine.config.provider(index).name, ?problem, "probed an open breaker");
        engine.breakers.record_probe(index, problem);
    }
}

/// The lease sweep (SPEC §4): jobs whose gateway died mid-round are moved to `unknown` by the
/// next request that sees them — and by this sweep when none comes, within `lease` + 10 s,
/// so operators see crash orphans in `GET /jobs?state=unknown` and the gauge. Ends when the
/// engine is dropped or stopped.
pub(super) async fn sweep_leases(engine: std::sync::Weak<Engine>) {
    let every = match engine.upgrade() {
        Some(engine) => (engine.config.idempotency.lease / 2).min(Duration::from_secs(5)),
        None => return,
    };
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(engine) = engine.upgrade() else {
            return;
        };
        let lapsed = match engine.store.lapsed_leases(crate::clock::now(), 100).await {
            Ok(lapsed) => lapsed,
            Err(e) => {
                warn!(error = %e, "lease sweep: cannot list in-progress jobs");
                continue;
            }
        };
        for (id, version) in lapsed {
            // A job of this very gateway is renewed by its round: never expired from here.
            if engine.lock_rounds().contains_key(&id) {
                continue;
            }
            match engine.apply(&id, Transition::ExpireLease { version }).await {
                Ok(Applied { outcome: Ok(_), .. }) => {
                    engine.metrics.lease_expired();
                    warn!(job_id = %id, "job's lease lapsed (its gateway stopped); the sweep marked it unknown");
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(job_id = %id, error = %e, "lease sweep: cannot mark the job unknown")
                }
            }
        }
    }
}

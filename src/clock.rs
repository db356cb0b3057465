//! The gateway's clock: wall time that advances with tokio's clock.
//!
//! Leases, expiry and attempt timestamps are wall-clock times, because they are stored and
//! compared by other gateways. Reading them through tokio's monotonic clock, anchored to the
//! wall clock once, keeps them immune to wall-clock jumps and lets tests and simulations
//! drive them with tokio's paused time, deterministically.

use std::sync::OnceLock;
use std::time::SystemTime;

use tokio::time::Instant;

static ANCHOR: OnceLock<(SystemTime, Instant)> = OnceLock::new();

/// Now, as wall-clock time.
// The one read of the system's wall clock: the anchor every later reading is offset from.
#[allow(clippy::disallowed_methods)]
pub fn now() -> SystemTime {
    let (wall, monotonic) = *ANCHOR.get_or_init(|| (SystemTime::now(), Instant::now()));
    wall + Instant::now().saturating_duration_since(monotonic)
}

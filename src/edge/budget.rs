//! `max_buffered_body_bytes`: one budget for the request bodies being read by all
//! connections together, so a crowd of clients that each send most of a large body and then
//! stall cannot take the process's memory with them (SPEC §11).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Debug)]
pub struct BodyBudget {
    limit: usize,
    used: AtomicUsize,
}

impl BodyBudget {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicUsize::new(0),
        })
    }

    /// Bytes held right now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// An empty reservation that grows as a body is read.
    pub fn reservation(self: &Arc<Self>) -> Reservation {
        Reservation {
            budget: self.clone(),
            held: 0,
        }
    }

    fn take(&self, bytes: usize) -> bool {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let Some(next) = used.checked_add(bytes).filter(|n| *n <= self.limit) else {
                return false;
            };
            match self
                .used
                .compare_exchange_weak(used, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(now) => used = now,
            }
        }
    }
}

/// Bytes of one request body held against the budget; given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<BodyBudget>,
    held: usize,
}

impl Reservation {
    /// Holds `total` bytes in all (never less than already held); `false` when the budget
    /// cannot cover them, and then nothing more is held.
    pub fn grow_to(&mut self, total: usize) -> bool {
        if total <= self.held {
            return true;
        }
        if !self.budget.take(total - self.held) {
            return false;
        }
        self.held = total;
        true
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.held, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_share_one_limit_and_give_it_back() {
        let budget = BodyBudget::new(100);
        let mut a = budget.reservation();
        let mut b = budget.reservation();
        assert!(a.grow_to(60));
        assert!(!b.grow_to(41));
        assert!(b.grow_to(40));
        assert_eq!(budget.used(), 100);
        drop(a);
        assert_eq!(budget.used(), 40);
        assert!(b.grow_to(100));
        drop(b);
        assert_eq!(budget.used(), 0);
    }
}

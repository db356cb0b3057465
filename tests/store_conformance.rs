//! The store conformance suite, run against every store.

mod conformance;

use std::sync::Arc;

use idemgate::store::memory::MemoryStore;
use idemgate::store::JobStore;

conformance_suite!(memory, || async {
    Arc::new(MemoryStore::new(conformance::POLICY)) as Arc<dyn JobStore>
});

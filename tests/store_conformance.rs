//! The store conformance suite, run against every store.

mod conformance;

use std::sync::Arc;

use idemgate::store::embedded::EmbeddedStore;
use idemgate::store::memory::MemoryStore;
use idemgate::store::JobStore;

conformance_suite!(memory, || async {
    let store = Arc::new(MemoryStore::new(conformance::POLICY)) as Arc<dyn JobStore>;
    (store, ())
});

conformance_suite!(embedded, || async {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(&dir.path().join("jobs.db"), conformance::POLICY).unwrap();
    (Arc::new(store) as Arc<dyn JobStore>, dir)
});

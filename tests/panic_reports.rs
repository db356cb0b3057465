//! Opening a damaged embedded file catches redb's panic without its report, and must not
//! silence the rest of the process meanwhile: a panic elsewhere is what an operator needs
//! to see. A binary of its own, as it sets the process's panic hook.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex, PoisonError};
use std::time::Duration;

use idemgate::job::{ExpiryPolicy, JobRecord};
use idemgate::store::embedded::EmbeddedStore;
use idemgate::store::JobStore;

static REPORTED: Mutex<Vec<String>> = Mutex::new(Vec::new());

const POLICY: ExpiryPolicy = ExpiryPolicy {
    retention: Duration::from_secs(60),
    late_result_window: Duration::from_secs(30),
};

/// A store file cut short, which redb's open asserts on.
fn damaged_file(dir: &std::path::Path) -> Vec<u8> {
    let path = dir.join("whole.db");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let store = EmbeddedStore::open(&path, POLICY).unwrap();
        let now = idemgate::clock::now();
        let record = JobRecord::new(
            idemgate::job::new_job_id("o", "k"),
            "o".into(),
            "k".into(),
            "fingerprint".into(),
            "chat".into(),
            now,
            now + Duration::from_secs(30),
            &POLICY,
        );
        store.claim(record, now).await.unwrap();
    });
    let whole = std::fs::read(&path).unwrap();
    whole[..whole.len().min(5000)].to_vec()
}

#[test]
fn opening_damaged_files_never_silences_another_threads_panics() {
    std::panic::set_hook(Box::new(|info| {
        REPORTED
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(info.to_string());
    }));
    let dir = tempfile::tempdir().unwrap();
    let damaged = damaged_file(dir.path());

    const OPENERS: usize = 3;
    let start = Arc::new(Barrier::new(OPENERS + 1));
    let opening = Arc::new(AtomicBool::new(true));
    let openers: Vec<_> = (0..OPENERS)
        .map(|n| {
            let path = dir.path().join(format!("damaged-{n}.db"));
            std::fs::write(&path, &damaged).unwrap();
            let start = start.clone();
            std::thread::spawn(move || {
                start.wait();
                for _ in 0..40 {
                    let error = EmbeddedStore::open(&path, POLICY).unwrap_err().to_string();
                    assert!(error.contains("truncated or damaged"), "{error}");
                }
            })
        })
        .collect();
    let panicker = {
        let (start, opening) = (start.clone(), opening.clone());
        std::thread::spawn(move || {
            start.wait();
            let mut panics = 0;
            // At least as long as the openers run, and a few times after.
            while opening.load(Ordering::SeqCst) || panics < 10 {
                let caught = std::panic::catch_unwind(|| panic!("elsewhere {panics}"));
                assert!(caught.is_err());
                panics += 1;
            }
            panics
        })
    };
    // Every opener is joined before the panicking thread is stopped, whether or not one
    // failed, so that a failure ends the test instead of leaving it spinning.
    let opened: Vec<_> = openers.into_iter().map(|opener| opener.join()).collect();
    opening.store(false, Ordering::SeqCst);
    let panics = panicker.join().unwrap();
    for result in opened {
        result.unwrap();
    }

    // Copied out: the assertions below report through the hook, which takes the lock.
    let reported = REPORTED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let elsewhere = reported.iter().filter(|m| m.contains("elsewhere")).count();
    assert_eq!(
        elsewhere, panics,
        "every panic of another thread is reported"
    );
    assert_eq!(
        reported.len(),
        panics,
        "the damaged files' panics are not: {:?}",
        reported.iter().find(|m| !m.contains("elsewhere"))
    );
}

//! The embedded store across restarts and crashes, with the real binary where a process
//! must die.

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Method;
use idemgate::job::{ExpiryPolicy, Transition};
use idemgate::store::embedded::EmbeddedStore;
use idemgate::store::JobStore;
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, ResponseTemplate};

const CHAT: &str = "/v1/chat/completions";

const POLICY: ExpiryPolicy = ExpiryPolicy {
    retention: Duration::from_secs(3600),
    late_result_window: Duration::from_secs(600),
};

fn route(provider: &str) -> String {
    format!(
        "[[providers]]\nname = \"primary\"\nbase_url = \"{provider}\"\n\
         [[routes]]\nname = \"chat\"\npath_prefix = \"/v1\"\nproviders = [\"primary\"]\n"
    )
}

/// Writes the config of a gateway spawned on `port` and `admin_port` (its admin token from
/// `ADMIN_TOKEN_ENV`), its store `jobs.db` in `dir`, with `idempotency` (a table's lines, or
/// nothing) and one route to `provider`; returns its path.
fn spawned_config(
    dir: &tempfile::TempDir,
    port: u16,
    admin_port: u16,
    idempotency: &str,
    provider: &str,
) -> std::path::PathBuf {
    let config = dir.path().join("idemgate.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin_port}\"\nadmin_token_env = \"{ADMIN_TOKEN_ENV}\"\n\
             [store]\npath = \"{}\"\n{idempotency}{}",
            dir.path().join("jobs.db").display(),
            route(provider)
        ),
    )
    .unwrap();
    config
}

/// A provider that answers every POST with the chat fixture.
async fn chat_provider() -> MockServer {
    let provider = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_raw(fixture("openai-chat-completion.json"), "application/json"),
        )
        .mount(&provider)
        .await;
    provider
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settled_job_replays_after_a_restart() {
    let provider = chat_provider().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data/jobs.db");

    let store = Arc::new(EmbeddedStore::open(&path, POLICY).unwrap());
    let gw = TestGateway::start_on(&route(&provider.uri()), store).await;
    let first = gw.post(CHAT, Some("k-restart"), chat_request()).await;
    assert_eq!(first.status, 200);
    bounded("shutdown", gw.running.shutdown()).await;

    let store =
        Arc::new(EmbeddedStore::open(&path, POLICY).expect("the file reopens after a clean stop"));
    let gw = TestGateway::start_on(&route(&provider.uri()), store).await;
    let replay = gw.post(CHAT, Some("k-restart"), chat_request()).await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.job_id(), first.job_id());
    assert_eq!(replay.body, first.body);
    assert_eq!(comparable_headers(&replay), comparable_headers(&first));
    assert_eq!(
        received(&provider).await,
        1,
        "no upstream call after the restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_file_is_refused_and_left_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.db");
    let garbage = b"this is not a database, and it must survive being opened".repeat(100);
    std::fs::write(&path, &garbage).unwrap();
    let error = EmbeddedStore::open(&path, POLICY).unwrap_err().to_string();
    assert!(error.contains(&path.display().to_string()), "{error}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        garbage,
        "nothing is overwritten"
    );

    // A path that cannot be a file (a directory stands in the way) is refused too.
    let error = EmbeddedStore::open(dir.path(), POLICY)
        .unwrap_err()
        .to_string();
    assert!(error.contains(&dir.path().display().to_string()), "{error}");
    // So is one under a regular file, where no directory can be made.
    let under_file = path.join("jobs.db");
    let error = EmbeddedStore::open(&under_file, POLICY)
        .unwrap_err()
        .to_string();
    assert!(error.contains("cannot create its directory"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_refuses_a_corrupt_file_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("jobs.db");
    std::fs::write(&db, b"garbage garbage garbage").unwrap();
    let config = dir.path().join("idemgate.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[store]\npath = \"{}\"\n{}",
            db.display(),
            route("http://127.0.0.1:9")
        ),
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(&db.display().to_string()), "{stderr}");
    assert_eq!(std::fs::read(&db).unwrap(), b"garbage garbage garbage");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_jobs_are_swept_in_the_background() {
    let dir = tempfile::tempdir().unwrap();
    let policy = ExpiryPolicy {
        retention: Duration::from_millis(200),
        late_result_window: Duration::from_millis(100),
    };
    let store = EmbeddedStore::open(&dir.path().join("jobs.db"), policy).unwrap();
    let now = idemgate::clock::now();
    let record = idemgate::job::JobRecord::new(
        "job_sweep".into(),
        "o".into(),
        "k".into(),
        "fp".into(),
        "chat".into(),
        now,
        now,
        &policy,
    );
    store.claim(record, now).await.unwrap();
    store
        .apply("job_sweep", Transition::Cancel, now)
        .await
        .unwrap()
        .outcome
        .unwrap();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while store.get("job_sweep").await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sweep never removed the job"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---- kill -9 ------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_killed_mid_attempt_comes_back_unknown_and_cancel_lets_a_retry_run() {
    let mut provider = HeldProvider::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port().await, free_port().await);
    let config = spawned_config(
        &dir,
        port,
        admin_port,
        "[idempotency]\nlease = \"300ms\"\nwait_for_in_flight = \"5s\"\n",
        &provider.url(),
    );
    let client = client();
    let headers = [
        ("authorization", "Bearer sk-client-1"),
        ("idempotency-key", "k-crash"),
    ];

    let mut gateway = spawn_gateway(&config, port, admin_port).await;
    let in_flight = post_in_background(&gateway.base, "k-crash");
    let held = provider.next_call().await;
    gateway.child.kill().unwrap(); // SIGKILL: no grace, no bookkeeping
    gateway.child.wait().unwrap();
    let _ = bounded("the cut request", in_flight).await;
    drop(gateway);

    let gateway = spawn_gateway(&config, port, admin_port).await;
    let retry = send(
        &client,
        Method::POST,
        &format!("{}{CHAT}", gateway.base),
        &headers,
        chat_request(),
    )
    .await;
    retry.assert_problem(409, "outcome-unknown");
    let id = retry.job_id();
    assert_eq!(provider.calls(), 1, "never a second upstream call");
    drop(held);

    let auth = format!("Bearer {ADMIN_TOKEN}");
    let cancel = send(
        &client,
        Method::POST,
        &format!("{}/jobs/{id}/cancel", gateway.admin),
        &[("authorization", &auth)],
        Bytes::new(),
    )
    .await;
    assert_eq!(cancel.status, 200, "{cancel:?}");
    let retry = {
        let client = client.clone();
        let url = format!("{}{CHAT}", gateway.base);
        tokio::spawn(
            async move { send(&client, Method::POST, &url, &headers, chat_request()).await },
        )
    };
    provider
        .next_call()
        .await
        .answer(200, fixture("openai-chat-completion.json"));
    let retry = retry.await.unwrap();
    assert_eq!(retry.status, 200);
    assert_eq!(retry.job_id(), id);
    assert_eq!(retry.header("x-idempotency-attempt"), Some("2"));
    assert_eq!(provider.calls(), 2);
}

/// Every answer a client got before a kill -9 is the job's answer after it: the journal
/// made it durable before the answer was sent, whether or not a checkpoint had written it to
/// the tables yet (a checkpoint runs every second; the kill comes right after the answers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_sent_before_a_kill_9_is_replayed_after_it() {
    let provider = chat_provider().await;
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port().await, free_port().await);
    let config = spawned_config(&dir, port, admin_port, "", &provider.uri());
    const JOBS: usize = 40;
    let keys: Vec<String> = (0..JOBS).map(|n| format!("k-durable-{n}")).collect();
    let post = |base: String, key: String| async move {
        send(
            &client(),
            Method::POST,
            &format!("{base}{CHAT}"),
            &[
                ("authorization", "Bearer sk-client-1"),
                ("idempotency-key", key.as_str()),
            ],
            chat_request(),
        )
        .await
    };

    let mut gateway = spawn_gateway(&config, port, admin_port).await;
    let running: Vec<_> = keys
        .iter()
        .map(|key| tokio::spawn(post(gateway.base.clone(), key.clone())))
        .collect();
    let mut answers = Vec::new();
    for answer in running {
        answers.push(bounded("an answer", answer).await);
    }
    gateway.child.kill().unwrap(); // SIGKILL: no last checkpoint
    gateway.child.wait().unwrap();
    drop(gateway);
    let first: Vec<String> = answers
        .into_iter()
        .map(|answer| {
            let answer = answer.unwrap();
            assert_eq!(answer.status, 200, "{answer:?}");
            answer.job_id()
        })
        .collect();
    assert_eq!(received(&provider).await, JOBS);

    let gateway = spawn_gateway(&config, port, admin_port).await;
    for (key, id) in keys.iter().zip(&first) {
        let replay = post(gateway.base.clone(), key.clone()).await;
        assert_eq!(replay.status, 200, "{key}: {replay:?}");
        assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{key}");
        assert_eq!(&replay.job_id(), id, "{key}");
    }
    assert_eq!(
        received(&provider).await,
        JOBS,
        "no upstream call after the kill"
    );
}

// ---- the default store end to end ---------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_embedded_store_duplicates_make_one_call_and_a_late_answer_settles_an_unknown_job() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(EmbeddedStore::open(&dir.path().join("jobs.db"), POLICY).unwrap());
    let mut primary = HeldProvider::start().await;
    let gw = Arc::new(
        TestGateway::start_on(
            &two_provider_config(&primary.url(), "timeout = \"300ms\"", None, ""),
            store,
        )
        .await,
    );

    // Twenty concurrent duplicates, held at the provider past the timeout: one call, one
    // job, every request told the outcome is unknown.
    let mut clicks = Vec::new();
    for _ in 0..20 {
        let gw = gw.clone();
        clicks.push(tokio::spawn(async move {
            gw.post(CHAT, Some("e-dup"), chat_request()).await
        }));
    }
    let call = primary.next_call().await;
    let mut ids = std::collections::HashSet::new();
    for click in clicks {
        let reply = click.await.unwrap();
        assert!(reply.status == 504 || reply.status == 409, "{reply:?}");
        assert_eq!(reply.json()["type"], "urn:idemgate:outcome-unknown");
        ids.insert(reply.job_id());
    }
    assert_eq!(ids.len(), 1);
    let id = ids.into_iter().next().unwrap();
    assert_eq!(primary.calls(), 1);
    assert_eq!(gw.job(&id).await["job"]["state"], "unknown");

    // The late answer lands and settles the job on disk; the next retry replays it.
    call.answer(200, Bytes::from_static(b"{\"late\":true}"));
    let view = gw.wait_job_change(&id, 1, "unknown").await;
    assert_eq!(view["job"]["state"], "succeeded");
    let replay = gw.post(CHAT, Some("e-dup"), chat_request()).await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.body, Bytes::from_static(b"{\"late\":true}"));
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(primary.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_embedded_store_a_hedged_primary_that_answers_last_loses() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(EmbeddedStore::open(&dir.path().join("jobs.db"), POLICY).unwrap());
    let mut primary = HeldProvider::start().await;
    let mut fallback = HeldProvider::start().await;
    let config = two_provider_config(
        &primary.url(),
        "",
        Some(&fallback.url()),
        "hedge_after = \"50ms\"",
    );
    let gw = Arc::new(TestGateway::start_on(&config, store).await);
    let client = {
        let gw = gw.clone();
        tokio::spawn(async move { gw.post(CHAT, Some("e-race"), chat_request()).await })
    };
    let first = primary.next_call().await;
    fallback
        .next_call()
        .await
        .answer(200, Bytes::from_static(b"{\"from\":\"fallback\"}"));
    let reply = client.await.unwrap();
    assert_eq!(reply.body, Bytes::from_static(b"{\"from\":\"fallback\"}"));
    first.answer(200, Bytes::from_static(b"{\"from\":\"primary\"}"));
    let id = reply.job_id();
    let view = gw
        .job_eventually(&id, |v| v["attempts"][0]["state"] == "lost_race")
        .await;
    assert_eq!(view["job"]["completed_by"], 2);
    let replay = gw.post(CHAT, Some("e-race"), chat_request()).await;
    assert_eq!(replay.body, Bytes::from_static(b"{\"from\":\"fallback\"}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_file_is_refused_with_its_path_and_left_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.db");
    {
        let store = EmbeddedStore::open(&path, POLICY).unwrap();
        let job = conformance_record("o", "k");
        store.claim(job, idemgate::clock::now()).await.unwrap();
    }
    let whole = std::fs::read(&path).unwrap();
    let truncated = &whole[..whole.len().min(5000)];
    std::fs::write(&path, truncated).unwrap();
    let error = EmbeddedStore::open(&path, POLICY).unwrap_err().to_string();
    assert!(error.contains(&path.display().to_string()), "{error}");
    assert!(error.contains("truncated or damaged"), "{error}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        truncated,
        "nothing is written"
    );

    let config = dir.path().join("idemgate.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[store]\npath = \"{}\"\n{}",
            path.display(),
            route("http://127.0.0.1:9")
        ),
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(1),
        "a clean refusal, not a panic: {stderr}"
    );
    assert!(stderr.contains(&path.display().to_string()), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        truncated,
        "nothing is written"
    );
}

fn conformance_record(owner: &str, key: &str) -> idemgate::job::JobRecord {
    let now = idemgate::clock::now();
    idemgate::job::JobRecord::new(
        idemgate::job::new_job_id(owner, key),
        owner.into(),
        key.into(),
        "fp".into(),
        "chat".into(),
        now,
        now + Duration::from_secs(30),
        &POLICY,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_orphaned_by_kill_9_is_listed_unknown_by_the_sweep_with_no_request() {
    let mut provider = HeldProvider::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port().await, free_port().await);
    let config = spawned_config(
        &dir,
        port,
        admin_port,
        "[idempotency]\nlease = \"1s\"\n",
        &provider.url(),
    );
    let mut gateway = spawn_gateway(&config, port, admin_port).await;
    let in_flight = post_in_background(&gateway.base, "k-orphan");
    let _held = provider.next_call().await;
    gateway.child.kill().unwrap();
    gateway.child.wait().unwrap();
    let _ = bounded("the cut request", in_flight).await;
    drop(gateway);
    let killed_at = tokio::time::Instant::now();

    // The gateway comes back; nobody asks for the key. Its sweep finds the orphan.
    let gateway = spawn_gateway(&config, port, admin_port).await;
    wait_orphan_listed_unknown(
        &gateway.admin,
        "k-orphan",
        Duration::from_secs(1),
        killed_at,
    )
    .await;
    assert_eq!(provider.calls(), 1);
}

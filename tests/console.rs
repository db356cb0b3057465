//! The operator's view (SPEC §8): jobs listed by state from the stores' indexes, a job found
//! by its key and its owner's hash, and `idemgate jobs` telling a job's story in a terminal.
//! (The browser console is driven by `tests/ui/console.mjs`, which `.ci/run` runs in
//! headless Chromium.)

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

fn route(provider: &str) -> String {
    format!(
        "[store]\nkind = \"memory\"\n\
         [[providers]]\nname = \"primary\"\nbase_url = \"{provider}\"\ntimeout = \"30s\"\n\
         [[routes]]\nname = \"chat\"\npath_prefix = \"/v1\"\nproviders = [\"primary\"]\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_progress_jobs_are_listed_while_their_provider_is_slow_and_not_after() {
    let mut provider = HeldProvider::start().await;
    let gw = std::sync::Arc::new(TestGateway::start(&route(&provider.url())).await);
    let running = {
        let gw = gw.clone();
        tokio::spawn(async move {
            gw.post("/v1/chat/completions", Some("slow"), chat_request())
                .await
        })
    };
    let call = provider.next_call().await;
    let listed = gw.admin_get("/jobs?state=in_progress").await.json();
    let jobs = listed["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1, "{listed}");
    assert_eq!(jobs[0]["job"]["key"], "slow");
    assert_eq!(jobs[0]["attempts"][0]["state"], "started");
    call.answer(200, fixture("openai-chat-completion.json"));
    assert_eq!(running.await.unwrap().status, 200);
    let listed = gw.admin_get("/jobs?state=in_progress").await.json();
    assert_eq!(listed["jobs"], serde_json::json!([]), "{listed}");
    assert_eq!(listed["next"], serde_json::Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_is_found_by_its_key_and_owner_hash_and_only_with_the_right_owner() {
    let provider = answering(completion()).await;
    let gw = TestGateway::start(&route(&provider.uri())).await;
    let reply = gw
        .post("/v1/chat/completions", Some("order-42/a+b"), chat_request())
        .await;
    let owner = idemgate::intent::digest(b"Bearer sk-client-1");
    let found = gw
        .admin_get(&format!("/jobs?key=order-42%2Fa%2Bb&owner={owner}"))
        .await;
    assert_eq!(found.status, 200, "{found:?}");
    assert_eq!(found.json()["job"]["id"], reply.job_id());
    let wrong = idemgate::intent::digest(b"Bearer someone-else");
    gw.admin_get(&format!("/jobs?key=order-42%2Fa%2Bb&owner={wrong}"))
        .await
        .assert_problem(404, "not-found");
    gw.admin_get("/jobs?key=order-42%2Fa%2Bb")
        .await
        .assert_problem(400, "bad-request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_jobs_command_prints_a_job_s_attempts_in_order_and_its_timeline() {
    // Primary: 503 (a definite failure), then the fallback answers.
    let primary = answering(wiremock::ResponseTemplate::new(503)).await;
    let fallback = answering(completion()).await;
    let gw = TestGateway::start(&format!(
        "[store]\nkind = \"memory\"\n\
         [[providers]]\nname = \"primary\"\nbase_url = \"{}\"\n\
         [[providers]]\nname = \"fallback\"\nbase_url = \"{}\"\n\
         [[routes]]\nname = \"chat\"\npath_prefix = \"/v1\"\nproviders = [\"primary\", \"fallback\"]\n",
        primary.uri(),
        fallback.uri()
    ))
    .await;
    let reply = gw
        .post("/v1/chat/completions", Some("story"), chat_request())
        .await;
    let id = reply.job_id();
    let admin = gw.admin.clone();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args([
                "jobs",
                "--admin",
                &admin,
                "--token-env",
                ADMIN_TOKEN_ENV,
                &id,
            ])
            .env(ADMIN_TOKEN_ENV, ADMIN_TOKEN)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        text.contains("state succeeded") && text.contains("won by #2"),
        "{text}"
    );
    let lines: Vec<&str> = text.lines().collect();
    let first = lines
        .iter()
        .position(|l| {
            l.trim_start().starts_with("1 ")
                && l.contains("primary")
                && l.contains("failed")
                && l.contains("503")
        })
        .unwrap_or_else(|| panic!("{text}"));
    let second = lines
        .iter()
        .position(|l| {
            l.trim_start().starts_with("2 ")
                && l.contains("fallback")
                && l.contains("succeeded")
                && l.contains(" ms")
        })
        .unwrap_or_else(|| panic!("{text}"));
    assert!(first < second, "attempts in order: {text}");
    assert!(text.contains("timeline: 0 .. "), "{text}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("#2") && l.contains("fallback") && l.contains("<- winner")),
        "{text}"
    );

    let admin = gw.admin.clone();
    let listing = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args([
                "jobs",
                "--admin",
                &admin,
                "--token-env",
                ADMIN_TOKEN_ENV,
                "--state",
                "unknown",
            ])
            .env(ADMIN_TOKEN_ENV, ADMIN_TOKEN)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(String::from_utf8_lossy(&listing.stdout), "no jobs\n");
    let _ = Duration::ZERO;
}

#[test]
fn the_compose_files_reference_only_files_that_exist() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    for compose in ["docker-compose.yml", "embedded/docker-compose.yml"] {
        let path = root.join(compose);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let dir = path.parent().unwrap();
        // Every `./file:` bind mount and `context:` names something next to the file.
        for line in text.lines() {
            let line = line.trim().trim_start_matches("- ");
            let source = line
                .strip_prefix("context:")
                .map(str::trim)
                .or_else(|| line.strip_prefix("\"").and_then(|l| l.split(':').next()))
                .or_else(|| {
                    line.starts_with("./")
                        .then(|| line.split(':').next().unwrap())
                })
                .or_else(|| {
                    line.starts_with("../")
                        .then(|| line.split(':').next().unwrap())
                });
            if let Some(source) = source.filter(|s| s.starts_with('.')) {
                assert!(
                    dir.join(source).exists(),
                    "{compose}: {source} does not exist"
                );
            }
        }
    }
}

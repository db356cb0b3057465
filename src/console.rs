//! `idemgate jobs`: the console's story for a terminal — a job's attempts as a table and an
//! ASCII timeline, or the jobs that need a look — fetched from the admin API.

use std::fmt::Write as _;
use std::time::SystemTime;

use serde_json::Value;

const WIDTH: usize = 40;

/// Milliseconds since the epoch of an RFC 3339 time from the admin API.
fn millis(text: &Value) -> Option<u128> {
    let time = humantime::parse_rfc3339_weak(text.as_str()?).ok()?;
    Some(
        time.duration_since(SystemTime::UNIX_EPOCH)
            .ok()?
            .as_millis(),
    )
}

/// One job (`GET /jobs/{id}`): its facts, its attempts in order, and a timeline with one
/// bar per attempt from its start to its end.
pub fn render_job(view: &Value) -> String {
    let job = &view["job"];
    let mut out = String::new();
    let _ = writeln!(
        out,
        "job {}  state {}  version {}  won by {}",
        job["id"].as_str().unwrap_or("?"),
        job["state"].as_str().unwrap_or("?"),
        job["version"],
        job["completed_by"]
            .as_u64()
            .map_or("-".to_owned(), |n| format!("#{n}"))
    );
    let _ = writeln!(
        out,
        "key {}  route {}  owner {}",
        job["key"].as_str().unwrap_or("?"),
        job["route"].as_str().unwrap_or("?"),
        job["owner"].as_str().unwrap_or("?")
    );
    let attempts = view["attempts"].as_array().cloned().unwrap_or_default();
    let _ = writeln!(
        out,
        "\n  {:<3} {:<16} {:<18} {:<7} {:>10}  started",
        "#", "provider", "state", "status", "duration"
    );
    let now = crate::clock::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let spans: Vec<(u128, Option<u128>)> = attempts
        .iter()
        .map(|a| {
            (
                millis(&a["started_at"]).unwrap_or(0),
                millis(&a["finished_at"]),
            )
        })
        .collect();
    for (a, (start, end)) in attempts.iter().zip(&spans) {
        let duration = end.map_or("running".to_owned(), |end| format!("{} ms", end - start));
        let _ = writeln!(
            out,
            "  {:<3} {:<16} {:<18} {:<7} {:>10}  {}",
            a["n"],
            a["provider"].as_str().unwrap_or("?"),
            a["state"].as_str().unwrap_or("?"),
            a["upstream_status"]
                .as_u64()
                .map_or("-".to_owned(), |s| s.to_string()),
            duration,
            a["started_at"].as_str().unwrap_or("?")
        );
        if let Some(error) = a["error"].as_str() {
            let _ = writeln!(out, "      error: {error}");
        }
    }
    if spans.is_empty() {
        return out;
    }
    let first = spans.iter().map(|s| s.0).min().unwrap_or(0);
    let last = spans
        .iter()
        .map(|(start, end)| end.unwrap_or(now.max(*start)))
        .max()
        .unwrap_or(first)
        .max(first + 1);
    let span = last - first;
    let _ = writeln!(out, "\n  timeline: 0 .. {span} ms");
    let winner = job["completed_by"].as_u64();
    for (a, (start, end)) in attempts.iter().zip(&spans) {
        // At least one column each, the last starting no later than the last column.
        let from = (((start - first) * WIDTH as u128 / span) as usize).min(WIDTH - 1);
        let to = ((end.unwrap_or(last) - first) * WIDTH as u128 / span) as usize;
        let to = to.max(from + 1).min(WIDTH);
        let fill = if end.is_some() { '#' } else { '>' };
        let bar: String = (0..WIDTH)
            .map(|i| if i >= from && i < to { fill } else { '.' })
            .collect();
        let mark = if winner == a["n"].as_u64() {
            "  <- winner"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "  #{:<2} {:<12} |{bar}| {}{mark}",
            a["n"],
            a["provider"].as_str().unwrap_or("?"),
            a["state"].as_str().unwrap_or("?")
        );
    }
    out
}

/// A page of jobs (`GET /jobs?state=…`) as a table.
pub fn render_list(page: &Value) -> String {
    let jobs = page["jobs"].as_array().cloned().unwrap_or_default();
    if jobs.is_empty() {
        return "no jobs\n".into();
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<53} {:<12} {:<10} {:<24} attempts",
        "job", "state", "route", "key"
    );
    for view in &jobs {
        let job = &view["job"];
        let attempts: Vec<String> = view["attempts"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|a| {
                        format!(
                            "#{} {} {}",
                            a["n"],
                            a["provider"].as_str().unwrap_or("?"),
                            a["state"].as_str().unwrap_or("?")
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "{:<53} {:<12} {:<10} {:<24} {}",
            job["id"].as_str().unwrap_or("?"),
            job["state"].as_str().unwrap_or("?"),
            job["route"].as_str().unwrap_or("?"),
            job["key"].as_str().unwrap_or("?"),
            attempts.join(", ")
        );
    }
    if let Some(next) = page["next"].as_str() {
        let _ = writeln!(out, "more after {next}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_that_starts_at_the_end_still_gets_a_column() {
        let view = serde_json::json!({
            "job": {"id": "job_1", "state": "succeeded", "version": 2, "completed_by": 2},
            "attempts": [
                {"n": 1, "provider": "p", "state": "failed",
                 "started_at": "2026-01-01T00:00:00.000Z", "finished_at": "2026-01-01T00:00:00.010Z"},
                {"n": 2, "provider": "f", "state": "succeeded",
                 "started_at": "2026-01-01T00:00:00.010Z", "finished_at": "2026-01-01T00:00:00.010Z"}
            ]
        });
        let text = render_job(&view);
        assert!(
            text.lines().any(|l| l.contains("#2") && l.contains("#|")),
            "{text}"
        );
    }

    #[test]
    fn a_job_s_story_is_a_table_and_a_timeline() {
        let view = serde_json::json!({
            "job": {"id": "job_1", "state": "succeeded", "version": 2, "completed_by": 2,
                    "key": "k", "route": "chat", "owner": "o"},
            "attempts": [
                {"n": 1, "provider": "primary", "state": "lost_race", "upstream_status": 200,
                 "started_at": "2026-01-01T00:00:00.000Z", "finished_at": "2026-01-01T00:00:02.000Z", "error": null},
                {"n": 2, "provider": "fallback", "state": "succeeded", "upstream_status": 200,
                 "started_at": "2026-01-01T00:00:01.000Z", "finished_at": "2026-01-01T00:00:01.500Z", "error": null}
            ]
        });
        let text = render_job(&view);
        assert!(text.contains("won by #2"), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        let first = lines
            .iter()
            .position(|l| l.contains("primary") && l.contains("lost_race"))
            .unwrap();
        let second = lines
            .iter()
            .position(|l| l.contains("fallback") && l.contains("succeeded"))
            .unwrap();
        assert!(first < second, "attempts in order");
        assert!(
            text.contains("2000 ms") && text.contains("500 ms"),
            "{text}"
        );
        assert!(text.contains("timeline: 0 .. 2000 ms"), "{text}");
        let bar = lines.iter().find(|l| l.contains("<- winner")).unwrap();
        assert!(
            bar.contains("#2") && bar.contains("|....................##########"),
            "{bar}"
        );
    }
}

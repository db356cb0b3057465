//! The `idemgate` binary: command line, tracing, config, then [`idemgate::run`].

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mimalloc rather than the system allocator: a request allocates and frees many small
/// buffers across tasks, and glibc's malloc spent about a sixth of a new job's CPU time
/// in its own bookkeeping (consolidation, unlinking, growing a thread's heap with
/// `mprotect`) in the in-process profile of `benches/overhead.sh`. Through its plain
/// functions where a layout allows ([`idemgate::alloc`]).
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: idemgate::alloc::Allocator = idemgate::alloc::Allocator;

#[derive(Parser, Debug)]
#[command(
    name = "idemgate",
    version,
    about = "An idempotency gateway for AI provider APIs"
)]
struct Cli {
    /// The config file to serve with.
    #[arg(long, env = "IDEMGATE_CONFIG", global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Validate a config file and exit.
    CheckConfig { file: PathBuf },
    /// Send each route's probe through every provider of the route and print a table;
    /// exits non-zero when a provider does not hold the contract.
    Probe,
    /// Read one credential line on standard input and print its SHA-256 (hex): the owner
    /// hash, and what `[clients] allow` lists.
    OwnerHash,
    /// Show jobs from a gateway's admin API: the ones needing a look, or one job's story
    /// (attempts and a timeline). The token is read from the environment.
    Jobs {
        /// The admin API, e.g. http://127.0.0.1:8081
        #[arg(long)]
        admin: String,
        /// List the jobs in this state.
        #[arg(long, value_parser = ["unknown", "in_progress"], default_value = "unknown")]
        state: String,
        /// The environment variable holding the admin token.
        #[arg(long, default_value = "IDEMGATE_ADMIN_TOKEN")]
        token_env: String,
        /// One job's id: its attempts and timeline instead of a list.
        id: Option<String>,
    },
}

/// Logs to stderr as the config says; `IDEMGATE_LOG` overrides the level.
fn init_logging(log: &idemgate::config::LogConfig) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("IDEMGATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&log.level));
    use std::io::IsTerminal;
    let sink = idemgate::logsink::Batched::stderr();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Colours only for a person at a terminal, never into a log file.
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(sink.clone());
    // The access lines bypass `tracing` into the same sink, in the same format.
    idemgate::accesslog::install(log.format, sink);
    match log.format {
        idemgate::config::LogFormat::Json => builder.json().init(),
        idemgate::config::LogFormat::Text => {
            builder.event_format(idemgate::logline::TextLine).init()
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::CheckConfig { file }) => match idemgate::Config::from_file(&file) {
            Ok(_) => {
                println!("{}: ok", file.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(2)
            }
        },
        Some(Command::Probe) => probe(cli.config),
        Some(Command::OwnerHash) => owner_hash(),
        Some(Command::Jobs {
            admin,
            state,
            token_env,
            id,
        }) => jobs(&admin, &state, &token_env, id.as_deref()),
        None => serve(cli.config),
    }
}

/// `idemgate jobs`: one GET to the admin API, rendered for a terminal.
fn jobs(admin: &str, state: &str, token_env: &str, id: Option<&str>) -> ExitCode {
    let Ok(token) = std::env::var(token_env) else {
        eprintln!("idemgate jobs: set {token_env} to the admin token");
        return ExitCode::from(2);
    };
    let path = match id {
        Some(id) => format!("/jobs/{id}"),
        None => format!("/jobs?state={state}&limit=200"),
    };
    let url = format!("{}{path}", admin.trim_end_matches('/'));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("the tokio runtime starts");
    let fetched = runtime.block_on(async {
        use http_body_util::BodyExt;
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Empty<bytes::Bytes>>();
        let request = http::Request::get(&url)
            .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
            .body(http_body_util::Empty::new())
            .map_err(|e| e.to_string())?;
        let response = client.request(request).await.map_err(|e| e.to_string())?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        let value: serde_json::Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!(
                "{status}: {}",
                value["detail"].as_str().unwrap_or("no detail")
            ));
        }
        Ok(value)
    });
    match fetched {
        Ok(value) => {
            print!(
                "{}",
                match id {
                    Some(_) => idemgate::console::render_job(&value),
                    None => idemgate::console::render_list(&value),
                }
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("idemgate jobs: {url}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One line of standard input, without its line ending, hashed as the owner is.
fn owner_hash() -> ExitCode {
    let mut line = String::new();
    if let Err(e) = std::io::stdin().read_line(&mut line) {
        eprintln!("idemgate owner-hash: cannot read standard input: {e}");
        return ExitCode::from(2);
    }
    let credential = line
        .strip_suffix("\r\n")
        .or_else(|| line.strip_suffix('\n'))
        .unwrap_or(&line);
    println!("{}", idemgate::intent::digest(credential.as_bytes()));
    ExitCode::SUCCESS
}

/// Reads the config (refusing a missing or invalid one) and starts logging as it says.
fn load(path: Option<PathBuf>) -> Result<idemgate::Config, ExitCode> {
    let Some(path) = path else {
        eprintln!("idemgate: no config file: pass --config FILE or set IDEMGATE_CONFIG");
        return Err(ExitCode::from(2));
    };
    let config = idemgate::Config::from_file(&path).map_err(|e| {
        eprintln!("{e}");
        ExitCode::from(2)
    })?;
    init_logging(&config.log);
    Ok(config)
}

fn probe(path: Option<PathBuf>) -> ExitCode {
    let config = match load(path) {
        Ok(config) => config,
        Err(code) => return code,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("the tokio runtime starts");
    let (table, ok) = runtime.block_on(idemgate::probe::run_cli(&config));
    print!("{table}");
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn serve(path: Option<PathBuf>) -> ExitCode {
    let config = match load(path) {
        Ok(config) => config,
        Err(code) => return code,
    };
    without_transparent_huge_pages();
    let mut runtime = runtime_for(cores());
    runtime.enable_all();
    // Before a worker sleeps: the log lines it held while busy are written (unless each is
    // written at once), and the embedded store's writer learns that no more operations are
    // coming for its next sync.
    let flush_log = config
        .log
        .buffered
        .then_some(idemgate::logsink::flush_before_park as fn());
    idemgate::idle::install(&mut runtime, flush_log);
    let runtime = runtime.build().expect("the tokio runtime starts");
    idemgate::idle::started(&runtime);
    #[cfg(feature = "profile")]
    let _profile = profile::Sampler::start();
    let served = runtime.block_on(idemgate::run(config, shutdown_signal()));
    idemgate::logsink::flush_thread();
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idemgate: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The cores this process may run on: its CPU affinity and cgroup quota, as tokio counts them.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// A scheduler per core count. On one core a work-stealing scheduler has no one to steal
/// from, and keeps a second thread (its worker beside the one blocked in `block_on`) for
/// nothing. Measured on one pinned core against it: CPU per new job the same within noise,
/// a median p99 at 32 clients of 2.6 ms against 3.5 ms (README, Deploying it).
/// `TOKIO_WORKER_THREADS` asks for worker threads, so it keeps the multi-threaded one.
fn runtime_for(cores: usize) -> tokio::runtime::Builder {
    if cores == 1 && std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    }
}

/// Turns transparent huge pages off for this process, as Redis does for itself. The memory
/// store grows by a few KB a job, and the allocator asks for huge pages: each one is then
/// zeroed whole at its first touch, 2 MB at once, and every request waits behind it (at
/// 16 000 new jobs a second, a 5 ms stall every 50 ms: the p99 of a new job at 4 clients was
/// 4.7 ms, and 0.5 ms with 4 KB pages, at the same throughput).
fn without_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    if let Err(e) = nix::sys::prctl::set_thp_disable(true) {
        tracing::warn!(error = %e, "transparent huge pages stay on: latency may spike as memory grows");
    }
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM can be handled");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// The bench-only sampler: `IDEMGATE_PROFILE=<file.svg>` samples every thread at 499 Hz
/// (SIGPROF: user and system time alike) and writes a flamegraph when the gateway stops.
#[cfg(feature = "profile")]
mod profile {
    pub(crate) struct Sampler {
        guard: pprof::ProfilerGuard<'static>,
        path: std::path::PathBuf,
    }

    impl Sampler {
        pub(crate) fn start() -> Option<Self> {
            let path = std::env::var_os("IDEMGATE_PROFILE")?.into();
            let guard = pprof::ProfilerGuardBuilder::default()
                .frequency(499)
                .build()
                .ok()?;
            Some(Self { guard, path })
        }
    }

    /// The 40 functions with the most samples, on the stack (inclusive) and at its top
    /// (self: the innermost frame, inlined or not).
    fn top_costs(report: &pprof::Report) -> String {
        use std::collections::{HashMap, HashSet};
        let mut inclusive: HashMap<String, isize> = HashMap::new();
        let mut own: HashMap<String, isize> = HashMap::new();
        let mut total = 0;
        for (frames, &count) in &report.data {
            total += count;
            let mut seen = HashSet::new();
            for (depth, frame) in frames.frames.iter().enumerate() {
                for (inline, symbol) in frame.iter().enumerate() {
                    let name = symbol.name();
                    if depth == 0 && inline == 0 {
                        *own.entry(name.clone()).or_default() += count;
                    }
                    if seen.insert(name.clone()) {
                        *inclusive.entry(name).or_default() += count;
                    }
                }
            }
        }
        let share = |n: isize| n as f64 * 100.0 / total.max(1) as f64;
        let sorted = |costs: HashMap<String, isize>| {
            let mut costs: Vec<_> = costs.into_iter().collect();
            costs.sort_by_key(|c| std::cmp::Reverse(c.1));
            costs
        };
        let table = |costs: &[(String, isize)]| {
            costs
                .iter()
                .take(40)
                .map(|(name, n)| format!("{:6.2}%  {name}\n", share(*n)))
                .collect::<String>()
        };
        let own = sorted(own);
        // Who calls the largest self costs (memcpy, malloc, a system call): the first frame
        // below each sample's innermost function that is another function.
        let mut callers = String::new();
        for (name, n) in own.iter().take(8) {
            let mut of: HashMap<String, isize> = HashMap::new();
            for (frames, &count) in &report.data {
                let mut symbols = frames.frames.iter().flatten().map(|s| s.name());
                if symbols.next().as_ref() != Some(name) {
                    continue;
                }
                let caller = symbols.find(|s| s != name).unwrap_or_default();
                *of.entry(caller).or_default() += count;
            }
            callers.push_str(&format!("{:6.2}%  {name}\n", share(*n)));
            for (caller, m) in sorted(of).iter().take(6) {
                callers.push_str(&format!("          {:6.2}%  {caller}\n", share(*m)));
            }
        }
        format!(
            "{total} samples\n\nself:\n{}\ninclusive:\n{}\ncallers of the largest self costs:\n{callers}",
            table(&own),
            table(&sorted(inclusive))
        )
    }

    /// Every sampled stack, outermost frame first, one line each with its count: the
    /// input of `grep` and of flamegraph tools, for questions the summary does not answer.
    fn folded(report: &pprof::Report) -> String {
        let mut lines = String::new();
        for (frames, count) in &report.data {
            let names: Vec<String> = frames
                .frames
                .iter()
                .rev()
                .flat_map(|frame| frame.iter().rev().map(|symbol| symbol.name()))
                .collect();
            lines.push_str(&format!("{} {count}\n", names.join(";")));
        }
        lines
    }

    impl Drop for Sampler {
        fn drop(&mut self) {
            let written = self.guard.report().build().map(|report| {
                let summary = self.path.with_extension("txt");
                std::fs::write(&summary, top_costs(&report))
                    .and_then(|()| {
                        std::fs::write(self.path.with_extension("folded"), folded(&report))
                    })
                    .map_err(|e| e.to_string())
                    .and_then(|()| std::fs::File::create(&self.path).map_err(|e| e.to_string()))
                    .and_then(|file| report.flamegraph(file).map_err(|e| e.to_string()))
            });
            if let Ok(Err(e)) | Err(e) = written.map_err(|e| e.to_string()) {
                eprintln!("idemgate: profile not written: {e}");
            }
        }
    }
}

//! `dflash proxy`: arguments and the summary line; the work is in `dflash::proxy`.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;

use dflash::proxy::segments::Rotation;
use dflash::proxy::{ProxySettings, serve};

#[derive(Args)]
pub struct ProxyArgs {
    /// The served target's base URL (vLLM, SGLang, llama.cpp's server), e.g. http://localhost:8000: every request's
    /// path and query are appended to it
    #[arg(long, value_name = "URL")]
    upstream: String,
    /// Where clients connect instead
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8001")]
    listen: SocketAddr,
    /// The recording folder: sealed segments `segment-<time>-<n>.jsonl`, one chat conversation a line (what
    /// `prepare` reads), visible only once durable
    #[arg(long, value_name = "DIR")]
    record: PathBuf,
    /// Seal a segment once it holds this many bytes
    #[arg(long, default_value_t = 64 << 20, value_name = "BYTES")]
    segment_bytes: u64,
    /// Seal a segment once it is this old, however small
    #[arg(long, default_value_t = 300, value_name = "SECONDS")]
    segment_seconds: u64,
    /// Exchanges waiting for the writer at most; past it they are dropped and counted, never the client's request
    #[arg(long, default_value_t = 4096)]
    queue: usize,
}

pub fn run(args: ProxyArgs) -> Result<ExitCode> {
    if !(args.upstream.starts_with("http://") || args.upstream.starts_with("https://")) {
        anyhow::bail!(
            "--upstream {:?}: expected an http:// or https:// URL, e.g. http://localhost:8000",
            args.upstream
        );
    }
    let settings = ProxySettings {
        upstream: args.upstream.clone(),
        record: args.record.clone(),
        rotation: Rotation {
            max_bytes: args.segment_bytes.max(1),
            max_age: Duration::from_secs(args.segment_seconds.max(1)),
        },
        queue: args.queue,
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the proxy's runtime")?;
    let counts = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("--listen {}: cannot bind", args.listen))?;
        tracing::info!(
            listen = %listener.local_addr()?,
            upstream = %args.upstream,
            record = %args.record.display(),
            "proxying; Ctrl-C or SIGTERM stops after the requests in flight"
        );
        serve(listener, settings, stopped()).await
    })?;
    let n = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    eprintln!(
        "{} requests; {} chat completions recorded in {}, {} not recordable (errors, cut short, not a conversation), \
         {} lost to the recording (the clients got their answers)",
        n(&counts.requests),
        n(&counts.recorded),
        args.record.display(),
        n(&counts.skipped),
        n(&counts.lost)
    );
    Ok(ExitCode::SUCCESS)
}

/// Resolves at Ctrl-C or SIGTERM.
async fn stopped() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

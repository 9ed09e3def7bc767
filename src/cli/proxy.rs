//! `dflash proxy`: arguments and the summary line; the work is in `dflash::proxy`.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;

use anyhow::{Context, Result};
use clap::Args;

use dflash::config::{Config, ProxyConfig, upstream_url};
use dflash::proxy::policy::Policy;
use dflash::proxy::segments::{Retention, Rotation};
use dflash::proxy::{ProxySettings, serve};

/// The flags override `[proxy]` of the configuration (`dflash config defaults` shows every key: rotation,
/// retention, the headers that keep an exchange out, redaction).
#[derive(Args)]
pub struct ProxyArgs {
    /// The served target's base URL (vLLM, SGLang, llama.cpp's server), e.g. http://localhost:8000: every request's
    /// path and query are appended to it [default: proxy.upstream]
    #[arg(long, value_name = "URL")]
    upstream: Option<String>,
    /// Where clients connect instead [default: proxy.listen, 127.0.0.1:8001]
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// The recording folder: sealed segments `segment-<time>-<n>.jsonl`, one chat conversation a line (what
    /// `prepare` reads), visible only once durable [default: proxy.record, traffic]
    #[arg(long, value_name = "DIR")]
    record: Option<PathBuf>,
}

/// What the proxy is told: `[proxy]` with the flags over it.
fn settings(config: &ProxyConfig, args: &ProxyArgs) -> Result<ProxySettings> {
    let flag = args.upstream.as_deref().map(|u| upstream_url("--upstream", u)).transpose()?.flatten();
    let Some(upstream) = flag.or_else(|| config.upstream.clone()) else {
        anyhow::bail!(
            "no upstream: pass --upstream URL (the served target, e.g. http://localhost:8000) or set proxy.upstream"
        )
    };
    Ok(ProxySettings {
        upstream,
        record: args.record.clone().unwrap_or_else(|| config.record.clone()),
        rotation: Rotation { max_bytes: config.segment_bytes, max_age: config.segment_age },
        retention: Retention { max_bytes: config.keep_bytes, max_age: config.keep_age },
        policy: Policy { rules: config.redact.clone(), skip_headers: config.skip_headers.clone() },
        queue: config.queue,
    })
}

pub fn run(config: &Config, args: ProxyArgs) -> Result<ExitCode> {
    let settings = settings(&config.proxy, &args)?;
    let listen = args.listen.unwrap_or(config.proxy.listen);
    let (upstream, record) = (settings.upstream.clone(), settings.record.clone());
    let (rules, skip_headers) = (settings.policy.rules.len(), settings.policy.skip_headers.len());
    let runtime = tokio::runtime::Runtime::new().context("starting the proxy's runtime")?;
    let counts = runtime.block_on(async {
        let listener =
            tokio::net::TcpListener::bind(listen).await.with_context(|| format!("--listen {listen}: cannot bind"))?;
        tracing::info!(
            listen = %listener.local_addr()?,
            upstream = %upstream,
            record = %record.display(),
            redaction_rules = rules,
            skip_headers,
            "proxying; its counts at {}; Ctrl-C or SIGTERM stops after the requests in flight",
            dflash::proxy::METRICS_PATH
        );
        serve(listener, settings, stopped()).await
    })?;
    let n = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    eprintln!(
        "{} requests; {} chat completions recorded in {} ({} matches masked), {} kept out by a header, {} dropped by \
         a redaction rule, {} not recordable (errors, cut short, not a conversation), {} lost to the recording (the \
         clients got their answers); {} old segments deleted by the retention",
        n(&counts.requests),
        n(&counts.recorded),
        record.display(),
        n(&counts.masked),
        n(&counts.skipped_by_header),
        n(&counts.dropped_by_rule),
        n(&counts.skipped),
        n(&counts.lost),
        n(&counts.retired),
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

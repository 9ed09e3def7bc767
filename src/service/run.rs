//! Starting and ending the service: resolves devices, the drafter's shape and the data, checks a resumed
//! checkpoint against the configuration, starts the supervisor, the control plane and the signal handlers, and
//! returns the exit status the supervisor chose.
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use ractor::Actor;
use tch::{Device, Kind};

use super::builtin_data::dataset;
use super::control::Supervised;
use super::drafter_init::check_init;
use super::drafter_shape::drafter_config;
use super::evaluator::eval_set;
use super::exit::{EXIT_RESTART, StopSignal};
use super::folder_lock::{FolderLock, LockError, lock_file};
use super::ledger::open_ledger;
use super::live::LiveView;
use super::messages::SupervisorMsg;
use super::placement::{capture_devices, spread_to};
use super::status::Status;
use super::stream::StreamRun;
use super::supervisor::protocol::Event;
use super::supervisor::{Supervisor, SupervisorArgs};
use crate::cluster::launch::resolve;
use crate::config::{Config, Layers, TargetSource, as_overrides, as_trained, kept_from_run, lookup, resume_changes};
use crate::data::dataset::Dataset;
use crate::telemetry;
use crate::train::checkpoint::{
    TrainerState, adopt_survivors, has_survivors, newest_valid, remove_unfinished, survivor_root, survivor_writes,
    survivors_dir,
};
use crate::train::link::HostLink;

/// How to treat existing checkpoints.
#[derive(Debug, Clone, PartialEq)]
pub enum Resume {
    /// Start a new run (refused when `checkpoint.dir` already holds checkpoints).
    No,
    /// Continue the newest valid checkpoint in `checkpoint.dir` (or start if there is none).
    Auto,
}

/// The checkpoint to resume (if any), and the steps of the checkpoint folders rejected on the way.
type ResumePoint = (Option<(PathBuf, TrainerState)>, Vec<u64>);

/// The checkpoint to resume; settings left to `auto` take the values the checkpoint's run resolved them to, and keys
/// whose default changed since the run began keep the run's value unless set (`layers`, which a reload rereads,
/// then carry it).
fn checkpoint_to_resume(config: &mut Config, layers: &mut Layers, resume: &Resume) -> Result<ResumePoint> {
    let dir = &config.checkpoint.dir;
    let debris = remove_unfinished(dir).with_context(|| format!("checkpoint.dir = {}", dir.display()))?;
    if !debris.is_empty() {
        tracing::info!(?debris, "removed the temporary folders of checkpoint writes that were killed");
    }
    let mut scan = newest_valid(dir, &|_| true).with_context(|| format!("checkpoint.dir = {}", dir.display()))?;
    if *resume == Resume::No && scan.newest.is_none() && has_survivors(dir) {
        bail!(
            "checkpoint.dir {} holds checkpoints other hosts wrote when rank 0 was lost ({}): pass --resume auto to \
             continue that run, or choose another checkpoint.dir",
            dir.display(),
            survivors_dir(dir).display()
        );
    }
    if *resume == Resume::Auto {
        wait_for_survivor_writes(dir, Duration::from_secs_f64(config.supervision.shutdown_timeout_s));
        let adopted = adopt_survivors(dir, &mut scan).with_context(|| format!("checkpoint.dir = {}", dir.display()))?;
        if let (Some(from), Some((_, state))) = (adopted, &scan.newest) {
            tracing::warn!(
                step = state.step,
                from = %from.display(),
                "resuming the checkpoint another host wrote when rank 0 was lost (newer than rank 0's own)"
            );
        }
    }
    for (_, why) in &scan.rejected {
        tracing::warn!("checkpoint rejected: {why}");
    }
    let rejected = scan.rejected.iter().map(|(step, _)| *step).collect();
    let found = match (resume, scan.newest) {
        (Resume::No, Some((path, state))) => bail!(
            "checkpoint.dir {} already holds checkpoints (newest: step {} in {}): pass --resume auto to continue that \
             run, or choose another checkpoint.dir",
            dir.display(),
            state.step,
            path.display()
        ),
        (Resume::No, None) | (Resume::Auto, None) => {
            if *resume == Resume::Auto {
                tracing::info!(dir = %dir.display(), "no valid checkpoint to resume: starting a new run");
            }
            None
        }
        (Resume::Auto, Some((path, state))) => {
            let trained = as_trained(&state.config);
            let _ =
                keep_the_runs_recipe(config, layers, |key| lookup(&trained, key).cloned(), "the run began with it")?;
            config.adopt_resolved(&state.config);
            let (fixed, others) = resume_changes(&trained, &config.merged);
            if !fixed.is_empty() {
                let changed: Vec<&str> = fixed.iter().map(|c| c.key.as_str()).collect();
                bail!(
                    "cannot resume {}: these settings differ from the run's and cannot change mid-run: {}. Restore \
                     them, or start a new run in another checkpoint.dir",
                    path.display(),
                    changed.join(", ")
                );
            }
            if !others.is_empty() {
                let keys: Vec<&str> = others.iter().map(|c| c.key.as_str()).collect();
                tracing::info!(?keys, "resuming with settings changed since the checkpoint");
            }
            tracing::info!(step = state.step, path = %path.display(), "resuming");
            Some((path, state))
        }
    };
    Ok((found, rejected))
}

/// Gives each key whose built-in default changed since the run began, and that this process leaves to the default,
/// the run's value (`run` reads the run's configuration; `why` ends the log line): in `layers`, so that a reload keeps
/// it, and in `config`, reloaded from them (what `auto` resolved must then be resolved again). Whether it changed
/// anything.
fn keep_the_runs_recipe(
    config: &mut Config,
    layers: &mut Layers,
    run: impl Fn(&str) -> Option<serde_json::Value>,
    why: &str,
) -> Result<bool> {
    let kept = kept_from_run(run, |key| lookup(&config.merged, key).cloned(), |key| layers.origin(key) != "default");
    for (key, value) in &kept {
        let today = lookup(&config.merged, key).map_or("(unset)".into(), |v| v.to_string());
        tracing::info!("{key} = {value}, as {why} (today's default is {today}; set the key to change it)");
    }
    if !kept.is_empty() {
        layers.set.extend(as_overrides(&kept));
        *config = Config::load(layers).context("the run's settings")?;
    }
    Ok(!kept.is_empty())
}

/// Locks the folder this process writes checkpoints to, for the life of the process (`checkpoint.lock`).
fn lock_folder(config: &Config, rank: Option<usize>) -> Result<Option<FolderLock>, LockError> {
    let c = &config.checkpoint;
    if !c.lock {
        tracing::warn!(dir = %c.dir.display(), "checkpoint.lock = false: nothing stops a second process using the folder");
        return Ok(None);
    }
    let wait = Duration::from_secs_f64(c.lock_wait_s);
    let path = lock_file(&c.dir, rank);
    let lock = FolderLock::acquire(&path, wait, |holder| {
        tracing::warn!(
            lock = %path.display(),
            "the checkpoint folder is in use by another dflash process ({holder}): waiting up to {:.0} s \
             (checkpoint.lock_wait_s) for it to end",
            c.lock_wait_s
        )
    })?;
    Ok(Some(lock))
}

/// Waits up to `limit` (the time the other hosts have for it) while another host is still writing the checkpoint
/// it takes when rank 0 is lost: with every host restarted at once, rank 0 would otherwise resume past it.
fn wait_for_survivor_writes(dir: &std::path::Path, limit: Duration) {
    // A write whose files stood still this long was killed.
    const QUIET: Duration = Duration::from_secs(30);
    let started = Instant::now();
    let mut said = false;
    loop {
        let writing = survivor_writes(dir, SystemTime::now(), QUIET);
        if writing.is_empty() {
            return;
        }
        if started.elapsed() >= limit {
            tracing::warn!(?writing, "other hosts' checkpoints still being written: resuming without them");
            return;
        }
        if !said {
            tracing::info!(?writing, "another host is still writing its checkpoint: waiting for it");
            said = true;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Runs the service until it ends; returns its exit status. `layers` are where `config` came from: a reload rereads
/// them.
pub fn serve_train(config: Config, mut layers: Layers, resume: Resume) -> Result<i32> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("dflash-control")
        .build()
        .context("starting the async runtime")?;
    // Taken over first: SIGHUP's default action ends the process, and start-up (built-in data, loading) can be long.
    // One that arrives before the supervisor runs is one reload once it does.
    let hangup = runtime.block_on(async { tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) });
    let target_device = config.target.device.resolve().context("target.device")?;
    let target_kind = config.target.dtype.resolve(target_device);
    let drafter_devices: Vec<(Device, Kind)> = config
        .drafters
        .devices
        .iter()
        .map(|d| {
            let device = d.resolve().context("drafters.devices")?;
            Ok((device, config.target.dtype.resolve(device)))
        })
        .collect::<Result<_>>()?;
    let mut config = config;
    let placement =
        resolve(&config.cluster, |k| std::env::var(k).ok()).context("[cluster] and the launcher's environment")?;
    // Rank 0 resumes the run and keeps its checkpoints; another host takes its state from a live host, and writes
    // (only when rank 0 is lost) into a folder of its own under checkpoint.dir, which may be rank 0's on a shared disk.
    let follower = placement.as_ref().is_some_and(|p| p.rank > 0);
    // Before anything in the folder is read or removed: one writer per folder.
    let _lock = match lock_folder(&config, placement.as_ref().map(|p| p.rank)) {
        Ok(lock) => lock,
        Err(e @ LockError::Held { .. }) => {
            tracing::error!("{e}; exiting with status {EXIT_RESTART} (restart me)");
            return Ok(EXIT_RESTART);
        }
        Err(e) => return Err(e).context("checkpoint.lock"),
    };
    // Before any long work (built-in data, loading): an address in use is found at once.
    let cannot = |key: &str, addr| format!("{key} = {addr}: cannot listen (in use? set another address or \"off\")");
    let control = &config.control;
    let listener = control.listen.map(|a| super::control::bind(a).with_context(|| cannot("control.listen", a)));
    let listener = listener.transpose()?;
    let read_only = control
        .read_only_listen
        .map(|a| super::control::bind(a).with_context(|| cannot("control.read_only_listen", a)));
    let read_only = read_only.transpose()?;
    let (resume, rejected) = match &placement {
        Some(p) if follower => {
            // Its own folder, for the checkpoint it takes if rank 0 is lost: a write killed before is removed.
            let own = survivor_root(&config.checkpoint.dir, p.rank);
            remove_unfinished(&own).with_context(|| format!("{}", own.display()))?;
            (None, vec![])
        }
        _ => checkpoint_to_resume(&mut config, &mut layers, &resume)?,
    };
    // After the checkpoint is found: a resume keeps the taps and MASK token `auto` resolved to when the run began.
    let (target_cfg, mut drafter_cfg) = drafter_config(&config)?;
    // What `auto` resolved to is stored in every checkpoint's configuration: a resume (or a later rule) never changes
    // the taps or the MASK token.
    config.resolve_auto(&drafter_cfg.target_layer_ids, drafter_cfg.mask_token_id);
    if let TargetSource::Preset(p) = &config.target.source
        && let Some(warning) = p.random_weights_warning()
    {
        tracing::warn!("target.model = {warning}");
    }

    match (&config.draft_model.init, &resume) {
        (Some(dir), None) => {
            check_init(dir, &drafter_cfg)?;
            tracing::info!(init = %dir.display(), "a new run: the drafter starts from the published drafter's weights");
        }
        (Some(dir), Some((path, _))) => tracing::info!(
            init = %dir.display(),
            checkpoint = %path.display(),
            "draft_model.init is not read: the run resumes its checkpoint"
        ),
        (None, _) => {}
    }
    let data = dataset(&config, &target_cfg, target_device, target_kind)?;
    // The run's data is said by its base data: a stream's waves only add to it.
    let fingerprint = data_fingerprint(data.as_ref());
    if config.data.stream.is_some() && placement.is_some() {
        bail!("data.stream: a run of several hosts cannot learn from a stream yet; run it on one host");
    }
    let stream = StreamRun::open(&config, data.clone(), &target_cfg)?;
    let data = stream.as_ref().map_or(data, StreamRun::dataset);
    if !follower {
        the_runs_data(&config, resume.as_ref().map(|(path, _)| path.as_path()), &fingerprint)?;
    }
    check_packing(&config, &target_cfg, data.as_ref())?;
    // One host alone (with several, the others wait for rank 0's rendezvous), and no ledger lines for the resume to
    // write (a complete run whose last lines were not written ended 75: resuming writes them).
    if placement.is_none()
        && let Some((path, state)) = &resume
        && super::supervisor::complete_at(&config, data.lengths(), state)
        && ledger_holds(&config, &state.recent_commits)
    {
        return already_complete(&config.checkpoint.dir, path, state.step);
    }
    // Read now, so that a missing split or file is found wanting at start rather than at the first evaluation.
    let eval_set = (config.eval.every_steps > 0).then(|| eval_set(&config, target_cfg.vocab_size)).transpose()?;
    let token = super::control::token(&config.control, |k| std::env::var(k).ok())?;
    let prometheus = telemetry::install()?;
    let capture_devices = capture_devices(&config, (target_device, target_kind), &drafter_devices)?;
    let spread_to = spread_to(&config, capture_devices.len())?;
    // Served now: a host of several waits for the others next, and answers meanwhile.
    let waiting_for = match &placement {
        Some(p) => format!(
            "waiting for rank 0's store at {}:{} and the other hosts (cluster.rendezvous_timeout_s = {})",
            p.master_addr,
            p.master_port,
            p.rendezvous_timeout.as_secs_f64()
        ),
        None => "starting".into(),
    };
    let phase = if placement.is_some() { "rendezvous" } else { "starting" };
    let resumed = resume.as_ref().map(|(path, state)| (path.as_path(), state));
    let live = LiveView::new(config.checkpoint.dir.clone());
    let publishing = Some((config.publish.clone(), config.checkpoint.dir.clone()));
    let supervised = Supervised::before(Status::before_start(phase, waiting_for, resumed), live.clone(), publishing);
    {
        let _in_runtime = runtime.enter();
        serve_control(read_only, listener, &supervised, &prometheus, token)?;
    }
    let link = match &placement {
        Some(p) => {
            tracing::info!(rank = p.rank, hosts = p.hosts, rendezvous = %format!("{}:{}", p.master_addr, p.master_port),
                "one host of several");
            let link = HostLink::open(p, config.cluster.round_timeout).context("joining the run's hosts")?;
            link.agree_on_data(&fingerprint).context("checking the training data across hosts")?;
            let target = format!(
                "{:?}, {} layers, hidden {}, vocabulary {}",
                target_cfg.architecture, target_cfg.num_hidden_layers, target_cfg.hidden_size, target_cfg.vocab_size
            );
            let mine = crate::config::join_settings(&config.merged, &target);
            let rank0 = link.rank0_settings(&mine).context("checking the settings across hosts")?;
            let overridden = match rank0 {
                Some(rank0) => {
                    // A resumed run keeps its recipe on rank 0: a host that leaves a changed default unset follows.
                    if keep_the_runs_recipe(&mut config, &mut layers, |key| rank0.get(key).cloned(), "rank 0 runs it")?
                    {
                        drafter_cfg = drafter_config(&config)?.1;
                        config.resolve_auto(&drafter_cfg.target_layer_ids, drafter_cfg.mask_token_id);
                    }
                    let mine = crate::config::join_settings(&config.merged, &target);
                    crate::config::agree_with_rank0(&mine, &rank0).context("checking the settings across hosts")?
                }
                None => Vec::new(),
            };
            for c in overridden {
                let show = crate::config::Change::shown;
                tracing::warn!("{} = {} here: rank 0's {} applies to the whole run", c.key, show(&c.new), show(&c.old));
            }
            Some(Arc::new(link))
        }
        None => None,
    };
    // After the hosts agree: a host may have taken rank 0's recipe.
    let gamma = config.objective.gamma.resolve(drafter_cfg.block_size)?;
    let objective = config.objective.settings(
        config.objective.num_anchors,
        drafter_cfg.block_size,
        gamma,
        drafter_cfg.mask_token_id,
    );
    // Rank 0 keeps the run's ledger: one that cannot be opened stops the run before it trains.
    let ledger = match config.data.ledger.as_ref().filter(|_| !follower) {
        Some(path) => Some((
            open_ledger(path)
                .with_context(|| format!("data.ledger = {}: cannot open it for appending", path.display()))?,
            path.clone(),
        )),
        None => None,
    };
    let exit_code = Arc::new(Mutex::new(None));
    let args = SupervisorArgs {
        taps: drafter_cfg.target_layer_ids.clone(),
        drafter_config: drafter_cfg,
        objective,
        target_source: config.target.source.clone(),
        target_device: (target_device, target_kind),
        capture_devices,
        spread_to,
        drafter_devices,
        dataset: data,
        stream,
        resume,
        rejected,
        exit_code: exit_code.clone(),
        layers,
        prometheus: Some(prometheus.clone()),
        vocab_size: target_cfg.vocab_size,
        eval_set,
        eos_token_ids: target_cfg.eos_token_ids.clone(),
        link,
        ledger,
        live,
        config,
    };
    runtime.block_on(async move {
        let (supervisor, handle) = Actor::spawn(Some("supervisor".into()), Supervisor, args)
            .await
            .map_err(|e| anyhow::anyhow!("starting the supervisor: {e}"))?;
        supervised.started(supervisor.clone());
        watch_reload_signal(hangup, supervisor.clone());
        watch_stop_signals(supervisor.clone());
        let _ = handle.await;
        Ok::<(), anyhow::Error>(())
    })?;
    let code = exit_code.lock().unwrap_or_else(|p| p.into_inner()).unwrap_or(1);
    runtime.shutdown_background();
    Ok(code)
}

/// Whether `data.ledger` (when the run keeps one) already holds a checkpoint's `recent_commits`, the lines its
/// writer had not confirmed when the checkpoint was taken.
fn ledger_holds(config: &Config, commits: &[(u64, Vec<crate::data::loader::BatchId>)]) -> bool {
    match (&config.data.ledger, commits.is_empty()) {
        (_, true) | (None, _) => true,
        (Some(path), false) => std::fs::read_to_string(path).is_ok_and(|text| super::ledger::holds(&text, commits)),
    }
}

/// A resumed run with nothing left to train (its steps or epochs done at its newest checkpoint): nothing is loaded or
/// evaluated again; its drafter is exported again into `final/` from that checkpoint, and what the run came to is
/// said, with what to run to go on.
fn already_complete(dir: &std::path::Path, checkpoint: &std::path::Path, step: u64) -> Result<i32> {
    let exported = super::supervisor::export_final(checkpoint, dir)
        .map_err(|e| anyhow::anyhow!("exporting {} into {}/final: {e}", checkpoint.display(), dir.display()))?;
    let best = match super::evaluator::read_history(dir)
        .ok()
        .and_then(|h| h.into_iter().max_by(|a, b| a.decode_acceptance_length.total_cmp(&b.decode_acceptance_length)))
    {
        Some(e) => format!(
            "; best decoded acceptance {:.2} at step {} ({}/best; `dflash inspect-run {}` shows every evaluation)",
            e.decode_acceptance_length,
            e.step,
            dir.display(),
            dir.display()
        ),
        None => String::new(),
    };
    tracing::info!(
        "the run in {} is already complete at step {step}: nothing to train; its drafter: {}{best}. To train on, \
         raise optim.max_steps (or optim.epochs) and run the same command again",
        dir.display(),
        exported.display()
    );
    Ok(super::exit::EXIT_OK)
}

/// Serves the control plane (`control.listen`) and its read-only part (`control.read_only_listen`) on the listeners
/// bound at start, each a task on the current runtime.
fn serve_control(
    read_only: Option<std::net::TcpListener>,
    listener: Option<std::net::TcpListener>,
    supervised: &Arc<Supervised>,
    prometheus: &metrics_exporter_prometheus::PrometheusHandle,
    token: Option<Arc<str>>,
) -> anyhow::Result<()> {
    if let Some(listener) = read_only {
        let bound = super::control::serve_read_only(listener, supervised.clone(), prometheus.clone())
            .context("control.read_only_listen")?;
        tracing::info!(
            read_only_address = %bound,
            "control plane, read-only: the live page at http://{bound}/; GET /healthz /readyz /status /history /metrics"
        );
    }
    if let Some(listener) = listener {
        let guarded = token.is_some();
        let bound =
            super::control::serve(listener, supervised.clone(), prometheus.clone(), token).context("control.listen")?;
        let posts = match (guarded, bound.ip().is_loopback()) {
            (true, _) => "POST /checkpoint /reload (with the bearer token)",
            (false, true) => "POST /checkpoint /reload",
            (false, false) => {
                tracing::warn!(
                    "control.listen = {bound} is not a loopback address and no token is set: POST endpoints answer \
                     401. Set DFLASH_CONTROL_TOKEN (or control.token_file) to use them from other machines"
                );
                "POST endpoints refused (no token set)"
            }
        };
        tracing::info!(
            address = %bound,
            "control plane: the live page at http://{bound}/; GET /healthz /readyz /status /history /metrics, {posts}"
        );
    }
    Ok(())
}

/// SIGTERM and SIGINT stop the run (a checkpoint, then exit 143 or 130); a second one exits at once with its own
/// status.
fn watch_stop_signals(supervisor: ractor::ActorRef<SupervisorMsg>) {
    use tokio::signal::unix::{SignalKind, signal};
    let (term, int) = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(t), Ok(i)) => (t, i),
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!("cannot watch SIGTERM and SIGINT: {e}");
            return;
        }
    };
    tokio::spawn(async move {
        let (mut term, mut int) = (term, int);
        let mut stopping = false;
        loop {
            let signal = tokio::select! {
                _ = term.recv() => StopSignal::Terminate,
                _ = int.recv() => StopSignal::Interrupt,
            };
            if stopping {
                let code = signal.exit_code();
                tracing::warn!("second signal: exiting now with status {code} (the newest valid checkpoint stays)");
                leave(code);
            }
            stopping = true;
            let _ = supervisor.send_message(SupervisorMsg::Core(Event::Shutdown(signal)));
        }
    });
}

/// Ends the process with `code` at once. Compute threads may still be inside libtorch (an abandoned hung thread
/// always is); running the C++ static destructors under them can crash (`std::process::exit` does: a segmentation
/// fault, status 139). Everything that matters is written and synced, so leave without them.
pub fn leave(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: _exit ends the process at once; no Rust state is used afterwards.
    unsafe { libc::_exit(code.clamp(0, 255)) }
}

/// `data.pack` needs a dense target (attention sinks take no packed mask) and rows long enough for every
/// conversation: both found at start, naming the key.
fn check_packing(config: &Config, target: &crate::model::TargetConfig, data: &dyn Dataset) -> Result<()> {
    let Some(pack_len) = config.data.pack else { return Ok(()) };
    if target.gpt_oss.is_some() {
        bail!(
            "data.pack = true: {:?} targets are not packed (their attention sinks take no packed mask); set \
             data.pack = false",
            target.architecture
        );
    }
    let lengths = data.lengths();
    if let Some((p, &longest)) = lengths.iter().enumerate().max_by_key(|(_, l)| **l)
        && longest > pack_len
    {
        bail!(
            "data.pack_len = {pack_len}: sample {} has {longest} tokens, more than a packed row holds; set \
             data.pack_len to at least {longest}",
            data.id(p)
        );
    }
    Ok(())
}

/// What identifies the training data across hosts: its samples' ids and token counts, hashed.
fn data_fingerprint(data: &dyn Dataset) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for (p, len) in data.lengths().into_iter().enumerate() {
        h.update(format!("{}:{len};", data.id(p)).as_bytes());
    }
    let digest = h.finalize();
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("{} samples, sha256 {hex}", data.len())
}

/// The file beside a run's checkpoints that says what data it began on.
const RUN_DATA: &str = "data.json";

/// Keeps what data a run trains on beside its checkpoints (`checkpoint.dir/data.json`: `data.path` and the training
/// split's ids and lengths, [`data_fingerprint`]), written when a run begins, and refuses to resume (`resumed`: the
/// checkpoint) on other data: rows trained on could have moved to the held-out split, and the ledger's exactly-once
/// would mean nothing. A run from before the file existed adopts today's data.
fn the_runs_data(config: &Config, resumed: Option<&std::path::Path>, fingerprint: &str) -> Result<()> {
    let dir = &config.checkpoint.dir;
    let path = dir.join(RUN_DATA);
    let now = serde_json::json!({"path": config.merged["data"]["path"], "train": fingerprint});
    if let Some(checkpoint) = resumed
        && let Ok(text) = std::fs::read_to_string(&path)
    {
        let began: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
        if began["train"] != now["train"] {
            bail!(
                "cannot resume {}: the run began on data.path = {} (training split: {}), and data.path = {} now \
                 holds {}: the data changed under the run (prepared again into the same folder?). Restore the data it \
                 began on, or start a new run in another checkpoint.dir",
                checkpoint.display(),
                began["path"],
                began["train"].as_str().unwrap_or("?"),
                now["path"],
                now["train"].as_str().unwrap_or("?")
            );
        }
        return Ok(());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("checkpoint.dir = {}", dir.display()))?;
    let tmp = dir.join(format!(".{RUN_DATA}.tmp"));
    std::fs::write(&tmp, now.to_string())
        .and_then(|()| std::fs::rename(&tmp, &path))
        .with_context(|| format!("writing {}", path.display()))
}

/// SIGHUP rereads the configuration. Signals arriving within a quarter second of each other are one reload.
fn watch_reload_signal(
    hangup: std::io::Result<tokio::signal::unix::Signal>,
    supervisor: ractor::ActorRef<SupervisorMsg>,
) {
    let mut hup = match hangup {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("cannot watch SIGHUP (reload with POST /reload instead): {e}");
            return;
        }
    };
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            while tokio::time::timeout(std::time::Duration::from_millis(250), hup.recv()).await.is_ok() {}
            tracing::info!("SIGHUP: rereading the configuration");
            if supervisor.send_message(SupervisorMsg::Reload(None)).is_err() {
                return;
            }
        }
    });
}

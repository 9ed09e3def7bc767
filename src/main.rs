//! The `dflash` command line: parses arguments, layers the configuration, sets up logging and dispatches to the
//! library. No training or model logic lives here.
mod cli;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

use dflash::config::{Config, ConfigError, Layers};
use dflash::panic::{is_torch_error, payload_message};

// One line per paragraph: clap wraps them to the terminal's width.
const AFTER_HELP: &str = "Configuration layers, each overriding the one before: the built-in defaults \
(config/default.toml lists and explains every key), --config FILE, DFLASH__SECTION__KEY environment variables, then \
--set section.key=value.

Exit status: 0 success (serve-train: the run is complete), 1 error, 2 bad command line, 3 serve-train cannot go on \
(no drafter, or too few, left; a target copy past its restart limit), 75 serve-train asks to be restarted with \
--resume auto, 130 / 143 serve-train stopped by SIGINT / SIGTERM before completion (after its checkpoint).

Logs go to stderr (RUST_LOG or log.level filter them); results go to stdout.";

#[derive(Parser)]
#[command(
    name = "dflash",
    version,
    about = "Train DFlash speculative-decoding drafters for a frozen target LLM",
    long_about = "Train DFlash speculative-decoding drafters for a frozen target LLM (Qwen3, Qwen3-MoE, GPT-OSS, Llama-3).\n\n\
                  A drafter reads hidden states of the target and proposes a whole block of tokens in one forward \
                  pass; the target verifies the block, so decoding runs several times faster. dflash trains such \
                  drafters as a long-running, fault-tolerant service and measures what matters on the way.",
    after_help = AFTER_HELP
)]
struct Cli {
    /// A TOML file layered over the built-in defaults; write only the keys you change.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Override one configuration key, e.g. `--set target.device=cpu` (repeatable; wins over file and env).
    #[arg(long = "set", global = true, value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a drafter as a long-running service: a supervisor, the target and one drafter per device
    #[command(long_about = "Train a drafter as a long-running service. A supervisor owns the target model and one \
        drafter per entry of drafters.devices, each computing on its own thread; steps are synchronous data \
        parallel with a per-step quorum. A failed drafter restarts alone (with backoff and an intensity limit) from \
        its live peers' state while the others keep training; no sample or optimizer state is lost. Checkpoints go \
        to checkpoint.dir (atomic, verified, the newest kept); at the end the drafter is exported to \
        checkpoint.dir/final in the published format.\n\n\
        The control plane on control.listen serves GET / (a live page of the run for a browser), /healthz, /readyz, \
        /status, /history and /metrics (Prometheus; also alone on control.read_only_listen), POST /checkpoint, /reload and /publish (and POST /drafters/{id}/fault and \
        /targets/{id}/fault with control.fault_injection); POST takes \"Authorization: Bearer <token>\" whenever \
        DFLASH_CONTROL_TOKEN or control.token_file sets one, and answers 401 without one off loopback. SIGHUP or POST /reload \
        rereads the configuration: learning rates (AdamW's, Muon's) and schedule, num_anchors, gamma, intervals and log level change at \
        the same step on every drafter; other changes are refused and the run goes on. With eval.every_steps, the \
        acceptance length is measured by real speculative decoding of held-out prompts on a thread beside training, \
        and the best checkpoint is kept as checkpoint.dir/best; with [publish] dir, each evaluation that beats the \
        published drafter by publish.margin (decoded on the same prompts) is exported to dir/vN and dir/current \
        flips to it, for vLLM or SGLang to load (POST /publish publishes the best checkpoint at once). SIGTERM or Ctrl-C finishes the current steps, \
        checkpoints and exits 143 or 130 (a stop before completion: restart with --resume auto to continue; 0 is \
        for a complete run only); a second signal exits at once with its status. One process per checkpoint.dir: \
        another waits up to checkpoint.lock_wait_s for its lock, then exits 75. Exit 3: the run cannot go on (fewer than \
        supervision.min_live_drafters drafters left that are not failed, or a target copy past its restart limit). \
        Exit 75 asks an outside supervisor to restart with --resume auto (an error poisoned a device, the end's \
        checkpoint did not finish within supervision.shutdown_timeout_s, data.ledger failed \
        data.ledger_max_failures times in a row, checkpoint.dir is held by another process, or, with several hosts, \
        the rendezvous host is gone). GET /readyz answers 503 while no drafter is live, a data.ledger write fails \
        or a checkpoint write has stalled.\n\n\
        Several hosts: run one serve-train per host with the same configuration and data; the host's place comes \
        from the launcher's environment (MASTER_ADDR, MASTER_PORT, NODE_RANK or RANK, NNODES or WORLD_SIZE) or \
        [cluster]. Rank 0 serves the rendezvous store, assigns every host's batches and keeps ledger and \
        checkpoints; a host that dies leaves the run and rejoins from a live one when restarted. On GPUs set \
        drafters.collective = \"nccl\": every host's drafters then sum in one NCCL communicator.\n\n\
        The built-in default trains on the tiny-tasks target (built in) and built-in sample data with two drafters:\n  dflash serve-train")]
    ServeTrain(ServeTrainArgs),
    /// Turn chat JSONL into token ids and loss masks with the target's tokenizer and chat template
    #[command(long_about = "Turn chat JSONL into token ids and loss masks with the target's own tokenizer and chat \
        template, as HuggingFace's apply_chat_template renders and tokenizes them. The loss mask is 1 exactly on \
        what each assistant turn produced (its content and end-of-turn marker) and 0 on role headers, system, user \
        and tool turns, and text the template inserts (Qwen3's empty think block).\n\n\
        Bad lines (malformed JSON, unknown roles, empty conversations, templates that fail) are skipped and \
        counted (--strict stops at the first); samples with fewer than 2 x block size supervised tokens are \
        dropped; conversations are truncated at --max-len. The output folder holds memory-mappable shards and a \
        manifest of checksums; it appears only when complete, and a rerun with the same inputs and settings does \
        nothing.\n\n\
        Example:\n  dflash prepare --model /models/Qwen3-8B --input chats.jsonl --out data/qwen3 --max-len 3072 \
        --holdout 0.01 --template-kwargs '{\"enable_thinking\": false}'")]
    Prepare(cli::data::PrepareArgs),
    /// Show prepared samples as the trainer sees them, supervised tokens highlighted (or as JSON lines)
    Inspect(cli::data::InspectArgs),
    /// Write the built-in sample conversations (for the tiny preset and trying things out)
    SampleData(cli::data::SampleDataArgs),
    /// The target's own replies: every assistant turn rewritten, and prompts without answers answered
    #[command(long_about = "Give a chat dataset the target's own replies, turn by turn, so the drafter learns what \
        the target itself writes: every assistant turn after the first user turn is rewritten, and a conversation \
        that ends with a user or tool turn (a prompt alone) gets the reply it asks for. Replies come from an \
        OpenAI-compatible chat-completions server (vLLM, SGLang, llama.cpp), checked once before the run, with \
        bounded concurrency and retries, or from the built-in target with --local. The output is appended one \
        conversation at a time, each line carrying its input id: an interrupted run continues where it stopped, and \
        conversations that failed are retried by the next run.\n\n\
        Examples:\n  dflash regenerate --endpoint http://localhost:8000/v1 --model models/Qwen3-8B --input chats.jsonl \
        --out regen.jsonl --template-kwargs '{\"enable_thinking\": false}'\n  \
        dflash regenerate --local --model tiny-tasks --input sample.jsonl --out regen.jsonl --max-tokens 64")]
    Regenerate(cli::regenerate::RegenerateArgs),
    /// Conversations written by the target alone: it writes users' requests, then answers them
    #[command(long_about = "Conversations from the model folder alone, in the target's own distribution: opened at a \
        user turn (the chat template up to where a user's message starts), an aligned model writes a plausible \
        request (Magpie, arXiv 2406.08464); it then answers it as it answers users (greedy by default) and, for \
        conversations of several turns (--turns 2-4), writes the next request after its answer. Requests are \
        sampled (--request-temperature, --request-top-p) and checked: special tokens, runaways and empty or too \
        short requests, replies instead of requests, exact and near duplicates (MinHash over word pairs, \
        --duplicate-threshold) are rejected, each counted in the summary and written with its reason to \
        <stem>.rejected.jsonl. The summary also gives the spread of first words, so a collapsed run shows. \
        --topics or --system-prompts (files, one a line) steer the requests towards your traffic.\n\n\
        The output is the chat JSONL prepare reads, appended conversation by conversation, each line with its \
        seed and settings: a rerun after a stop continues it (an attempt is never generated twice), and the same \
        seed and options give the same file. The target generates many sequences at once on --device (--batch).\n\n\
        Example (then prepare and serve-train as README's worked example):\n  \
        dflash synthesize --model models/SmolLM2-135M-Instruct --count 50000 --out synth.jsonl --max-tokens 256\n  \
        dflash synthesize --model models/Qwen3-8B --count 100000 --out synth.jsonl --turns 1-3 \
        --template-kwargs '{\"enable_thinking\": false}'")]
    Synthesize(cli::synthesize::SynthesizeArgs),
    /// Score a drafter: teacher-forced acceptance on token rows, or measured acceptance by real decoding (--decode)
    #[command(long_about = "Score a drafter on token rows at every valid anchor (no sampling, so the result is \
        deterministic): the target captures its tapped states, the drafter drafts every block, and the weighted \
        loss, accuracy and teacher-forced acceptance length (per block drafted from the true tokens before it, 1 + \
        the leading slots predicted right) are printed.\n\n\
        With --decode it decodes for real instead: each prompt is generated by speculative decoding (the drafter \
        drafts a block from the target's states, the target verifies it in one pass and keeps the agreeing prefix \
        plus its own next token) and by the target's plain greedy decoding, and the report gives the measured \
        acceptance length (tokens kept per verify step), whether the two outputs are identical (lossless), and \
        tokens/s of both.\n\n\
        Examples:\n  dflash eval --target /models/Qwen3-8B --drafter runs/checkpoints/ckpt-000001000/drafter --data heldout.jsonl --json\n  \
        dflash eval --decode --target /models/Qwen3-8B --drafter drafters/qwen3-8b-b16 --prompts prompts.jsonl \
        --max-new-tokens 256 --json")]
    Eval(cli::eval::EvalArgs),
    /// Write a checkpoint's drafter as a standalone folder in the published DFlash format (bf16 by default)
    Export(cli::export::ExportArgs),
    /// A run's evaluations so far: a table, and a plot of acceptance and loss against steps
    #[command(long_about = "A run's history of evaluations (checkpoint.dir/evals.jsonl, one line per evaluation: \
        the step, decoded acceptance on the held-out prompts, teacher-forced acceptance and loss on the held-out \
        rows, token match, lossless) as a table, the best decoded acceptance marked, and as a plot of acceptance and \
        held-out loss against steps (DIR/evals.svg, or --plot FILE). It reads the file as the run writes it, so it \
        works during a run too.\n\n\
        Example:\n  dflash inspect-run runs/make-run")]
    InspectRun(cli::inspect_run::InspectRunArgs),
    /// Record what the served target says: an OpenAI-compatible pass-through that keeps each chat completion
    #[command(long_about = "An OpenAI-compatible pass-through in front of the served target (vLLM, SGLang, \
        llama.cpp's server): clients connect to --listen instead of the server, every request and response passes \
        unchanged (streamed responses chunk by chunk), and each successful chat completion is also recorded, the \
        request's messages with the target's answer last and its sampling settings, as one line of chat JSONL \
        that `dflash prepare` reads. Lines go to a hidden open segment in --record, sealed (fsynced, then renamed \
        to segment-<time>-<n>.jsonl) by size, by age and at the stop, so a reader sees only whole, durable \
        segments; what a crash left open is sealed at the next start. Recording never fails or holds up a client's \
        request: an exchange the writer cannot take is dropped and counted. Upstream errors, streams cut short and \
        requests for several choices are passed on and not recorded. What is kept is configured under [proxy] \
        (--config FILE or --set proxy.KEY=VALUE; the flags win): rotation, retention (keep_bytes, keep_hours), \
        headers that keep a client out (skip_headers) and redaction rules that mask or drop (redact); \
        GET /_dflash/metrics answers the proxy's counts in Prometheus' format.\n\n\
        Example:\n  dflash proxy --upstream http://localhost:8000 --listen 127.0.0.1:8001 --record traffic/\n  \
        dflash --config dflash.toml proxy --set 'proxy.skip_headers=[\"x-no-record\"]'")]
    Proxy(cli::proxy::ProxyArgs),
    /// Measure the hot loops at real shapes: throughput, TFLOP/s, MFU, peak memory, step times
    #[command(long_about = "Measure the hot loops at real shapes with random inputs: tokens/s, achieved TFLOP/s, \
        MFU against --peak-tflops, peak device memory and step-time percentiles. Target and device default to the \
        configuration ([target] and [draft_model]); the flags below override it.\n\n\
        --what target: the frozen target's forward pass up to the last tapped layer, returning the tapped hidden \
        states concatenated (what training needs); with --full the whole stack and the LM head (what decoding \
        needs). FLOPs counted: 2 x matmul weights x tokens per layer, plus 2 x layers x heads x head_dim x seq x \
        tokens for causal attention, plus 2 x hidden x vocab x tokens for the LM head with --full. In a \
        mixture-of-experts layer (qwen3-30b-a3b, gpt-oss-20b, tiny-moe, tiny-gpt-oss) only the active weights \
        count: q, k, v, o, the router (hidden x experts) and the experts each token is sent to (experts per token x \
        3 x hidden x expert width), so MFU is against the work actually done; a GPT-OSS sliding-window layer counts \
        the keys its window lets each query see.\n\n\
        --what drafter: whole training steps of the preset's drafter (forward, LM head + loss in chunks, backward, \
        clipping, AdamW) on random target features, target capture excluded (--capture times it separately). \
        FLOPs per sample follow DFLASH.md's cost model as the PyTorch peer counts it: 3x the forward products of \
        fc and the layers, dense attention over S + N*bs keys, and 2x the frozen LM head.\n\n\
        --what pipeline: every step captures the batch's features with the preset's target, then trains the \
        drafter on them, on one device with no actors: what serve-train's step time is compared with.\n\n\
        --what decode: batch-1 speculative decoding with the preset's target (whole stack) and drafter: the \
        target's verify pass over a block after a --seq-token prompt, the drafter's pass (drafted tokens/s = \
        (block size - 1) per pass), and whole generations of --steps tokens, speculative against greedy \
        (`--set draft_model.variant=dflash2`: DFlash 2's pass, its convolutions and the selector's walk).\n\n\
        --what launch: tiny kernels launched from 1, 2, 4, 8 threads of this process at once (--threads): whether \
        the launch rate scales with drafter threads.\n\n\
        Examples (the H200 comparisons in BENCHMARKS.md):\n  \
        dflash bench --what target --preset qwen3-8b --device cuda:0 --batch 16 --seq 2048 --steps 5 --json\n  \
        dflash bench --what target --preset qwen3-30b-a3b --device cuda:0 --batch 16 --seq 2048 --steps 5 --json\n  \
        dflash bench --what target --preset gpt-oss-20b --device cuda:0 --batch 16 --seq 2048 --steps 5 --json\n  \
        dflash bench --what drafter --preset qwen3-8b --device cuda:0 --batch 4 --seq 768 --anchors 256 --json")]
    Bench(cli::bench::BenchArgs),
    /// The configuration a command would run with (each key with where it came from), or the defaults explained
    #[command(subcommand)]
    Config(cli::config::ConfigCommand),
    /// Shell completions for dflash's subcommands and flags
    #[command(long_about = "Shell completions for dflash's subcommands and flags, written to standard output.\n\n\
        Examples:\n  dflash completions bash > ~/.local/share/bash-completion/completions/dflash\n  \
        dflash completions zsh > ~/.zfunc/_dflash      # with fpath+=~/.zfunc before compinit in ~/.zshrc\n  \
        dflash completions fish > ~/.config/fish/completions/dflash.fish")]
    Completions {
        /// bash, zsh, fish, elvish or powershell
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Args)]
struct ServeTrainArgs {
    /// `auto`: continue the newest valid checkpoint in checkpoint.dir (or start when there is none). Without it, a
    /// checkpoint.dir that already holds checkpoints is refused.
    #[arg(long, value_name = "auto")]
    resume: Option<ResumeArg>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ResumeArg {
    Auto,
}

fn serve_train(config: Config, layers: Layers, args: ServeTrainArgs) -> Result<ExitCode> {
    let resume = match args.resume {
        Some(ResumeArg::Auto) => dflash::service::run::Resume::Auto,
        None => dflash::service::run::Resume::No,
    };
    let code = dflash::service::run::serve_train(config, layers, resume)?;
    dflash::service::run::leave(code)
}

/// Adds a subcommand suggestion clap's spelling distance misses: one whose name holds the word typed, or is held in
/// it (`train` -> `serve-train`, `evaluate` -> `eval`).
fn suggest_subcommand(mut e: clap::Error) -> clap::Error {
    use clap::CommandFactory;
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if e.kind() != ErrorKind::InvalidSubcommand || e.get(ContextKind::SuggestedSubcommand).is_some() {
        return e;
    }
    let Some(ContextValue::String(typed)) = e.get(ContextKind::InvalidSubcommand) else { return e };
    let typed = typed.to_lowercase();
    let names: Vec<String> = Cli::command()
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .filter(|n| n.contains(&typed) || typed.contains(n.as_str()))
        .collect();
    if !names.is_empty() {
        e.insert(ContextKind::SuggestedSubcommand, ContextValue::Strings(names));
    }
    e
}

/// The commit this binary was built from: the Makefile passes `git describe` in (read here, in the binary's crate, so
/// a new commit rebuilds only this file, not the library).
const COMMIT: Option<&str> = option_env!("DFLASH_COMMIT");

/// The command line; `--version` also says which commit and libtorch this build has and what it finds here (CUDA,
/// NVRTC).
fn parse() -> Cli {
    use clap::{CommandFactory, FromArgMatches};
    let mut command = Cli::command();
    if std::env::args().any(|a| a == "--version") {
        let text = dflash::device::build_and_machine(COMMIT.filter(|c| !c.is_empty()));
        command = command.long_version(&*Box::leak(text.into_boxed_str()));
    }
    let matches = command.try_get_matches().unwrap_or_else(|e| suggest_subcommand(e).exit());
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

fn main() -> ExitCode {
    let cli = parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            // A malformed `--set` is a bad command line, as clap's own errors are.
            match e.downcast_ref::<ConfigError>() {
                Some(ConfigError::BadOverride(_)) => ExitCode::from(2),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    if let Command::Completions { shell } = cli.command {
        use clap::CommandFactory;
        clap_complete::generate(shell, &mut Cli::command(), "dflash", &mut std::io::stdout());
        return Ok(ExitCode::SUCCESS);
    }
    let layers = Layers::from_process(cli.config.clone(), cli.set.clone());
    let config = Config::load(&layers)?;
    dflash::telemetry::logging::init(&config.log)?;
    install_panic_hook();
    if config.drafters.deterministic {
        dflash::device::deterministic_gpus().map_err(|e| anyhow::anyhow!("drafters.deterministic = true: {e}"))?;
    }
    match cli.command {
        Command::Bench(args) => cli::bench::run(&config, args),
        Command::Eval(args) => cli::eval::run(&config, args),
        Command::ServeTrain(args) => serve_train(config, layers, args),
        Command::Prepare(args) => cli::data::run_prepare(args),
        Command::Inspect(args) => cli::data::run_inspect(args),
        Command::SampleData(args) => cli::data::run_sample_data(args),
        Command::Regenerate(args) => cli::regenerate::run(&config, args),
        Command::Synthesize(args) => cli::synthesize::run(&config, args),
        Command::Export(args) => cli::export::run(args),
        Command::InspectRun(args) => cli::inspect_run::run(args),
        Command::Proxy(args) => cli::proxy::run(&config, args),
        Command::Config(command) => cli::config::run(&config, &layers, command).map(|()| ExitCode::SUCCESS),
        Command::Completions { .. } => unreachable!("answered before the configuration is read"),
    }
}

/// libtorch errors surface as panics inside tch and are reported by the code that catches them; log those
/// quietly, and anything else loudly with its location.
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let message = payload_message(info.payload());
        let location = info.location().map(|l| l.to_string()).unwrap_or_default();
        if is_torch_error(&message) {
            tracing::debug!(%location, "libtorch error: {message}");
        } else {
            tracing::error!(%location, "panic: {message}");
        }
    }));
}

//! The configuration of a training run: drafter devices, data, optimizer and run length, checkpoints,
//! supervision, the control plane and the hosts of the run. Raw (serde) sections and their validated forms (the
//! cluster's is `cluster::launch::ClusterSettings`, which the cluster owns); every error names the key, the value and
//! what is allowed.
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, invalid};
use crate::cluster::launch::ClusterSettings;
use crate::data::dataset::SyntheticLengths;
use crate::device::DeviceSpec;
use crate::ffi::accel::MuonIteration;
use crate::train::optim::MuonHyper;
use crate::train::{OptimizerKind, ScheduleKind};

fn at_least(key: &str, value: i64, min: i64) -> Result<usize, ConfigError> {
    if value < min {
        return Err(invalid(key, value, format!("must be at least {min}")));
    }
    Ok(value as usize)
}

fn finite_in(key: &str, value: f64, lo: f64, hi: f64, what: &str) -> Result<f64, ConfigError> {
    if !value.is_finite() || value < lo || value > hi {
        return Err(invalid(key, value, what.to_string()));
    }
    Ok(value)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDrafters {
    devices: Vec<String>,
    peak_tflops: f64,
    collective: String,
    collective_timeout_s: f64,
    deterministic: bool,
}

/// One drafter per entry; entries may name the same device.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftersSettings {
    pub devices: Vec<DeviceSpec>,
    /// The devices' bf16 matrix peak, for the MFU metric.
    pub peak_tflops: f64,
    pub collective: CollectiveKind,
    /// NCCL: the deadline of joining a communicator and of one all-reduce.
    pub collective_timeout: Duration,
    /// libtorch's deterministic algorithms on GPUs (the same run twice gives the same bits, a little slower).
    pub deterministic: bool,
}

/// How the drafters sum their gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollectiveKind {
    /// Device-to-device copies in member order.
    InProcess,
    /// An NCCL all-reduce, one rank per GPU.
    Nccl,
}

impl RawDrafters {
    pub(super) fn validate(self) -> Result<DraftersSettings, ConfigError> {
        if self.devices.is_empty() {
            return Err(invalid("drafters.devices", "[]", "needs at least one device, e.g. [\"cuda:0\"]"));
        }
        let devices: Vec<DeviceSpec> = self
            .devices
            .iter()
            .map(|d| {
                d.parse()
                    .map_err(|_| invalid("drafters.devices", format!("{d:?}"), "each entry is cpu, cuda:N or auto"))
            })
            .collect::<Result<_, _>>()?;
        let peak_tflops =
            finite_in("drafters.peak_tflops", self.peak_tflops, 1e-6, 1e6, "TFLOP/s > 0 (797 for an H200)")?;
        let collective = match self.collective.as_str() {
            "in_process" => CollectiveKind::InProcess,
            "nccl" => CollectiveKind::Nccl,
            other => return Err(invalid("drafters.collective", format!("{other:?}"), "\"in_process\" or \"nccl\"")),
        };
        if collective == CollectiveKind::Nccl {
            check_one_rank_per_gpu(&devices)?;
        }
        let timeout = finite_in("drafters.collective_timeout_s", self.collective_timeout_s, 0.1, 86400.0, "seconds")?;
        Ok(DraftersSettings {
            devices,
            peak_tflops,
            collective,
            collective_timeout: Duration::from_secs_f64(timeout),
            deterministic: self.deterministic,
        })
    }
}

/// NCCL runs one rank per GPU: every drafter device must be an explicit, distinct `cuda:N`.
fn check_one_rank_per_gpu(devices: &[DeviceSpec]) -> Result<(), ConfigError> {
    let mut seen = std::collections::BTreeSet::new();
    for d in devices {
        let DeviceSpec::Cuda(i) = d else {
            return Err(invalid(
                "drafters.devices",
                format!("{d}"),
                "with drafters.collective = \"nccl\" every entry is an explicit cuda:N (NCCL runs on GPUs only)",
            ));
        };
        if !seen.insert(*i) {
            return Err(invalid(
                "drafters.devices",
                format!("cuda:{i} twice"),
                "with drafters.collective = \"nccl\" each GPU is listed once (NCCL takes one rank per GPU)",
            ));
        }
    }
    Ok(())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawData {
    path: String,
    holdout: f64,
    batch_size: i64,
    pack: bool,
    pack_len: i64,
    max_len: i64,
    builtin_conversations: i64,
    builtin_max_new_tokens: i64,
    cache_dir: String,
    ledger: String,
    ledger_max_failures: i64,
    allow_other_tokenizer: bool,
    stream: String,
    stream_mix: f64,
    stream_answers: String,
    stream_min_conversations: i64,
    stream_max_wait_s: f64,
    stream_poll_s: f64,
}

/// Where training samples come from.
#[derive(Debug, Clone, PartialEq)]
pub enum DataSource {
    /// The built-in sample conversations, regenerated by the target and prepared into `cache_dir` once.
    Builtin,
    /// Random tokens (benchmarking the service at real shapes without a tokenizer): every row `max_len` tokens, all
    /// supervised (`"synthetic"`), or lengths drawn like chat data's (`"synthetic-chat"`).
    Synthetic(SyntheticLengths),
    /// A folder written by `dflash prepare`.
    Prepared(PathBuf),
    /// A JSONL file of token rows (`{"id"?, "input_ids", "loss_mask"}`), checked against the target and prepared
    /// into `cache_dir` once.
    TokenRows(PathBuf),
}

#[derive(Debug, Clone, PartialEq)]
pub struct DataSettings {
    pub source: DataSource,
    /// Token-row files: the fraction of rows kept apart as the holdout split (by a hash of the id).
    pub holdout: f64,
    /// Sequences per drafter per micro-batch (rows, when packed).
    pub batch_size: usize,
    /// Several conversations per row, up to this many tokens (`data.pack`, `data.pack_len`); `None`: one per row.
    pub pack: Option<usize>,
    /// Built-in data: conversations are truncated to this many tokens.
    pub max_len: usize,
    pub builtin_conversations: usize,
    pub builtin_max_new_tokens: usize,
    pub cache_dir: PathBuf,
    /// Append every committed batch's sample ids here (JSON lines), as an audit trail; `None`: off.
    pub ledger: Option<PathBuf>,
    /// Ledger writes failing this many times in a row end the run (checkpoint, exit 75).
    pub ledger_max_failures: u32,
    /// Train on a prepared folder whose tokenizer and chat template are not the target's (refused otherwise).
    pub allow_other_tokenizer: bool,
    /// `data.stream`: keep learning from conversations arriving in a folder; `None`: off.
    pub stream: Option<StreamSettings>,
}

/// `data.stream` and its settings: the folder the recording proxy seals segments into (or chat JSONL is dropped in),
/// taken in waves ([`crate::data::stream`]), each an epoch with replay of what came before.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamSettings {
    pub dir: PathBuf,
    /// The share of each wave's epoch drawn from earlier data (`data.stream_mix`), in `[0, 1)`.
    pub mix: f64,
    pub answers: crate::data::stream::Answers,
    /// A wave is made once this many new conversations qualify,
    pub min_conversations: usize,
    /// or once the oldest new file has waited this long (`None`: no bound).
    pub max_wait: Option<std::time::Duration>,
    /// How often the folder is looked at.
    pub poll: std::time::Duration,
}

impl RawData {
    pub(super) fn validate(self) -> Result<DataSettings, ConfigError> {
        let source = match self.path.as_str() {
            "builtin" => DataSource::Builtin,
            "synthetic" => DataSource::Synthetic(SyntheticLengths::Full),
            "synthetic-chat" => DataSource::Synthetic(SyntheticLengths::Chat),
            "" => {
                return Err(invalid(
                    "data.path",
                    "\"\"",
                    "\"builtin\", a folder written by `dflash prepare`, or a JSONL file of token rows",
                ));
            }
            p if p.ends_with(".jsonl") || Path::new(p).is_file() => DataSource::TokenRows(PathBuf::from(p)),
            p => DataSource::Prepared(PathBuf::from(p)),
        };
        if !(0.0..1.0).contains(&self.holdout) {
            return Err(invalid("data.holdout", self.holdout, "a fraction in [0, 1)"));
        }
        Ok(DataSettings {
            source,
            holdout: self.holdout,
            batch_size: at_least("data.batch_size", self.batch_size, 1)?,
            pack: match self.pack {
                true => Some(at_least("data.pack_len", self.pack_len, 2)?),
                false => None,
            },
            max_len: at_least("data.max_len", self.max_len, 2)?,
            builtin_conversations: at_least("data.builtin_conversations", self.builtin_conversations, 1)?,
            builtin_max_new_tokens: at_least("data.builtin_max_new_tokens", self.builtin_max_new_tokens, 1)?,
            cache_dir: PathBuf::from(self.cache_dir),
            ledger: (!self.ledger.is_empty()).then(|| PathBuf::from(self.ledger)),
            ledger_max_failures: at_least("data.ledger_max_failures", self.ledger_max_failures, 1)? as u32,
            allow_other_tokenizer: self.allow_other_tokenizer,
            stream: match self.stream.as_str() {
                "" => None,
                dir => Some(StreamSettings {
                    dir: PathBuf::from(dir),
                    mix: match self.stream_mix {
                        m if (0.0..1.0).contains(&m) => m,
                        m => return Err(invalid("data.stream_mix", m, "a fraction in [0, 1)")),
                    },
                    answers: match self.stream_answers.as_str() {
                        "greedy" => crate::data::stream::Answers::Greedy,
                        "all" => crate::data::stream::Answers::All,
                        other => {
                            return Err(invalid("data.stream_answers", format!("{other:?}"), "\"greedy\" or \"all\""));
                        }
                    },
                    min_conversations: at_least("data.stream_min_conversations", self.stream_min_conversations, 1)?,
                    max_wait: match self.stream_max_wait_s {
                        0.0 => None,
                        s if s > 0.0 && s.is_finite() => Some(std::time::Duration::from_secs_f64(s)),
                        s => return Err(invalid("data.stream_max_wait_s", s, "seconds >= 0 (0: no bound)")),
                    },
                    poll: match self.stream_poll_s {
                        s if s > 0.0 && s.is_finite() => std::time::Duration::from_secs_f64(s),
                        s => return Err(invalid("data.stream_poll_s", s, "seconds > 0")),
                    },
                }),
            },
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOptim {
    lr: f64,
    betas: Vec<f64>,
    eps: f64,
    weight_decay: f64,
    schedule: String,
    warmup_ratio: f64,
    warmup_steps: i64,
    min_lr_ratio: f64,
    grad_clip: f64,
    accumulation: i64,
    epochs: i64,
    max_steps: i64,
    optimizer: String,
    muon_lr: f64,
    muon_momentum: f64,
    muon_weight_decay: f64,
    muon_ns_steps: i64,
    muon_iteration: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct OptimSettings {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub schedule: ScheduleKind,
    /// Warmup, as a fraction of the run's samples.
    pub warmup_ratio: f64,
    /// Warmup in steps, instead of `warmup_ratio` (0: the ratio), for runs whose schedule counts steps.
    pub warmup_steps: u64,
    pub min_lr_ratio: f64,
    /// `None`: no clipping.
    pub grad_clip: Option<f64>,
    /// Micro-batches per drafter per step.
    pub accumulation: usize,
    pub epochs: u64,
    /// 0: no limit besides `epochs`.
    pub max_steps: u64,
    pub optimizer: OptimizerKind,
    /// Muon's hyperparameters (used with `optimizer = Muon`).
    pub muon: MuonHyper,
}

impl RawOptim {
    pub(super) fn validate(self) -> Result<OptimSettings, ConfigError> {
        let lr = finite_in("optim.lr", self.lr, 0.0, 1.0, "a learning rate in [0, 1]")?;
        let [beta1, beta2] = self.betas[..] else {
            return Err(invalid("optim.betas", format!("{:?}", self.betas), "two numbers, e.g. [0.9, 0.999]"));
        };
        for b in [beta1, beta2] {
            finite_in("optim.betas", b, 0.0, 0.999999, "each beta is in [0, 1)")?;
        }
        let schedule = match self.schedule.as_str() {
            "cosine" => ScheduleKind::Cosine,
            "constant" => ScheduleKind::Constant,
            other => {
                return Err(invalid("optim.schedule", format!("{other:?}"), "\"cosine\" or \"constant\""));
            }
        };
        let grad_clip = finite_in("optim.grad_clip", self.grad_clip, 0.0, f64::MAX, "a norm >= 0 (0: no clipping)")?;
        Ok(OptimSettings {
            lr,
            beta1,
            beta2,
            eps: finite_in("optim.eps", self.eps, 1e-30, 1.0, "a small positive number")?,
            weight_decay: finite_in("optim.weight_decay", self.weight_decay, 0.0, 1.0, "in [0, 1]")?,
            schedule,
            warmup_ratio: finite_in("optim.warmup_ratio", self.warmup_ratio, 0.0, 1.0, "a fraction in [0, 1]")?,
            warmup_steps: at_least("optim.warmup_steps", self.warmup_steps, 0)? as u64,
            min_lr_ratio: finite_in("optim.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0, "a fraction in [0, 1]")?,
            grad_clip: (grad_clip > 0.0).then_some(grad_clip),
            accumulation: at_least("optim.accumulation", self.accumulation, 1)?,
            epochs: at_least("optim.epochs", self.epochs, 1)? as u64,
            max_steps: at_least("optim.max_steps", self.max_steps, 0)? as u64,
            optimizer: match self.optimizer.as_str() {
                "adamw" => OptimizerKind::AdamW,
                "muon" => OptimizerKind::Muon,
                other => return Err(invalid("optim.optimizer", format!("{other:?}"), "\"adamw\" or \"muon\"")),
            },
            muon: MuonHyper {
                lr: finite_in("optim.muon_lr", self.muon_lr, 0.0, 1.0, "a learning rate in [0, 1]")?,
                momentum: finite_in("optim.muon_momentum", self.muon_momentum, 0.0, 0.999999, "in [0, 1)")?,
                weight_decay: finite_in("optim.muon_weight_decay", self.muon_weight_decay, 0.0, 1.0, "in [0, 1]")?,
                ns_steps: match self.muon_ns_steps {
                    n @ 1..=99 => n as u32,
                    n => return Err(invalid("optim.muon_ns_steps", n, "Newton-Schulz steps in 1..=99 (5 is Muon's)")),
                },
                iteration: match self.muon_iteration.as_str() {
                    "newton-schulz" => MuonIteration::NewtonSchulz,
                    "gram" => MuonIteration::Gram,
                    other => {
                        let expected = "\"newton-schulz\" (torch.optim.Muon's) or \"gram\" (Gram Newton-Schulz)";
                        return Err(invalid("optim.muon_iteration", format!("{other:?}"), expected));
                    }
                },
            },
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCheckpoint {
    dir: String,
    every_steps: i64,
    every_seconds: f64,
    keep: i64,
    lock: bool,
    lock_wait_s: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointSettings {
    pub dir: PathBuf,
    /// 0: not by steps.
    pub every_steps: u64,
    /// 0: not by time.
    pub every_seconds: f64,
    pub keep: usize,
    /// Hold an OS lock on `dir` while running (one writer per folder).
    pub lock: bool,
    /// How long a process that finds `dir` locked waits before it exits 75.
    pub lock_wait_s: f64,
}

impl RawCheckpoint {
    pub(super) fn validate(self) -> Result<CheckpointSettings, ConfigError> {
        if self.dir.is_empty() {
            return Err(invalid("checkpoint.dir", "\"\"", "a folder for checkpoints"));
        }
        Ok(CheckpointSettings {
            dir: PathBuf::from(self.dir),
            every_steps: at_least("checkpoint.every_steps", self.every_steps, 0)? as u64,
            every_seconds: finite_in(
                "checkpoint.every_seconds",
                self.every_seconds,
                0.0,
                1e9,
                "seconds >= 0 (0: off)",
            )?,
            keep: at_least("checkpoint.keep", self.keep, 2)?,
            lock: self.lock,
            lock_wait_s: finite_in("checkpoint.lock_wait_s", self.lock_wait_s, 0.0, 1e7, "seconds >= 0")?,
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSupervision {
    max_restarts: i64,
    restart_window_s: f64,
    backoff_initial_ms: i64,
    backoff_max_ms: i64,
    step_timeout_s: f64,
    hang_factor: f64,
    hang_floor_s: f64,
    shutdown_timeout_s: f64,
    min_live_drafters: i64,
    gpu_hang_limit: i64,
    prefetch_steps: i64,
    check_replicas_every: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SupervisionSettings {
    /// At most this many restarts of one drafter within `restart_window_s`; one more marks it failed.
    pub max_restarts: usize,
    pub restart_window_s: f64,
    pub backoff_initial_ms: u64,
    pub backoff_max_ms: u64,
    /// The longest any wait of a step may take: the hang budget until a few rounds are measured, and its ceiling.
    /// Starting a drafter or a target copy may take twice this.
    pub step_timeout_s: f64,
    /// The measured hang budget: this many times the recent p99 time between committed rounds...
    pub hang_factor: f64,
    /// ...and never less than this.
    pub hang_floor_s: f64,
    /// How long the end of a run (SIGTERM, completion, a failure that ends it) may wait for its checkpoint.
    pub shutdown_timeout_s: f64,
    /// Below this many live drafters the run checkpoints and stops.
    pub min_live_drafters: usize,
    /// Hangs on one device after which its drafters are not restarted.
    pub gpu_hang_limit: usize,
    /// Steps of features prepared ahead of the drafters.
    pub prefetch_steps: usize,
    /// Every this many steps the replicas' checksums are compared (0: never).
    pub check_replicas_every: u64,
}

impl RawSupervision {
    pub(super) fn validate(self) -> Result<SupervisionSettings, ConfigError> {
        let initial = at_least("supervision.backoff_initial_ms", self.backoff_initial_ms, 0)? as u64;
        let max = at_least("supervision.backoff_max_ms", self.backoff_max_ms, 0)? as u64;
        if max < initial {
            return Err(invalid(
                "supervision.backoff_max_ms",
                max,
                format!("must be >= backoff_initial_ms ({initial})"),
            ));
        }
        Ok(SupervisionSettings {
            max_restarts: at_least("supervision.max_restarts", self.max_restarts, 0)?,
            restart_window_s: finite_in(
                "supervision.restart_window_s",
                self.restart_window_s,
                0.0,
                1e9,
                "seconds >= 0",
            )?,
            backoff_initial_ms: initial,
            backoff_max_ms: max,
            step_timeout_s: finite_in("supervision.step_timeout_s", self.step_timeout_s, 0.01, 1e9, "seconds > 0")?,
            hang_factor: finite_in("supervision.hang_factor", self.hang_factor, 1.0, 1e6, "a factor >= 1")?,
            hang_floor_s: finite_in("supervision.hang_floor_s", self.hang_floor_s, 0.0, 1e9, "seconds >= 0")?,
            shutdown_timeout_s: finite_in(
                "supervision.shutdown_timeout_s",
                self.shutdown_timeout_s,
                0.01,
                1e9,
                "seconds > 0",
            )?,
            min_live_drafters: at_least("supervision.min_live_drafters", self.min_live_drafters, 1)?,
            gpu_hang_limit: at_least("supervision.gpu_hang_limit", self.gpu_hang_limit, 1)?,
            prefetch_steps: at_least("supervision.prefetch_steps", self.prefetch_steps, 1)?,
            check_replicas_every: at_least("supervision.check_replicas_every", self.check_replicas_every, 0)? as u64,
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawControl {
    listen: String,
    read_only_listen: String,
    token_file: String,
    fault_injection: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ControlSettings {
    /// `None`: no control plane.
    pub listen: Option<SocketAddr>,
    /// Where the read-only endpoints are also served alone (`None`: nowhere else).
    pub read_only_listen: Option<SocketAddr>,
    /// A file holding the bearer token of the `POST` endpoints (`DFLASH_CONTROL_TOKEN` wins).
    pub token_file: Option<PathBuf>,
    pub fault_injection: bool,
}

impl RawControl {
    pub(super) fn validate(self) -> Result<ControlSettings, ConfigError> {
        let address = |key: &str, value: &str| match value {
            "" | "off" => Ok(None),
            addr => addr
                .parse()
                .map(Some)
                .map_err(|_| invalid(key, format!("{addr:?}"), "an address like \"127.0.0.1:9410\", or \"off\"")),
        };
        Ok(ControlSettings {
            listen: address("control.listen", &self.listen)?,
            read_only_listen: address("control.read_only_listen", &self.read_only_listen)?,
            token_file: (!self.token_file.is_empty()).then(|| PathBuf::from(self.token_file)),
            fault_injection: self.fault_injection,
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEval {
    every_steps: i64,
    prompts: String,
    num_prompts: i64,
    max_new_tokens: i64,
    cuda_graphs: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPublish {
    dir: String,
    keep: i64,
    margin: f64,
}

/// Publishing the drafter as it improves (`[publish]`): each evaluation that decodes losslessly and beats the
/// published drafter by `margin` is exported to `dir/vN`, and `dir/current` flips to it.
#[derive(Debug, Clone, PartialEq)]
pub struct PublishSettings {
    /// `None`: nothing is published.
    pub dir: Option<PathBuf>,
    /// Versions kept (the current one always).
    pub keep: usize,
    /// Tokens per target step a drafter must gain over the published one.
    pub margin: f64,
}

impl RawPublish {
    pub(super) fn validate(self) -> Result<PublishSettings, ConfigError> {
        if !(self.margin.is_finite() && self.margin >= 0.0) {
            return Err(invalid("publish.margin", self.margin, "a number of tokens per target step, 0 or more"));
        }
        Ok(PublishSettings {
            dir: (!self.dir.is_empty()).then(|| PathBuf::from(&self.dir)),
            keep: at_least("publish.keep", self.keep, 1)?,
            margin: self.margin,
        })
    }
}

/// Where evaluation prompts come from.
#[derive(Debug, Clone, PartialEq)]
pub enum EvalPrompts {
    /// The prepared data's `holdout` split, cut where the first assistant reply starts.
    Holdout,
    /// A JSONL file of prompts (token ids or chat messages).
    File(PathBuf),
    /// `data.stream`'s recent traffic: the held-out conversations of its newest waves (never trained on), read again
    /// at every evaluation; the prepared data's `holdout` split until a wave holds some out.
    Stream,
}

/// The decoded acceptance length measured during training.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalSettings {
    /// 0: off.
    pub every_steps: u64,
    pub prompts: EvalPrompts,
    pub num_prompts: usize,
    pub max_new_tokens: usize,
    /// On a GPU, the target's decoding steps and the drafter's passes replay from CUDA graphs (shorter evaluations
    /// that cost training more; see `config/default.toml`).
    pub cuda_graphs: bool,
}

impl RawEval {
    pub(super) fn validate(self) -> Result<EvalSettings, ConfigError> {
        let prompts = match self.prompts.as_str() {
            "holdout" => EvalPrompts::Holdout,
            "stream" => EvalPrompts::Stream,
            "" => {
                return Err(invalid("eval.prompts", "\"\"", "\"holdout\", \"stream\" or a JSONL file of prompts"));
            }
            path => EvalPrompts::File(PathBuf::from(path)),
        };
        Ok(EvalSettings {
            every_steps: at_least("eval.every_steps", self.every_steps, 0)? as u64,
            prompts,
            num_prompts: at_least("eval.num_prompts", self.num_prompts, 1)?,
            max_new_tokens: at_least("eval.max_new_tokens", self.max_new_tokens, 1)?,
            cuda_graphs: self.cuda_graphs,
        })
    }
}

/// The `[cluster]` section as written: 0, -1 and "" leave a key to the environment.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawCluster {
    hosts: i64,
    rank: i64,
    master_addr: String,
    master_port: i64,
    rendezvous_timeout_s: f64,
    round_timeout_s: f64,
    leader_timeout_s: f64,
}

impl RawCluster {
    pub(crate) fn validate(self) -> Result<ClusterSettings, ConfigError> {
        let hosts = match self.hosts {
            0 => None,
            n if n > 0 => Some(n as usize),
            n => return Err(invalid("cluster.hosts", n, "a number of hosts >= 1, or 0 for the environment's")),
        };
        let rank = match self.rank {
            -1 => None,
            n if n >= 0 => Some(n as usize),
            n => return Err(invalid("cluster.rank", n, "this host's rank (0-based), or -1 for the environment's")),
        };
        let master_port = match self.master_port {
            0 => None,
            p => Some(u16::try_from(p).map_err(|_| invalid("cluster.master_port", p, "a TCP port, or 0"))?),
        };
        if !(self.rendezvous_timeout_s > 0.0 && self.rendezvous_timeout_s.is_finite()) {
            return Err(invalid("cluster.rendezvous_timeout_s", self.rendezvous_timeout_s, "seconds > 0"));
        }
        if !(self.round_timeout_s > 0.0 && self.round_timeout_s.is_finite()) {
            return Err(invalid("cluster.round_timeout_s", self.round_timeout_s, "seconds > 0"));
        }
        if !(self.leader_timeout_s > 0.0 && self.leader_timeout_s.is_finite()) {
            return Err(invalid("cluster.leader_timeout_s", self.leader_timeout_s, "seconds > 0"));
        }
        Ok(ClusterSettings {
            hosts,
            rank,
            master_addr: Some(self.master_addr).filter(|a| !a.is_empty()),
            master_port,
            rendezvous_timeout: Duration::from_secs_f64(self.rendezvous_timeout_s),
            round_timeout: Duration::from_secs_f64(self.round_timeout_s),
            leader_timeout: Duration::from_secs_f64(self.leader_timeout_s),
        })
    }
}

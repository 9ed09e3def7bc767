//! Configuration: the built-in `config/default.toml`, then the user's file, then `DFLASH__SECTION__KEY` environment
//! variables, then `--set section.key=value`, each layer overriding the one before. The merged tree is read into raw
//! serde structs (unknown keys are errors) and then validated into [`Config`], whose errors name the key, the value
//! and what is allowed.
//!
//! Override values are read as TOML values where they parse as one (`3e-4`, `true`, `["cuda:0", "cuda:1"]`) and as
//! plain strings otherwise (`cuda:0`, `tiny`).
use std::collections::BTreeMap;
use std::path::PathBuf;

mod earlier_defaults;
mod proxy;
mod training;

pub use earlier_defaults::{as_overrides, as_trained, first_defaults, kept_from_run};
pub use proxy::{ProxyConfig, RedactRule, upstream_url};
pub use training::{
    CheckpointSettings, CollectiveKind, ControlSettings, DataSettings, DataSource, DraftersSettings, EvalPrompts,
    EvalSettings, OptimSettings, PublishSettings, StreamSettings, SupervisionSettings,
};

use config::{File, FileFormat, Value, ValueKind};
use serde::Deserialize;

use crate::data::prepare::ModelAssets;
use crate::device::{DeviceSpec, DtypeSpec};
use crate::model::drafter_config::{auto_target_layer_ids, default_gamma};
use crate::model::presets::{PresetSpec, no_such_model};
use crate::model::{Depth, ModelError, Preset, Target};
use crate::model::{LayerAttention, Variant};
use crate::train::{ObjectiveSettings, Teacher};
use tch::{Device, Kind};

/// The built-in defaults, the lowest layer; every key users can set is here, with its documentation.
pub const DEFAULT_TOML: &str = include_str!("../../config/default.toml");

/// Prefix of environment overrides: `DFLASH__TARGET__DEVICE=cpu` sets `target.device`.
pub const ENV_PREFIX: &str = "DFLASH__";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{source_name}: {message}")]
    Load { source_name: String, message: String },
    #[error("{key} = {value}: {allowed}")]
    Invalid { key: String, value: String, allowed: String },
    #[error("--set {0:?}: write section.key=value, for example --set target.device=cpu")]
    BadOverride(String),
}

pub(crate) fn invalid(key: &str, value: impl std::fmt::Display, allowed: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.to_string(), value: value.to_string(), allowed: allowed.into() }
}

// ---------------------------------------------------------------- raw: what the files say

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    target: RawTarget,
    draft_model: RawDraftModel,
    drafters: training::RawDrafters,
    data: training::RawData,
    objective: RawObjective,
    optim: training::RawOptim,
    checkpoint: training::RawCheckpoint,
    supervision: training::RawSupervision,
    eval: training::RawEval,
    publish: training::RawPublish,
    control: training::RawControl,
    cluster: training::RawCluster,
    log: RawLog,
    proxy: proxy::RawProxy,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTarget {
    model: String,
    device: String,
    dtype: String,
    capture_devices: RawCaptureDevices,
    spread_to: Vec<String>,
    micro_batches: usize,
}

/// `capture_devices` is a list of devices or the word `colocated`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawCaptureDevices {
    List(Vec<String>),
    Word(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDraftModel {
    num_hidden_layers: i64,
    block_size: i64,
    intermediate_size: Option<i64>,
    target_layer_ids: Option<RawTaps>,
    mask_token_id: Option<RawMask>,
    init: Option<String>,
    layer_types: RawLayerTypes,
    sliding_window: i64,
    block_causal: RawCausal,
    variant: String,
    conv_kernel_size: i64,
    conv_group_size: i64,
    selector_rank: i64,
    selector_top_k: i64,
}

/// `layer_types`: one type for every layer, or a list with one per layer.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawLayerTypes {
    Every(String),
    Each(Vec<String>),
}

/// `block_causal`: `auto`, or true or false for every layer.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawCausal {
    Every(bool),
    Word(String),
}

/// `mask_token_id` is a token id, or the word `auto`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawMask {
    Id(i64),
    Word(String),
}

/// `target_layer_ids` is a list of ids, or the word `auto`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawTaps {
    Ids(Vec<i64>),
    Word(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawObjective {
    num_anchors: i64,
    gamma: RawGamma,
    weights: String,
    dpace_alpha: f64,
    target: String,
    loss: String,
    selector_loss_alpha: f64,
    seed: i64,
}

/// `gamma` is a number, or the word `auto` or `none`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawGamma {
    Number(f64),
    Word(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLog {
    level: String,
    format: String,
    every_steps: i64,
    tensorboard: bool,
}

// ---------------------------------------------------------------- validated: what the program uses

/// Where the target's weights come from.
#[derive(Debug, Clone, PartialEq)]
pub enum TargetSource {
    /// Random weights in a built-in shape.
    Preset(Preset),
    /// A HuggingFace model folder.
    Folder(PathBuf),
}

impl TargetSource {
    /// A command-line `--target`/`--model` value: a preset name, else a model folder.
    pub fn from_arg(value: &str) -> Self {
        match value.parse() {
            Ok(preset) => TargetSource::Preset(preset),
            Err(_) => TargetSource::Folder(PathBuf::from(value)),
        }
    }

    /// The tokenizer and chat template conversations are rendered with: the folder's, or the tiny presets' built-in
    /// ones; the other presets have none.
    pub fn chat_assets(
        &self,
        template_kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<ModelAssets, String> {
        match self {
            TargetSource::Folder(dir) => {
                ModelAssets::resolve(&dir.to_string_lossy(), template_kwargs).map_err(|e| e.to_string())
            }
            TargetSource::Preset(p) if p.is_tiny() => Ok(ModelAssets::tiny(template_kwargs)),
            TargetSource::Preset(p) => Err(format!("the {p} preset has no tokenizer (use token-id prompts)")),
        }
    }

    /// The target with tapped layers `taps`: the preset's random weights, or the folder's.
    pub fn build_target(&self, taps: &[usize], depth: Depth, device: Device, kind: Kind) -> Result<Target, ModelError> {
        self.build_target_spread(taps, depth, &[device], kind)
    }

    /// [`TargetSource::build_target`] with the decoder layers spread over `devices` (the first holds the rest).
    pub fn build_target_spread(
        &self,
        taps: &[usize],
        depth: Depth,
        devices: &[Device],
        kind: Kind,
    ) -> Result<Target, ModelError> {
        match self {
            TargetSource::Preset(p) => {
                PresetSpec { taps: taps.to_vec(), ..p.spec() }.build_target_spread(depth, devices, kind)
            }
            TargetSource::Folder(dir) => Target::load_spread(dir, taps, depth, devices, kind),
        }
    }
}

impl std::fmt::Display for TargetSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TargetSource::Preset(p) => write!(f, "{p}"),
            TargetSource::Folder(dir) => write!(f, "{}", dir.display()),
        }
    }
}

/// Where `serve-train` runs target copies that capture features for the drafters.
#[derive(Debug, Clone, PartialEq)]
pub enum CapturePlacement {
    /// One target on `target.device`, feeding every drafter.
    TargetDevice,
    /// One target on each distinct device of `drafters.devices`, feeding the drafters there.
    Colocated,
    /// One target on each listed device; a drafter is fed by one on its own device if any, else by any, spread evenly.
    Devices(Vec<DeviceSpec>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct TargetSettings {
    pub source: TargetSource,
    pub device: DeviceSpec,
    pub dtype: DtypeSpec,
    pub capture: CapturePlacement,
    /// Devices the target copy spreads its later decoder layers over (`target.spread_to`).
    pub spread_to: Vec<DeviceSpec>,
    /// Micro-batches a spread target's capture is cut into (`target.micro_batches`; 0: 4 per device).
    pub micro_batches: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DraftModelSettings {
    pub num_hidden_layers: usize,
    pub block_size: usize,
    /// `None`: the target's.
    pub intermediate_size: Option<usize>,
    /// Explicit ids, `auto`, or `None`: the preset's, or `auto` for a model folder.
    pub target_layer_ids: Option<Taps>,
    /// `None` (`auto`, or unset): the preset's, or for a model folder the rule of
    /// [`TextTokenizer::unused_mask_token`](crate::data::tokenize::TextTokenizer::unused_mask_token).
    pub mask_token_id: Option<i64>,
    /// A published drafter folder whose weights a new run starts from (`None`: random weights).
    pub init: Option<PathBuf>,
    /// Each layer's sliding window and causality (`layer_types`, `sliding_window`, `block_causal`).
    pub layer_attention: Vec<LayerAttention>,
    /// DFlash or DFlash 2 (`variant`, with DFlash 2's sizes).
    pub variant: Variant,
}

/// The target layers the drafter reads.
#[derive(Debug, Clone, PartialEq)]
pub enum Taps {
    /// z-lab's rule for the target's depth and the drafter's ([`auto_target_layer_ids`]).
    Auto,
    Ids(Vec<usize>),
}

/// The decay of the loss weights over block slots.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Gamma {
    /// DFLASH.md's value for the block size (7 for 16, 5 for 10, 4 for 8).
    Auto,
    /// No decay.
    None,
    Value(f64),
}

impl Gamma {
    /// The decay for `block_size`; `Auto` has no value for block sizes outside the paper's table.
    pub fn resolve(self, block_size: usize) -> Result<Option<f64>, ConfigError> {
        match self {
            Gamma::None => Ok(None),
            Gamma::Value(g) => Ok(Some(g)),
            Gamma::Auto => default_gamma(block_size).map(Some).ok_or_else(|| {
                invalid(
                    "objective.gamma",
                    "\"auto\"",
                    format!("has no default for block size {block_size} (only 16, 10, 8): set a number or \"none\""),
                )
            }),
        }
    }
}

impl std::str::FromStr for Gamma {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Gamma::Auto),
            "none" => Ok(Gamma::None),
            n => match n.parse::<f64>() {
                Ok(g) if g.is_finite() && g > 0.0 => Ok(Gamma::Value(g)),
                _ => Err(format!("gamma {n:?}: expected a positive number, auto or none")),
            },
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ObjectiveConfig {
    pub num_anchors: usize,
    pub gamma: Gamma,
    /// How block slots are weighted in the loss.
    pub weights: SlotWeights,
    /// What a slot learns to predict (`objective.target` with `objective.loss`).
    pub teacher: Teacher,
    /// DFlash 2: the selector's loss weight beside the unary loss.
    pub selector_loss_alpha: f64,
    /// Keys anchor sampling (with epoch and sample id) and the drafter's initial weights.
    pub seed: u64,
}

impl ObjectiveConfig {
    /// D-PACE's alpha when the slots are weighted by it.
    pub fn dpace_alpha(&self) -> Option<f64> {
        match self.weights {
            SlotWeights::Decay => None,
            SlotWeights::Dpace { alpha } => Some(alpha),
        }
    }

    /// The objective's settings for a drafter of `block_size` with `mask_token_id`: this section's recipe (slot
    /// weights, what the slots learn) with `num_anchors` blocks a row and the decay `gamma`, which the caller resolves
    /// (a reload or `eval`'s flags may change them).
    pub fn settings(
        &self,
        num_anchors: usize,
        block_size: usize,
        gamma: Option<f64>,
        mask_token_id: i64,
    ) -> ObjectiveSettings {
        ObjectiveSettings {
            dpace_alpha: self.dpace_alpha(),
            teacher: self.teacher,
            selector_loss_alpha: self.selector_loss_alpha,
            ..ObjectiveSettings::new(num_anchors, block_size, gamma, mask_token_id)
        }
    }
}

/// `objective.weights`: how the loss weighs the slots of a block.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SlotWeights {
    /// `exp(-(k-1)/gamma)` (the paper's; `objective.gamma`).
    Decay,
    /// D-PACE with this `objective.dpace_alpha`: each slot weighed by the chance that the draft is accepted up to it,
    /// from the drafter's own confidence (detached), normalised by the supervised slots.
    Dpace { alpha: f64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LogSettings {
    /// A tracing filter directive (`info`, `dflash=debug,warn`); `RUST_LOG` overrides it.
    pub level: String,
    pub format: LogFormat,
    /// Training logs a progress line every this many steps.
    pub every_steps: u64,
    /// TensorBoard event files in `checkpoint.dir/tensorboard` (the progress lines' and evaluations' scalars).
    pub tensorboard: bool,
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub target: TargetSettings,
    pub draft_model: DraftModelSettings,
    pub drafters: DraftersSettings,
    pub data: DataSettings,
    pub objective: ObjectiveConfig,
    pub optim: OptimSettings,
    pub checkpoint: CheckpointSettings,
    pub supervision: SupervisionSettings,
    pub eval: EvalSettings,
    pub publish: PublishSettings,
    pub control: ControlSettings,
    /// The `[cluster]` keys set (several hosts; the launcher's environment fills in the rest).
    pub cluster: crate::cluster::launch::ClusterSettings,
    pub log: LogSettings,
    /// `[proxy]`: what `dflash proxy` records (not the run's: reloads and resumes do not compare it).
    pub proxy: ProxyConfig,
    /// The merged configuration as read (before validation), for checkpoints and comparisons.
    pub merged: serde_json::Value,
}

/// The layers above the built-in defaults.
#[derive(Debug, Default, Clone)]
pub struct Layers {
    /// A TOML file written by the user.
    pub file: Option<PathBuf>,
    /// `(NAME, value)` pairs from the environment; only `DFLASH__*` names are read.
    pub env: Vec<(String, String)>,
    /// `section.key=value` strings from `--set`.
    pub set: Vec<String>,
}

impl Layers {
    /// The user's file and `--set` values, with the process environment.
    pub fn from_process(file: Option<PathBuf>, set: Vec<String>) -> Self {
        Layers { file, env: std::env::vars().collect(), set }
    }

    /// Which layer set `section.key` last: `--set`, an environment variable, the file, or the built-in default.
    pub fn origin(&self, key: &str) -> String {
        let set = self.set.iter().rev().find(|item| item.split_once('=').is_some_and(|(k, _)| k.trim() == key));
        if set.is_some() {
            return "--set".into();
        }
        let env = format!("{ENV_PREFIX}{}", key.to_uppercase().replace('.', "__"));
        if self.env.iter().any(|(name, _)| *name == env) {
            return format!("environment {env}");
        }
        let in_file = self.file.as_ref().and_then(|path| {
            let tree: toml::Table = std::fs::read_to_string(path).ok()?.parse().ok()?;
            let (section, name) = key.split_once('.')?;
            tree.get(section)?.as_table()?.get(name).map(|_| path.display().to_string())
        });
        in_file.unwrap_or_else(|| "default".into())
    }
}

impl Config {
    /// Merges the layers and validates the result.
    pub fn load(layers: &Layers) -> Result<Self, ConfigError> {
        let mut builder = config::Config::builder().add_source(File::from_str(DEFAULT_TOML, FileFormat::Toml));
        let mut origin = "built-in config/default.toml".to_string();
        if let Some(path) = &layers.file {
            if !path.is_file() {
                return Err(ConfigError::Load {
                    source_name: path.display().to_string(),
                    message: "no such file; pass --config with a TOML file (`dflash config defaults` prints every key)"
                        .into(),
                });
            }
            builder = builder.add_source(File::from(path.as_path()).format(FileFormat::Toml));
            origin = path.display().to_string();
        }
        for (name, raw) in &layers.env {
            let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
                continue;
            };
            let key = rest.to_lowercase().replace("__", ".");
            builder = builder.set_override(&key, parse_value(raw)).map_err(|e| load_error(name, e))?;
        }
        for item in &layers.set {
            let (key, raw) = item
                .split_once('=')
                .filter(|(k, _)| k.contains('.') && !k.trim().is_empty())
                .ok_or_else(|| ConfigError::BadOverride(item.clone()))?;
            builder = builder
                .set_override(key.trim(), parse_value(raw.trim()))
                .map_err(|e| load_error(&format!("--set {item}"), e))?;
        }
        let merged = builder.build().map_err(|e| load_error(&origin, e))?;
        let tree: serde_json::Value = merged
            .try_deserialize()
            .map_err(|e| ConfigError::Load { source_name: "configuration".into(), message: e.to_string() })?;
        // Read from the merged tree strictly (4.5 is not a batch size), naming the key of a bad value.
        let raw: RawConfig = serde_path_to_error::deserialize(&tree).map_err(|e| ConfigError::Load {
            source_name: "configuration".into(),
            message: explain_serde_error(&format!("{}: {}", e.path(), e.inner())),
        })?;
        raw.validate(tree)
    }

    /// The built-in defaults alone.
    pub fn builtin() -> Result<Self, ConfigError> {
        Self::load(&Layers::default())
    }

    /// Writes what `auto` resolved to (the taps, the MASK token) into the settings and the merged tree, which
    /// every checkpoint keeps; settings that were not `auto` are left as they are.
    pub fn resolve_auto(&mut self, taps: &[usize], mask_token_id: i64) {
        let (taps_auto, mask_auto) = (self.taps_are_auto(), self.mask_is_auto());
        if taps_auto {
            self.draft_model.target_layer_ids = Some(Taps::Ids(taps.to_vec()));
        }
        if mask_auto {
            self.draft_model.mask_token_id = Some(mask_token_id);
        }
        if taps_auto {
            self.set_resolved("target_layer_ids", serde_json::json!(taps));
        }
        if mask_auto {
            self.set_resolved("mask_token_id", serde_json::json!(mask_token_id));
        }
    }

    /// Resuming: settings left to `auto` take what the checkpoint's run resolved them to (kept in its configuration),
    /// so a later rule never changes a run's taps or MASK token.
    pub fn adopt_resolved(&mut self, checkpoint: &serde_json::Value) {
        let resolved = |key: &str| lookup(checkpoint, &format!("draft_model.{key}")).cloned();
        let taps = resolved("target_layer_ids")
            .and_then(|v| serde_json::from_value::<Vec<usize>>(v).ok())
            .filter(|_| self.taps_are_auto());
        let mask = resolved("mask_token_id").and_then(|v| v.as_i64()).filter(|_| self.mask_is_auto());
        if let Some(taps) = taps {
            self.set_resolved("target_layer_ids", serde_json::json!(taps));
            self.draft_model.target_layer_ids = Some(Taps::Ids(taps));
        }
        if let Some(mask) = mask {
            self.set_resolved("mask_token_id", serde_json::json!(mask));
            self.draft_model.mask_token_id = Some(mask);
        }
    }

    fn set_resolved(&mut self, key: &str, value: serde_json::Value) {
        if let Some(section) = self.merged.get_mut("draft_model").and_then(|s| s.as_object_mut()) {
            section.insert(key.into(), value);
        }
    }

    /// Whether the MASK token follows the rule (`auto`, or unset, with a model folder).
    pub fn mask_is_auto(&self) -> bool {
        self.draft_model.mask_token_id.is_none() && matches!(self.target.source, TargetSource::Folder(_))
    }

    /// Whether the tapped layers follow the rule (`auto`, or unset with a model folder) rather than the preset's or
    /// the ids written out.
    pub fn taps_are_auto(&self) -> bool {
        match (&self.draft_model.target_layer_ids, &self.target.source) {
            (Some(Taps::Auto), _) | (None, TargetSource::Folder(_)) => true,
            (Some(Taps::Ids(_)), _) | (None, TargetSource::Preset(_)) => false,
        }
    }

    /// The tapped layer ids for a target `num_target_layers` deep: the explicit ones, the preset's, or z-lab's rule
    /// (`auto`, the default with a model folder).
    pub fn target_layer_ids(&self, num_target_layers: usize) -> Result<Vec<usize>, ConfigError> {
        self.target_layer_ids_of(&self.target.source, num_target_layers)
    }

    /// [`Config::target_layer_ids`] for another target than `target.model` (`bench --model`).
    pub fn target_layer_ids_of(
        &self,
        source: &TargetSource,
        num_target_layers: usize,
    ) -> Result<Vec<usize>, ConfigError> {
        match (&self.draft_model.target_layer_ids, source) {
            (Some(Taps::Ids(ids)), _) => Ok(ids.clone()),
            (None, TargetSource::Preset(p)) => Ok(p.spec().taps),
            (Some(Taps::Auto), _) | (None, TargetSource::Folder(_)) => {
                let draft = self.draft_model.num_hidden_layers;
                auto_target_layer_ids(num_target_layers, draft).ok_or_else(|| {
                    invalid(
                        "draft_model.target_layer_ids",
                        "\"auto\"",
                        format!(
                            "a {num_target_layers}-layer target is too shallow for {draft} evenly spaced taps: write \
                             the ids out (increasing, each below {num_target_layers})"
                        ),
                    )
                })
            }
        }
    }
}

fn load_error(source_name: &str, e: config::ConfigError) -> ConfigError {
    ConfigError::Load { source_name: source_name.to_string(), message: explain_serde_error(&e.to_string()) }
}

/// serde says "unknown field `x`, expected one of ..."; say which section it was in when config names it.
fn explain_serde_error(message: &str) -> String {
    if message.contains("unknown field") {
        format!("{message} (a misspelt key? `dflash config defaults` prints every key, explained)")
    } else {
        message.to_string()
    }
}

/// Reads an override as a TOML value where it parses as one, else as a plain string.
fn parse_value(raw: &str) -> Value {
    match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut table) => toml_to_config(table.remove("v").expect("parsed key v")),
        Err(_) => Value::new(None, ValueKind::String(raw.to_string())),
    }
}

fn toml_to_config(v: toml::Value) -> Value {
    let kind = match v {
        toml::Value::String(s) => ValueKind::String(s),
        toml::Value::Integer(i) => ValueKind::I64(i),
        toml::Value::Float(f) => ValueKind::Float(f),
        toml::Value::Boolean(b) => ValueKind::Boolean(b),
        toml::Value::Datetime(d) => ValueKind::String(d.to_string()),
        toml::Value::Array(items) => ValueKind::Array(items.into_iter().map(toml_to_config).collect()),
        toml::Value::Table(t) => ValueKind::Table(
            t.into_iter().map(|(k, v)| (k, toml_to_config(v))).collect::<BTreeMap<_, _>>().into_iter().collect(),
        ),
    };
    Value::new(None, kind)
}

impl RawConfig {
    fn validate(self, merged: serde_json::Value) -> Result<Config, ConfigError> {
        let config = Config {
            target: self.target.validate()?,
            draft_model: self.draft_model.validate()?,
            drafters: self.drafters.validate()?,
            data: self.data.validate()?,
            objective: self.objective.validate()?,
            optim: self.optim.validate()?,
            checkpoint: self.checkpoint.validate()?,
            supervision: self.supervision.validate()?,
            eval: self.eval.validate()?,
            publish: self.publish.validate()?,
            control: self.control.validate()?,
            cluster: self.cluster.validate()?,
            log: self.log.validate()?,
            proxy: self.proxy.validate()?,
            merged,
        };
        let (min, drafters) = (config.supervision.min_live_drafters, config.drafters.devices.len());
        if min > drafters {
            return Err(invalid(
                "supervision.min_live_drafters",
                min,
                format!(
                    "at most the number of drafters ({drafters} in drafters.devices), or the run could never start"
                ),
            ));
        }
        // Only a schedule that counts steps can warm up over a number of them.
        if config.optim.warmup_steps > 0 && config.optim.max_steps == 0 && config.data.stream.is_none() {
            return Err(invalid(
                "optim.warmup_steps",
                config.optim.warmup_steps,
                "0 for a run bounded by epochs (its schedule counts samples: use optim.warmup_ratio), or set \
                 optim.max_steps or data.stream",
            ));
        }
        match &config.data.stream {
            Some(stream) => check_stream(stream, &config)?,
            None if config.eval.prompts == training::EvalPrompts::Stream => {
                return Err(invalid("eval.prompts", "\"stream\"", "with data.stream (the traffic it evaluates on)"));
            }
            None => {}
        }
        Ok(config)
    }
}

/// What `data.stream` asks of the rest: data to replay, and a schedule that needs no end.
fn check_stream(stream: &StreamSettings, config: &Config) -> Result<(), ConfigError> {
    let key = "data.stream";
    let value = stream.dir.display();
    if matches!(config.data.source, DataSource::Synthetic(_)) {
        return Err(invalid(
            key,
            value,
            "off with synthetic data (a stream replays real conversations from data.path)",
        ));
    }
    if config.eval.prompts == training::EvalPrompts::Stream && config.data.holdout <= 0.0 {
        return Err(invalid(
            "eval.prompts",
            "\"stream\"",
            "with data.holdout > 0 (each wave holds that share of its conversations out: the recent traffic evaluated)",
        ));
    }
    let optim = &config.optim;
    if optim.max_steps == 0 && (optim.schedule != crate::train::ScheduleKind::Constant || optim.warmup_ratio > 0.0) {
        return Err(invalid(
            key,
            value,
            "a stream without optim.max_steps has no end to schedule toward: set optim.schedule = \"constant\" and \
             optim.warmup_ratio = 0 (optim.warmup_steps warms up over a number of steps instead), or bound it with \
             optim.max_steps",
        ));
    }
    Ok(())
}

/// Keys a running service cannot change: resuming with a different value is refused.
pub const NON_RELOADABLE: [&str; 23] = [
    "target.model",
    "data.stream",
    "data.stream_mix",
    "optim.optimizer",
    "draft_model.variant",
    "draft_model.conv_kernel_size",
    "draft_model.conv_group_size",
    "draft_model.selector_rank",
    "draft_model.selector_top_k",
    "draft_model.num_hidden_layers",
    "draft_model.block_size",
    "draft_model.intermediate_size",
    "draft_model.layer_types",
    "draft_model.sliding_window",
    "draft_model.block_causal",
    "draft_model.target_layer_ids",
    "draft_model.mask_token_id",
    "data.path",
    "data.holdout",
    "data.batch_size",
    "data.pack",
    "data.pack_len",
    "objective.seed",
];

/// Keys every host of a run must share, checked when a host joins ([`join_differences`]): those a run cannot change
/// ([`NON_RELOADABLE`]) but the two paths, which may differ from host to host (the data is compared by its content
/// instead, the target by what its config.json says: the `target.model` [`join_settings`] posts), how the loss weighs
/// the slots, Muon's fixed hyperparameters, and how the drafters sum their gradients.
pub const SHARED_BY_HOSTS: [&str; 30] = [
    "data.stream_mix",
    "draft_model.variant",
    "draft_model.conv_kernel_size",
    "draft_model.conv_group_size",
    "draft_model.selector_rank",
    "draft_model.selector_top_k",
    "objective.selector_loss_alpha",
    "draft_model.num_hidden_layers",
    "draft_model.block_size",
    "draft_model.intermediate_size",
    "draft_model.layer_types",
    "draft_model.sliding_window",
    "draft_model.block_causal",
    "draft_model.target_layer_ids",
    "draft_model.mask_token_id",
    "data.holdout",
    "data.batch_size",
    "data.pack",
    "data.pack_len",
    "objective.seed",
    "objective.weights",
    "objective.dpace_alpha",
    "objective.target",
    "objective.loss",
    "optim.optimizer",
    "optim.muon_momentum",
    "optim.muon_weight_decay",
    "optim.muon_ns_steps",
    "optim.muon_iteration",
    "drafters.collective",
];

/// What a host compares with rank 0's when it joins: its values of [`SHARED_BY_HOSTS`] and [`RELOADABLE`] from its
/// merged tree, and `target` (what its target is, not where) as `target.model`; a flat object of dotted keys.
pub fn join_settings(tree: &serde_json::Value, target: &str) -> serde_json::Value {
    let mut flat = serde_json::Map::new();
    for key in SHARED_BY_HOSTS.iter().chain(RELOADABLE.iter()) {
        if let Some(v) = lookup(tree, key) {
            flat.insert((*key).to_string(), v.clone());
        }
    }
    flat.insert("target.model".into(), serde_json::json!(target));
    serde_json::Value::Object(flat)
}

/// A joining host's [`join_settings`] (`mine`) against rank 0's: an error naming each key every host must share
/// that differs, with both values; else the reloadable keys whose value rank 0's replaces here.
pub fn agree_with_rank0(mine: &serde_json::Value, rank0: &serde_json::Value) -> Result<Vec<Change>, SettingsDiffer> {
    let (refused, overridden) = join_differences(mine, rank0);
    if refused.is_empty() {
        return Ok(overridden);
    }
    let show = Change::shown;
    let listed: Vec<String> =
        refused.iter().map(|c| format!("{} = {} here, {} on rank 0", c.key, show(&c.new), show(&c.old))).collect();
    Err(SettingsDiffer(listed.join("; ")))
}

/// Keys every host of a run must share that differ from rank 0's, each with both values.
#[derive(Debug, thiserror::Error)]
#[error(
    "this host's settings differ from rank 0's in keys every host of a run must share: {0}; start every host with \
     the same configuration for them"
)]
pub struct SettingsDiffer(String);

/// A joining host's [`join_settings`] (`mine`) against rank 0's: the keys every host must share that differ (the
/// host is refused), and the reloadable ones whose value rank 0's replaces here (said once). Each change goes from
/// rank 0's value (`old`) to this host's (`new`).
pub fn join_differences(mine: &serde_json::Value, rank0: &serde_json::Value) -> (Vec<Change>, Vec<Change>) {
    let mut keys: Vec<&String> = mine.as_object().into_iter().flatten().map(|(k, _)| k).collect();
    keys.extend(rank0.as_object().into_iter().flatten().map(|(k, _)| k));
    keys.sort();
    keys.dedup();
    let changes = keys.into_iter().filter_map(|key| {
        let (old, new) = (rank0.get(key), mine.get(key));
        (old != new).then(|| Change { key: key.clone(), old: old.cloned(), new: new.cloned() })
    });
    changes.partition(|c| c.key == "target.model" || SHARED_BY_HOSTS.contains(&c.key.as_str()))
}

/// Keys a running service changes on a reload (SIGHUP, `POST /reload`), at the same step on every drafter. A change
/// to any other key is refused while running.
pub const RELOADABLE: [&str; 27] = [
    "optim.lr",
    "optim.muon_lr",
    "optim.betas",
    "optim.eps",
    "optim.weight_decay",
    "optim.schedule",
    "optim.warmup_ratio",
    "optim.warmup_steps",
    "optim.min_lr_ratio",
    "optim.grad_clip",
    "objective.num_anchors",
    "objective.gamma",
    "checkpoint.every_steps",
    "checkpoint.every_seconds",
    "eval.every_steps",
    "log.level",
    "log.every_steps",
    "supervision.max_restarts",
    "supervision.restart_window_s",
    "supervision.backoff_initial_ms",
    "supervision.backoff_max_ms",
    "supervision.step_timeout_s",
    "supervision.hang_factor",
    "supervision.hang_floor_s",
    "supervision.shutdown_timeout_s",
    "supervision.min_live_drafters",
    "supervision.gpu_hang_limit",
];

/// One key's value before and after.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Change {
    pub key: String,
    pub old: Option<serde_json::Value>,
    pub new: Option<serde_json::Value>,
}

impl Change {
    /// A value of a change as logs and errors show it: its JSON, or `(unset)`.
    pub fn shown(v: &Option<serde_json::Value>) -> String {
        v.as_ref().map_or("(unset)".to_string(), |v| v.to_string())
    }
}

/// Every dotted `section.key` of a merged configuration tree.
fn leaf_keys(tree: &serde_json::Value) -> Vec<String> {
    let sections = tree.as_object().into_iter().flatten();
    sections
        .flat_map(|(section, values)| {
            values.as_object().into_iter().flatten().map(move |(key, _)| format!("{section}.{key}"))
        })
        .collect()
}

/// Sections that are not the run's: `[proxy]` configures `dflash proxy`, which may share the run's file.
const NOT_THE_RUNS: [&str; 1] = ["proxy"];

/// The keys of the run whose values differ between two merged trees, sorted (a section that is not the run's,
/// `[proxy]`, is not compared: editing it in a shared file changes nothing a reload or a resume must weigh).
pub fn diff(old: &serde_json::Value, new: &serde_json::Value) -> Vec<Change> {
    let mut keys = leaf_keys(new);
    keys.extend(leaf_keys(old));
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|key| !NOT_THE_RUNS.iter().any(|section| key.split_once('.').is_some_and(|(s, _)| s == *section)))
        .filter_map(|key| {
            let (o, n) = (lookup(old, &key), lookup(new, &key));
            (o != n).then(|| Change { key, old: o.cloned(), new: n.cloned() })
        })
        .collect()
}

/// The changes from `old` (a checkpoint's configuration) to `new`, split into those resuming must refuse and the
/// rest. Refused: keys of [`NON_RELOADABLE`] that differ, except a key the checkpoint's build did not have yet
/// (absent from `old`) whose new value is the built-in default: the run meant that value all along (true of a key
/// whose default never changed; read `old` with [`as_trained`] for those that did).
pub fn resume_changes(old: &serde_json::Value, new: &serde_json::Value) -> (Vec<Change>, Vec<Change>) {
    let defaults = Config::builtin().map(|c| c.merged).unwrap_or_default();
    let newer_at_default =
        |c: &Change| c.old.is_none() && c.new.is_some() && c.new.as_ref() == lookup(&defaults, &c.key);
    diff(old, new).into_iter().partition(|c| NON_RELOADABLE.contains(&c.key.as_str()) && !newer_at_default(c))
}

/// The value at a dotted key of a merged configuration tree.
pub fn lookup<'a>(tree: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    key.split('.').try_fold(tree, |v, part| v.get(part))
}

impl RawTarget {
    fn validate(self) -> Result<TargetSettings, ConfigError> {
        if let Some(why) = no_such_model(&self.model) {
            return Err(invalid("target.model", format!("{:?}", self.model), why));
        }
        let source = TargetSource::from_arg(&self.model);
        let device = self
            .device
            .parse()
            .map_err(|_| invalid("target.device", format!("{:?}", self.device), "expected cpu, cuda:N or auto"))?;
        let dtype = self
            .dtype
            .parse()
            .map_err(|_| invalid("target.dtype", format!("{:?}", self.dtype), "expected auto, bf16 or f32"))?;
        let key = "target.capture_devices";
        let capture = match self.capture_devices {
            RawCaptureDevices::Word(w) if w == "colocated" => CapturePlacement::Colocated,
            RawCaptureDevices::Word(w) => {
                return Err(invalid(key, format!("{w:?}"), "a list of devices, [] (target.device) or \"colocated\""));
            }
            RawCaptureDevices::List(list) if list.is_empty() => CapturePlacement::TargetDevice,
            RawCaptureDevices::List(list) => CapturePlacement::Devices(
                list.iter()
                    .map(|d| d.parse().map_err(|_| invalid(key, format!("{d:?}"), "each entry is cpu, cuda:N or auto")))
                    .collect::<Result<_, _>>()?,
            ),
        };
        let spread_to = self
            .spread_to
            .iter()
            .map(|d| {
                d.parse().map_err(|_| invalid("target.spread_to", format!("{d:?}"), "each entry is cpu or cuda:N"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(TargetSettings { source, device, dtype, capture, spread_to, micro_batches: self.micro_batches })
    }
}

impl RawDraftModel {
    /// Each layer's attention from `layer_types`, `sliding_window` and `block_causal`, checked as the engines read
    /// them ([`crate::model::drafter_config::write_layer_attention`] writes them back).
    fn layer_attention(&self) -> Result<Vec<LayerAttention>, ConfigError> {
        let layers = self.num_hidden_layers.max(0) as usize;
        let key = "draft_model.layer_types";
        let allowed = "\"full_attention\", \"sliding_attention\", or a list with one of them per layer";
        let sliding = |t: &str| match t {
            "sliding_attention" => Ok(true),
            "full_attention" => Ok(false),
            other => Err(invalid(key, format!("{other:?}"), allowed)),
        };
        let types: Vec<bool> = match &self.layer_types {
            RawLayerTypes::Every(t) => vec![sliding(t)?; layers],
            RawLayerTypes::Each(list) if list.len() == layers => {
                list.iter().map(|t| sliding(t)).collect::<Result<_, _>>()?
            }
            RawLayerTypes::Each(list) => {
                return Err(invalid(
                    key,
                    format!("{list:?}"),
                    format!("one entry per layer: draft_model.num_hidden_layers is {layers}"),
                ));
            }
        };
        if self.sliding_window < 1 {
            return Err(invalid("draft_model.sliding_window", self.sliding_window, "a positive number of positions"));
        }
        let causal = match &self.block_causal {
            RawCausal::Every(c) => Some(*c),
            RawCausal::Word(w) if w == "auto" => None,
            RawCausal::Word(w) if w == "true" || w == "false" => Some(w == "true"),
            RawCausal::Word(w) => {
                return Err(invalid("draft_model.block_causal", format!("{w:?}"), "\"auto\", true or false"));
            }
        };
        Ok(types
            .into_iter()
            .map(|sliding| LayerAttention {
                window: sliding.then_some(self.sliding_window),
                causal: causal.unwrap_or(sliding),
            })
            .collect())
    }

    /// A variant's size as `[draft_model]` sets it (each variant's sizes are fields of [`RawDraftModel`]).
    fn variant_size(&self, key: &str) -> Option<i64> {
        match key {
            "conv_kernel_size" => Some(self.conv_kernel_size),
            "conv_group_size" => Some(self.conv_group_size),
            "selector_rank" => Some(self.selector_rank),
            "selector_top_k" => Some(self.selector_top_k),
            _ => None,
        }
    }

    /// `variant` with its sizes (each checked against the target's shape when the drafter is built).
    fn variant(&self) -> Result<Variant, ConfigError> {
        let Some(registration) = Variant::named(&self.variant) else {
            return Err(invalid("draft_model.variant", format!("{:?}", self.variant), Variant::names()));
        };
        registration.build(|key| {
            let value = self.variant_size(key).unwrap_or(0);
            usize::try_from(value)
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| invalid(&format!("draft_model.{key}"), value, "a positive size"))
        })
    }

    fn validate(self) -> Result<DraftModelSettings, ConfigError> {
        if self.num_hidden_layers < 1 {
            return Err(invalid("draft_model.num_hidden_layers", self.num_hidden_layers, "at least 1 layer"));
        }
        let layer_attention = self.layer_attention()?;
        let variant = self.variant()?;
        if self.block_size < 2 {
            return Err(invalid("draft_model.block_size", self.block_size, "at least 2 (16 is the paper's)"));
        }
        if let Some(i) = self.intermediate_size.filter(|&i| i < 1) {
            return Err(invalid("draft_model.intermediate_size", i, "a positive width"));
        }
        let key = "draft_model.target_layer_ids";
        let target_layer_ids = match self.target_layer_ids {
            None => None,
            Some(RawTaps::Word(w)) if w == "auto" => Some(Taps::Auto),
            Some(RawTaps::Word(w)) => {
                return Err(invalid(
                    key,
                    format!("{w:?}"),
                    "a list of layer ids, e.g. [1, 9, 17, 25, 33], or \"auto\"",
                ));
            }
            Some(RawTaps::Ids(ids)) => {
                if ids.is_empty() {
                    return Err(invalid(key, "[]", "needs at least one layer id"));
                }
                if let Some(bad) = ids.iter().find(|&&i| i < 0) {
                    return Err(invalid(key, format!("{ids:?}"), format!("layer ids are >= 0, got {bad}")));
                }
                if ids.windows(2).any(|w| w[0] >= w[1]) {
                    return Err(invalid(key, format!("{ids:?}"), "layer ids must be strictly increasing"));
                }
                Some(Taps::Ids(ids.into_iter().map(|i| i as usize).collect()))
            }
        };
        let mask_token_id = match self.mask_token_id {
            None => None,
            Some(RawMask::Word(w)) if w == "auto" => None,
            Some(RawMask::Word(w)) => {
                return Err(invalid("draft_model.mask_token_id", format!("{w:?}"), "a token id, or \"auto\""));
            }
            Some(RawMask::Id(m)) if m < 0 => {
                return Err(invalid("draft_model.mask_token_id", m, "a token id is >= 0"));
            }
            Some(RawMask::Id(m)) => Some(m),
        };
        Ok(DraftModelSettings {
            layer_attention,
            variant,
            num_hidden_layers: self.num_hidden_layers as usize,
            block_size: self.block_size as usize,
            intermediate_size: self.intermediate_size.map(|i| i as usize),
            target_layer_ids,
            mask_token_id,
            init: self.init.filter(|p| !p.is_empty()).map(PathBuf::from),
        })
    }
}

impl RawObjective {
    fn validate(self) -> Result<ObjectiveConfig, ConfigError> {
        if self.num_anchors < 1 {
            return Err(invalid("objective.num_anchors", self.num_anchors, "at least 1 block per sequence"));
        }
        if self.seed < 0 {
            return Err(invalid("objective.seed", self.seed, "a seed is >= 0"));
        }
        let gamma = match self.gamma {
            RawGamma::Number(g) => format!("{g}"),
            RawGamma::Word(w) => w,
        };
        let parsed = gamma
            .parse()
            .map_err(|_| invalid("objective.gamma", format!("{gamma:?}"), "a positive number, \"auto\" or \"none\""))?;
        let alpha = self.dpace_alpha;
        if !(alpha.is_finite() && alpha > 0.0 && alpha <= 1.0) {
            return Err(invalid("objective.dpace_alpha", alpha, "in (0, 1] (0.5 is speculators' default)"));
        }
        let weights = match self.weights.as_str() {
            "decay" => SlotWeights::Decay,
            "dpace" => SlotWeights::Dpace { alpha },
            other => return Err(invalid("objective.weights", format!("{other:?}"), "\"decay\" or \"dpace\"")),
        };
        let teacher = match (self.target.as_str(), self.loss.as_str()) {
            ("data", "ce") => Teacher::Data,
            ("argmax", "ce") => Teacher::Argmax,
            ("argmax", "kl") => Teacher::Distribution,
            ("data", "kl") => {
                return Err(invalid(
                    "objective.loss",
                    "\"kl\" with objective.target = \"data\"",
                    "KL learns the target's whole next-token distribution, which the data does not have: set \
                     objective.target = \"argmax\" with it (accuracy and acceptance then count the target's choice), \
                     or keep loss = \"ce\" to learn the data's tokens",
                ));
            }
            ("data" | "argmax", other) => {
                return Err(invalid("objective.loss", format!("{other:?}"), "\"ce\" or \"kl\""));
            }
            (other, _) => return Err(invalid("objective.target", format!("{other:?}"), "\"data\" or \"argmax\"")),
        };
        let selector_loss_alpha = self.selector_loss_alpha;
        if !(selector_loss_alpha.is_finite() && selector_loss_alpha >= 0.0) {
            return Err(invalid(
                "objective.selector_loss_alpha",
                selector_loss_alpha,
                "a weight >= 0 (1.0: speculators')",
            ));
        }
        Ok(ObjectiveConfig {
            num_anchors: self.num_anchors as usize,
            gamma: parsed,
            weights,
            teacher,
            selector_loss_alpha,
            seed: self.seed as u64,
        })
    }
}

impl RawLog {
    fn validate(self) -> Result<LogSettings, ConfigError> {
        tracing_subscriber::EnvFilter::try_new(&self.level).map_err(|e| {
            invalid(
                "log.level",
                format!("{:?}", self.level),
                format!(
                    "expected a level (error, warn, info, debug, trace) or a filter like \"dflash=debug,info\": {e}"
                ),
            )
        })?;
        let format = match self.format.as_str() {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => {
                return Err(invalid("log.format", format!("{other:?}"), "expected text or json"));
            }
        };
        if self.every_steps < 1 {
            return Err(invalid("log.every_steps", self.every_steps, "at least 1"));
        }
        Ok(LogSettings {
            level: self.level,
            format,
            every_steps: self.every_steps as u64,
            tensorboard: self.tensorboard,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::dataset::SyntheticLengths;
    use std::time::Duration;

    fn with_set(items: &[&str]) -> Result<Config, ConfigError> {
        Config::load(&Layers { set: items.iter().map(|s| s.to_string()).collect(), ..Layers::default() })
    }

    #[test]
    fn builtin_defaults_are_valid() {
        let c = Config::builtin().unwrap();
        assert_eq!(c.target.source, TargetSource::Preset(Preset::TinyTasks));
        assert_eq!(c.target.device, DeviceSpec::Auto);
        assert_eq!(c.target_layer_ids(8).unwrap(), vec![1, 3, 5]);
    }

    #[test]
    fn layers_override_in_order_file_env_set() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("run.toml");
        std::fs::write(&file, "[target]\ndevice = \"cuda:3\"\ndtype = \"bf16\"\n").unwrap();
        let mut layers = Layers {
            file: Some(file),
            env: vec![
                ("DFLASH__TARGET__DTYPE".into(), "f32".into()),
                ("DFLASH_CACHE".into(), "ignored: one underscore".into()),
                ("HOME".into(), "/root".into()),
            ],
            set: vec![],
        };
        let c = Config::load(&layers).unwrap();
        assert_eq!(c.target.device, DeviceSpec::Cuda(3)); // file over default
        assert_eq!(c.target.dtype, DtypeSpec::F32); // env over file
        layers.set = vec!["target.dtype=bf16".into(), "draft_model.target_layer_ids=[0, 2]".into()];
        let c = Config::load(&layers).unwrap();
        assert_eq!(c.target.dtype, DtypeSpec::Bf16); // --set over env
        assert_eq!(c.target_layer_ids(8).unwrap(), vec![0, 2]);
    }

    #[test]
    fn synthetic_data_comes_full_length_or_with_chat_lengths() {
        let source = |path: &str| with_set(&[&format!("data.path={path}")]).unwrap().data.source;
        assert_eq!(source("synthetic"), DataSource::Synthetic(SyntheticLengths::Full));
        assert_eq!(source("synthetic-chat"), DataSource::Synthetic(SyntheticLengths::Chat));
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = with_set(&["target.devise=cpu"]).unwrap_err().to_string();
        assert!(err.contains("devise") && err.contains("dflash config defaults"), "{err}");
        let err = with_set(&["optimm.lr=1"]).unwrap_err().to_string();
        assert!(err.contains("optimm"), "{err}");
        let err =
            Config::load(&Layers { env: vec![("DFLASH__LOG__COLOUR".into(), "red".into())], ..Layers::default() })
                .unwrap_err()
                .to_string();
        assert!(err.contains("colour"), "{err}");
    }

    #[test]
    fn bad_values_name_key_value_and_what_is_allowed() {
        let cases: &[(&str, &[&str])] = &[
            ("target.device=gpu0", &["target.device", "gpu0", "cuda:N"]),
            ("target.dtype=fp8", &["target.dtype", "fp8", "bf16"]),
            ("target.model=/no/such/dir", &["target.model", "/no/such/dir", "tiny"]),
            ("draft_model.target_layer_ids=[3, 1]", &["target_layer_ids", "[3, 1]", "increasing"]),
            ("draft_model.target_layer_ids=[]", &["target_layer_ids", "at least one"]),
            ("draft_model.target_layer_ids=[-1, 2]", &["target_layer_ids", "-1"]),
            ("draft_model.mask_token_id=-5", &["mask_token_id", "-5"]),
            ("log.format=xml", &["log.format", "xml", "json"]),
            ("objective.num_anchors=0", &["objective.num_anchors", "0"]),
            ("objective.gamma=-1", &["objective.gamma", "-1"]),
            ("objective.gamma=soon", &["objective.gamma", "soon", "auto"]),
            ("objective.weights=kl", &["objective.weights", "kl", "dpace"]),
            ("objective.dpace_alpha=0", &["objective.dpace_alpha", "(0, 1]"]),
            ("objective.selector_loss_alpha=-1", &["objective.selector_loss_alpha", ">= 0"]),
            ("draft_model.variant=\"dflash3\"", &["draft_model.variant", "dflash3", "dflash2"]),
            ("objective.dpace_alpha=1.5", &["objective.dpace_alpha", "1.5"]),
            ("objective.target=logits", &["objective.target", "logits", "argmax"]),
            ("objective.loss=tv", &["objective.loss", "tv", "kl"]),
            ("objective.loss=kl", &["objective.loss", "objective.target = \"argmax\""]),
            ("data.batch_size=4.5", &["data.batch_size", "4.5", "expected i64"]),
            ("optim.max_steps=\"ten\"", &["optim.max_steps", "ten"]),
            ("objective.seed=-3", &["objective.seed", "-3"]),
            ("optim.optimizer=sgd", &["optim.optimizer", "sgd", "muon"]),
            ("optim.muon_ns_steps=0", &["optim.muon_ns_steps", "1..=99"]),
            ("optim.muon_iteration=polar", &["optim.muon_iteration", "polar", "gram"]),
            ("optim.muon_momentum=1", &["optim.muon_momentum", "[0, 1)"]),
            ("draft_model.block_size=1", &["draft_model.block_size", "1"]),
            ("draft_model.layer_types=\"local\"", &["draft_model.layer_types", "local", "sliding_attention"]),
            ("draft_model.layer_types=[\"full_attention\"]", &["draft_model.layer_types", "num_hidden_layers is 5"]),
            ("draft_model.sliding_window=0", &["draft_model.sliding_window", "0", "positive"]),
            ("draft_model.block_causal=maybe", &["draft_model.block_causal", "maybe", "auto"]),
            ("drafters.devices=[]", &["drafters.devices", "at least one"]),
            ("drafters.devices=[\"cpu\", \"gpu\"]", &["drafters.devices", "gpu", "cuda:N"]),
            ("data.batch_size=0", &["data.batch_size", "0"]),
            ("optim.betas=[0.9]", &["optim.betas", "two numbers"]),
            ("optim.schedule=linear", &["optim.schedule", "linear", "cosine"]),
            ("optim.lr=-1", &["optim.lr", "-1"]),
            ("checkpoint.keep=1", &["checkpoint.keep", "at least 2"]),
            ("supervision.backoff_max_ms=1", &["supervision.backoff_max_ms", "backoff_initial_ms"]),
            ("supervision.min_live_drafters=3", &["supervision.min_live_drafters", "3", "2 in drafters.devices"]),
            ("control.listen=nowhere", &["control.listen", "nowhere", "127.0.0.1"]),
            ("log.every_steps=0", &["log.every_steps"]),
            ("eval.every_steps=-1", &["eval.every_steps"]),
            ("eval.num_prompts=0", &["eval.num_prompts"]),
            ("eval.prompts=\"\"", &["eval.prompts", "holdout"]),
            ("drafters.peak_tflops=0", &["drafters.peak_tflops"]),
            ("drafters.collective=mpi", &["drafters.collective", "mpi", "nccl"]),
            ("drafters.collective=nccl", &["drafters.devices", "auto", "explicit cuda:N"]),
            ("drafters.collective_timeout_s=0", &["drafters.collective_timeout_s"]),
            ("target.capture_devices=everywhere", &["target.capture_devices", "colocated"]),
            ("target.capture_devices=[\"cpu\", \"tpu\"]", &["target.capture_devices", "tpu"]),
            ("log.level=dflash=loud", &["log.level", "loud"]),
            ("draft_model.target_layer_ids=\"x\"", &["target_layer_ids"]),
        ];
        for (set, expected) in cases {
            let err = with_set(&[set]).unwrap_err().to_string();
            for e in *expected {
                assert!(err.contains(e), "--set {set}: expected {e:?} in {err:?}");
            }
        }
        let err =
            with_set(&["draft_model.variant=\"dflash2\"", "draft_model.selector_rank=0"]).unwrap_err().to_string();
        assert!(err.contains("draft_model.selector_rank") && err.contains("positive"), "{err}");
        let twice = with_set(&["drafters.collective=nccl", "drafters.devices=[\"cuda:0\", \"cuda:1\", \"cuda:0\"]"]);
        let err = twice.unwrap_err().to_string();
        assert!(err.contains("cuda:0 twice") && err.contains("listed once"), "{err}");
        let ok = with_set(&["drafters.collective=nccl", "drafters.devices=[\"cuda:0\", \"cuda:1\"]"]).unwrap();
        assert_eq!(ok.drafters.collective, CollectiveKind::Nccl);
    }

    /// `data.stream` asks for data to replay and, without `optim.max_steps`, a schedule that needs no end.
    #[test]
    fn a_stream_needs_replay_and_a_schedule_without_an_end() {
        let stream = "data.stream=\"traffic\"";
        let err = with_set(&[stream]).unwrap_err().to_string();
        assert!(err.contains("optim.schedule = \"constant\"") && err.contains("optim.max_steps"), "{err}");
        let open_ended = [stream, "optim.schedule=\"constant\"", "optim.warmup_ratio=0"];
        let cfg = with_set(&open_ended).unwrap();
        let s = cfg.data.stream.unwrap();
        assert_eq!((s.mix, s.min_conversations, s.max_wait), (0.5, 256, Some(Duration::from_secs(1800))));
        let unbounded = with_set(&[&open_ended[..], &["data.stream_max_wait_s=0"]].concat()).unwrap();
        assert_eq!(unbounded.data.stream.unwrap().max_wait, None, "0: no bound");
        let err = with_set(&[&open_ended[..], &["data.stream_max_wait_s=-1"]].concat()).unwrap_err().to_string();
        assert!(err.contains("data.stream_max_wait_s") && err.contains("-1"), "{err}");
        assert!(with_set(&[stream, "optim.max_steps=100"]).is_ok(), "a bounded stream may decay");
        let warm = [stream, "optim.schedule=\"constant\"", "optim.warmup_ratio=0", "optim.warmup_steps=50"];
        assert_eq!(with_set(&warm).unwrap().optim.warmup_steps, 50, "an open-ended stream warms up over steps");
        let err = with_set(&["optim.warmup_steps=50"]).unwrap_err().to_string();
        assert!(err.contains("optim.warmup_steps") && err.contains("warmup_ratio"), "{err}");
        let err = with_set(&[stream, "optim.max_steps=100", "data.path=\"synthetic\""]).unwrap_err().to_string();
        assert!(err.contains("synthetic"), "{err}");
        let err = with_set(&[stream, "optim.max_steps=100", "data.stream_mix=1.0"]).unwrap_err().to_string();
        assert!(err.contains("data.stream_mix"), "{err}");
    }

    /// Every registered variant is a `draft_model.variant` a config can name, with each of its sizes a setting read
    /// from `[draft_model]`, that a run cannot change and that every host must share.
    #[test]
    fn every_variant_and_its_sizes_are_settings() {
        for r in &crate::model::variant::REGISTERED {
            let mut set = vec![format!("draft_model.variant=\"{}\"", r.name)];
            set.extend(r.keys.iter().enumerate().map(|(i, key)| format!("draft_model.{key}={}", i + 1)));
            let cfg = with_set(&set.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
            let sizes: Vec<usize> = cfg.draft_model.variant.sizes().into_iter().map(|(_, size)| size).collect();
            assert_eq!(sizes, (1..=r.keys.len()).collect::<Vec<_>>(), "{}", r.name);
            for key in r.keys {
                let key = format!("draft_model.{key}");
                assert!(NON_RELOADABLE.contains(&key.as_str()) && SHARED_BY_HOSTS.contains(&key.as_str()), "{key}");
            }
        }
    }

    #[test]
    fn malformed_overrides_and_missing_files_are_reported() {
        let err = with_set(&["novalue"]).unwrap_err().to_string();
        assert!(err.contains("section.key=value"), "{err}");
        let err =
            Config::load(&Layers { file: Some("/no/such.toml".into()), ..Layers::default() }).unwrap_err().to_string();
        assert!(err.contains("/no/such.toml") && err.contains("no such file"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("bad.toml");
        std::fs::write(&file, "[target\n").unwrap();
        let err = Config::load(&Layers { file: Some(file.clone()), ..Layers::default() }).unwrap_err().to_string();
        assert!(err.contains("bad.toml"), "{err}");
    }

    #[test]
    fn a_target_model_that_is_not_there_is_refused_with_the_download_command() {
        let err = with_set(&["target.model=Qwen/Qwen3-8B"]).unwrap_err().to_string();
        assert!(err.contains("target.model") && err.contains("hf download"), "{err}");
    }

    /// Resuming, `auto` takes what the checkpoint's run resolved (a newer rule never changes a run's taps or MASK);
    /// ids written out stay as written (and a difference is then refused by the resume check).
    #[test]
    fn a_resume_adopts_what_auto_resolved_to() {
        let dir = tempfile::tempdir().unwrap();
        let folder = format!("target.model={}", dir.path().display());
        let checkpoint = serde_json::json!({"draft_model": {"target_layer_ids": [2, 4], "mask_token_id": 7}});
        let mut c = with_set(&[&folder]).unwrap();
        c.adopt_resolved(&checkpoint);
        assert_eq!(c.target_layer_ids(36).unwrap(), vec![2, 4]);
        assert_eq!(c.draft_model.mask_token_id, Some(7));
        assert_eq!(lookup(&c.merged, "draft_model.target_layer_ids"), Some(&serde_json::json!([2, 4])));
        let mut c = with_set(&[&folder, "draft_model.target_layer_ids=[1, 3]", "draft_model.mask_token_id=9"]).unwrap();
        c.adopt_resolved(&checkpoint);
        assert_eq!((c.target_layer_ids(36).unwrap(), c.draft_model.mask_token_id), (vec![1, 3], Some(9)));
    }

    #[test]
    fn non_reloadable_changes_are_named() {
        let a = Config::builtin().unwrap();
        let b = with_set(&["data.batch_size=8", "optim.lr=1e-3", "draft_model.block_size=8"]).unwrap();
        let fixed = |x: &Config, y: &Config| -> Vec<String> {
            diff(&x.merged, &y.merged)
                .into_iter()
                .map(|c| c.key)
                .filter(|k| NON_RELOADABLE.contains(&k.as_str()))
                .collect()
        };
        assert_eq!(fixed(&a, &b), vec!["data.batch_size", "draft_model.block_size"]);
        assert_eq!(b.optim.lr, 1e-3);
        assert!(fixed(&a, &a).is_empty());
    }

    #[test]
    fn a_fixed_key_newer_than_the_checkpoint_is_refused_only_away_from_its_default() {
        let now = Config::builtin().unwrap();
        let mut old = now.merged.clone();
        old["data"].as_object_mut().unwrap().remove("holdout");
        assert!(resume_changes(&old, &now.merged).0.is_empty(), "a checkpoint from before data.holdout resumes");
        let other = with_set(&["data.holdout=0.1"]).unwrap();
        let keys: Vec<String> = resume_changes(&old, &other.merged).0.into_iter().map(|c| c.key).collect();
        assert_eq!(keys, vec!["data.holdout"]);
        assert_eq!(resume_changes(&now.merged, &other.merged).0.len(), 1);
        let mut gone = now.merged.clone();
        gone["data"].as_object_mut().unwrap().remove("batch_size");
        assert_eq!(resume_changes(&now.merged, &gone).0.len(), 1, "a key removed is a change");
    }

    #[test]
    fn diff_names_each_changed_key_with_both_values() {
        let a = Config::builtin().unwrap();
        let b = with_set(&["optim.lr=1e-3", "draft_model.intermediate_size=64", "log.level=debug"]).unwrap();
        let changes = diff(&a.merged, &b.merged);
        let keys: Vec<&str> = changes.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(keys, vec!["draft_model.intermediate_size", "log.level", "optim.lr"]);
        assert_eq!(changes[0].old, None);
        assert_eq!(changes[2].new, Some(serde_json::json!(1e-3)));
        assert!(diff(&b.merged, &b.merged).is_empty());
        assert!(diff(&b.merged, &a.merged).iter().any(|c| c.key == "draft_model.intermediate_size" && c.new.is_none()));
        for k in RELOADABLE {
            assert!(lookup(&a.merged, k).is_some(), "{k} is not a key of config/default.toml");
            assert!(!NON_RELOADABLE.contains(&k), "{k} is both reloadable and not");
        }
    }

    /// A joining host is refused for a shared key that differs (the drafter's depth, the target's shape, how
    /// gradients are summed), never for a path or a reloadable key (rank 0's lr replaces its own, said once).
    #[test]
    fn a_joining_host_is_refused_for_shared_keys_only() {
        let base = Config::builtin().unwrap().merged;
        let mut other = base.clone();
        other["draft_model"]["num_hidden_layers"] = serde_json::json!(2);
        other["drafters"]["collective"] = serde_json::json!("nccl");
        other["optim"]["lr"] = serde_json::json!(1e-3);
        other["data"]["path"] = serde_json::json!("/elsewhere/data");
        let rank0 = join_settings(&base, "qwen3 36 layers");
        let (refused, overridden) = join_differences(&join_settings(&other, "qwen3 28 layers"), &rank0);
        let keys = |c: &[Change]| c.iter().map(|c| c.key.clone()).collect::<Vec<_>>();
        assert_eq!(keys(&refused), ["draft_model.num_hidden_layers", "drafters.collective", "target.model"]);
        assert_eq!(refused[0].new, Some(serde_json::json!(2)));
        assert_eq!(keys(&overridden), ["optim.lr"]);
        let same = join_differences(&rank0, &rank0);
        assert!(same.0.is_empty() && same.1.is_empty());
        assert!(
            NON_RELOADABLE
                .iter()
                .all(|k| SHARED_BY_HOSTS.contains(k) || ["target.model", "data.path", "data.stream"].contains(k))
        );
    }

    #[test]
    fn gamma_reads_numbers_and_words() {
        let c = Config::builtin().unwrap();
        assert_eq!(c.objective.gamma, Gamma::Auto);
        assert_eq!(c.objective.gamma.resolve(16).unwrap(), Some(7.0));
        assert!(c.objective.gamma.resolve(12).unwrap_err().to_string().contains("block size 12"));
        let c = with_set(&["objective.gamma=5"]).unwrap();
        assert_eq!(c.objective.gamma.resolve(12).unwrap(), Some(5.0));
        let c = with_set(&["objective.gamma=none"]).unwrap();
        assert_eq!(c.objective.gamma.resolve(16).unwrap(), None);
    }

    /// With a model folder the taps follow z-lab's rule unless written out; `auto` asks for it with a preset too;
    /// a target too shallow for the rule says what to write instead.
    #[test]
    fn a_model_folder_taps_by_the_rule_unless_the_ids_are_written_out() {
        let dir = tempfile::tempdir().unwrap();
        let folder = format!("target.model={}", dir.path().display());
        let c = with_set(&[&folder]).unwrap();
        assert_eq!(c.target.source, TargetSource::Folder(dir.path().to_path_buf()));
        assert!(c.taps_are_auto());
        assert_eq!(c.target_layer_ids(36).unwrap(), vec![1, 9, 17, 25, 33]);
        let c = with_set(&[&folder, "draft_model.target_layer_ids=[2, 4]"]).unwrap();
        assert!(!c.taps_are_auto());
        assert_eq!(c.target_layer_ids(36).unwrap(), vec![2, 4]);
        let c = with_set(&["draft_model.target_layer_ids=\"auto\"", "draft_model.num_hidden_layers=5"]).unwrap();
        assert!(c.taps_are_auto());
        assert_eq!(c.target_layer_ids(32).unwrap(), vec![1, 8, 15, 22, 29]);
        let err = c.target_layer_ids(6).unwrap_err().to_string();
        assert!(err.contains("too shallow") && err.contains("write the ids out"), "{err}");
        let err = with_set(&["draft_model.target_layer_ids=\"some\""]).unwrap_err().to_string();
        assert!(err.contains("\"auto\""), "{err}");
    }
}

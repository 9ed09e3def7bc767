//! Models: the frozen target (Qwen3 / Qwen3-MoE / Llama-3), the layers it shares with the drafter, HuggingFace config and
//! safetensors I/O, and the built-in presets.
use std::path::PathBuf;

pub mod attention;
pub mod batch_schedule;
pub mod batched;
pub mod choice;
pub mod config;
pub mod decoder;
pub mod drafter;
pub mod drafter_config;
pub mod flat_params;
pub mod fused;
pub mod generate;
pub mod init;
pub mod kv_cache;
pub mod layers;
pub mod moe;
pub mod presets;
pub mod sampling;
pub mod shared;
pub mod speculative;
pub mod speculators;
pub mod split;
pub mod staircase;
pub mod target;
pub mod variant;
pub mod weights;

pub use attention::LayerAttention;
pub use config::{Architecture, TargetConfig};
pub use decoder::Decoder;
pub use drafter::{BlockAttention, Drafter};
pub use drafter_config::DrafterConfig;
pub use init::Init;
pub use kv_cache::KvCache;
pub use presets::Preset;
pub use target::{Decoded, Depth, PartFault, Target};
pub use variant::Variant;

/// Everything that can go wrong reading, building or running a model, each naming the file or key and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{}: {reason}", path.display())]
    Config { path: PathBuf, reason: String },
    #[error(
        "{}: no model.safetensors or model.safetensors.index.json; point at a HuggingFace model folder",
        dir.display()
    )]
    NoWeights { dir: PathBuf },
    #[error(
        "{}: not a valid safetensors file ({reason}); it may be truncated or corrupt: download or export it again",
        path.display()
    )]
    Safetensors { path: PathBuf, reason: String },
    #[error("{}: {reason}", path.display())]
    Index { path: PathBuf, reason: String },
    #[error("tensor `{name}` is missing from {} ({source_file}); the folder does not match its config.json", dir.display())]
    MissingTensor { name: String, dir: PathBuf, source_file: &'static str },
    #[error("tensor `{name}` in {} has shape {found:?}, but {why} implies {expected:?}", path.display())]
    Shape { name: String, path: PathBuf, found: Vec<usize>, expected: Vec<usize>, why: String },
    #[error("tensor `{name}` in {} has dtype {dtype}; supported: BF16, F16, F32, F64", path.display())]
    Dtype { name: String, path: PathBuf, dtype: String },
    #[error("{0}")]
    Taps(String),
    #[error("invalid batch: {0}")]
    Batch(String),
    #[error("this target holds only the layers up to the last tap; load it with the full depth to run the whole stack")]
    NotFull,
    #[error("libtorch: {0}")]
    Torch(String),
    #[error("no device to place the target on: give at least one")]
    NoDevice,
    /// Two things that must agree do not (a checkpoint loaded into decoding set up for another drafter).
    #[error("{0}")]
    Mismatch(String),
    #[error(
        "the target's weights need {needs_gib:.1} GiB on {device}, which has {free_gib:.1} GiB free (over {devices} \
         device(s)): spread it over more GPUs (target.spread_to in serve-train, --spread in bench), or free that GPU"
    )]
    DoesNotFit { device: String, needs_gib: f64, free_gib: f64, devices: usize },
}

impl From<crate::device::DeviceError> for ModelError {
    fn from(e: crate::device::DeviceError) -> Self {
        ModelError::Torch(e.to_string())
    }
}

impl From<crate::ffi::DeviceFailure> for ModelError {
    fn from(e: crate::ffi::DeviceFailure) -> Self {
        ModelError::Torch(e.to_string())
    }
}

impl From<tch::TchError> for ModelError {
    fn from(e: tch::TchError) -> Self {
        ModelError::Torch(crate::torch_message(&e.to_string()))
    }
}

/// The reference fixtures the Python scripts under scripts/ write into tests/fixtures/ (CI runs no Python), read by
/// the unit tests that check dflash against them.
#[cfg(test)]
pub(crate) mod reference_fixture {
    use serde_json::Value;
    use tch::Tensor;

    /// The fixture file `name` of tests/fixtures/.
    pub fn read(name: &str) -> Value {
        let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}")))
            .unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// `case[key]`'s numbers as an f64 tensor of `shape`.
    pub fn floats(case: &Value, key: &str, shape: &[i64]) -> Tensor {
        let values: Vec<f64> = case[key].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        Tensor::from_slice(&values).view(shape)
    }

    /// Asserts that `ours` is within `tolerance` of the reference `theirs` everywhere, naming `what` and the error.
    pub fn assert_close(ours: &Tensor, theirs: &Tensor, tolerance: f64, what: &str) {
        let err = (ours - theirs).abs().max().double_value(&[]);
        assert!(err < tolerance, "{what}: off by {err}");
    }

    /// `case[key]`'s integers (or booleans, as 0 and 1) as an int64 tensor.
    pub fn ints(case: &Value, key: &str) -> Tensor {
        let values: Vec<i64> =
            case[key].as_array().unwrap().iter().map(|x| x.as_i64().or(x.as_bool().map(i64::from)).unwrap()).collect();
        Tensor::from_slice(&values)
    }
}

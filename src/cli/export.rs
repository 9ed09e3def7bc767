//! `dflash export`: a checkpoint's drafter as a standalone folder in z-lab's published DFlash layout or the
//! `speculators` format, or a built-in target preset (`tiny-tasks`, `tiny`) as a HuggingFace model folder, for
//! other tools to load.
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use tch::{Device, Kind};

use dflash::config::TargetSource;
use dflash::data::builtin::write_tiny_tokenizer;
use dflash::model::speculators::{self, Verifier};
use dflash::model::{Depth, Drafter, Preset, TargetConfig};
use dflash::train::checkpoint::{DRAFTER_DIR, TrainerState, newest_valid, verify_checkpoint};

#[derive(Clone, Copy, ValueEnum)]
pub enum ExportDtype {
    Bf16,
    F32,
}

/// How the drafter is laid out on disk.
#[derive(Clone, Copy, PartialEq, ValueEnum)]
pub enum ExportFormat {
    /// z-lab's published layout (config.json with dflash_config, model.safetensors): SGLang, vLLM's "dflash"
    /// method, z-lab's own code, `draft_model.init`.
    Zlab,
    /// The speculators 0.9.0 format (config.json with speculators_config): `vllm serve <folder>` detects it.
    Speculators,
}

#[derive(Args)]
pub struct ExportArgs {
    /// A checkpoint folder (ckpt-N), or a checkpoint.dir whose newest valid checkpoint is taken.
    #[arg(long, value_name = "DIR", required_unless_present = "preset", conflicts_with = "preset")]
    checkpoint: Option<PathBuf>,
    /// A built-in target instead: tiny-tasks, tiny, tiny-moe or tiny-gpt-oss (Qwen3-MoE and GPT-OSS folders), written as a HuggingFace model folder (config.json,
    /// model.safetensors, tokenizer.json, tokenizer_config.json with the chat template). tiny-tasks' weights are
    /// written as built in, so model.safetensors has the SHA-256 docs/targets.md states.
    #[arg(long, value_name = "PRESET")]
    preset: Option<Preset>,
    /// Where to write the folder (config.json + model.safetensors, and the tokenizer for a preset).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// The drafter's weights' dtype: bf16 as published, or f32 (the master weights as trained).
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: ExportDtype,
    /// zlab, or speculators (tapped layer i is written as i + 1, speculators' convention; see docs/serving.md).
    #[arg(long, value_enum, default_value = "zlab")]
    format: ExportFormat,
    /// speculators: the target the drafter serves beside, a model folder or a hub id (Qwen/Qwen3-8B), written into
    /// config.json; speculators loads the embedding and LM head from it. Default: the run's target.model when it is
    /// a folder.
    #[arg(long, value_name = "DIR|HUB_ID")]
    verifier: Option<String>,
    /// Write into --out even when it holds files other than an earlier export of the same kind (which is replaced
    /// without it).
    #[arg(long)]
    force: bool,
}

/// The files `export` writes: a folder holding only these, with a config.json of the same kind, is an earlier export
/// that running the command again replaces.
const EXPORTED_FILES: [&str; 4] = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"];

/// Refuses an `out` that holds anything but an earlier export its config.json says is of the same kind
/// (`same_kind`), unless `force`.
fn check_out(out: &Path, same_kind: impl Fn(&serde_json::Value) -> bool, force: bool) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(out) else { return Ok(()) };
    let names: Vec<String> = entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    if names.is_empty() || force {
        return Ok(());
    }
    let ours = names.iter().all(|n| EXPORTED_FILES.contains(&n.as_str()));
    if ours && config_json(out).is_some_and(|c| same_kind(&c)) {
        return Ok(());
    }
    let mut shown: Vec<&str> = names.iter().map(String::as_str).take(5).collect();
    shown.sort_unstable();
    let more = if names.len() > 5 { format!(" and {} more", names.len() - 5) } else { String::new() };
    bail!(
        "--out {}: holds {}{more}, not an earlier export of this kind; nothing written. Give a new or empty folder, \
         or --force to write into it anyway",
        out.display(),
        shown.join(", ")
    )
}

/// A drafter's config.json (either format).
fn is_drafter_config(config: &serde_json::Value) -> bool {
    config.get("dflash_config").is_some() || config.get("speculators_config").is_some()
}

/// A folder that `export` (or a run's end, as `final/`) wrote: a drafter's config.json and weights, no checkpoint.
fn is_exported_drafter(dir: &Path) -> bool {
    dir.join("model.safetensors").is_file() && config_json(dir).is_some_and(|c| is_drafter_config(&c))
}

/// `dir/config.json`, where there is one that parses.
fn config_json(dir: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    serde_json::from_str(&text).ok()
}

pub fn run(args: ExportArgs) -> Result<ExitCode> {
    if let Some(preset) = args.preset {
        let target = preset.spec().target;
        let same_preset = |c: &serde_json::Value| {
            let number = |key: &str| c.get(key).and_then(serde_json::Value::as_u64).map(|n| n as usize);
            number("hidden_size") == Some(target.hidden_size)
                && number("num_hidden_layers") == Some(target.num_hidden_layers)
                && number("vocab_size") == Some(target.vocab_size)
        };
        check_out(&args.out, same_preset, args.force)?;
        export_preset(preset, &args.out)?;
        println!("exported the {preset} target to {} (a HuggingFace model folder)", args.out.display());
        return Ok(ExitCode::SUCCESS);
    }
    let Some(checkpoint) = args.checkpoint else {
        bail!("give --checkpoint DIR or --preset NAME");
    };
    if is_exported_drafter(&checkpoint) && !checkpoint.join("MANIFEST").exists() {
        let run = checkpoint.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("RUN_DIR"));
        bail!(
            "--checkpoint {}: already an exported drafter (config.json and model.safetensors, as a run's final/ and \
             `export` write them): serve it or evaluate it as it is (`dflash eval --decode --drafter {}`). To export \
             a run's checkpoint again, in another format or dtype, give its checkpoint.dir: --checkpoint {}",
            checkpoint.display(),
            checkpoint.display(),
            run.display()
        );
    }
    check_out(&args.out, is_drafter_config, args.force)?;
    let (ckpt, state) = if checkpoint.join("MANIFEST").exists() {
        let state = verify_checkpoint(&checkpoint)?;
        (checkpoint.clone(), state)
    } else {
        newest_checkpoint(&checkpoint)?
    };
    let kind = match args.dtype {
        ExportDtype::Bf16 => Kind::BFloat16,
        ExportDtype::F32 => Kind::Float,
    };
    let drafter = Drafter::load(&ckpt.join(DRAFTER_DIR), Device::Cpu, Kind::Float)?;
    // Checked before anything is written.
    let speculators_config = match args.format {
        ExportFormat::Zlab => None,
        ExportFormat::Speculators => {
            let verifier = verifier(args.verifier.as_deref(), &state, drafter.config().decoder.hidden_size)?;
            let dtype = dflash::device::kind_name(kind);
            Some(speculators::config_json(drafter.config(), &verifier, dtype).map_err(anyhow::Error::msg)?)
        }
    };
    drafter.save(&args.out, kind)?;
    if let Some(config) = speculators_config {
        // Replaces z-lab's config.json whole: a failed write leaves the zlab folder, never a torn config.
        let (path, staged) = (args.out.join("config.json"), args.out.join(".config.json.tmp"));
        std::fs::write(&staged, serde_json::to_string_pretty(&config)?)
            .and_then(|()| std::fs::rename(&staged, &path))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    println!("exported {} to {}", ckpt.display(), args.out.display());
    Ok(ExitCode::SUCCESS)
}

/// The newest valid checkpoint in a run's `checkpoint.dir` (the invalid ones passed over are said on stderr).
pub(super) fn newest_checkpoint(dir: &Path) -> Result<(PathBuf, TrainerState)> {
    let scan = newest_valid(dir, &|_| true)?;
    for (_, why) in scan.rejected {
        eprintln!("skipping an invalid checkpoint: {why}");
    }
    scan.newest.with_context(|| format!("{}: no valid checkpoint here", dir.display()))
}

/// The target a speculators export names: `--verifier`, else the run's target folder (a folder by its absolute
/// path). A local folder's `config.json` gives its architecture and depth (and must have the drafter's hidden size); for a hub id they are
/// the run's target's.
fn verifier(given: Option<&str>, state: &TrainerState, hidden_size: usize) -> Result<Verifier> {
    let trained = state.config.pointer("/target/model").and_then(|m| m.as_str()).unwrap_or_default().to_string();
    let name = match given {
        Some(v) => v.to_string(),
        None if Path::new(&trained).is_dir() => trained.clone(),
        None => bail!(
            "--format speculators needs --verifier: the target the drafter serves beside, a model folder or a hub id \
             (the run trained on {trained:?}, which is not a folder)"
        ),
    };
    let from = if Path::new(&name).is_dir() { name.clone() } else { trained.clone() };
    let target = match TargetSource::from_arg(&from) {
        TargetSource::Folder(dir) => TargetConfig::from_dir(&dir).with_context(|| format!("--verifier {name}"))?,
        TargetSource::Preset(p) => p.spec().target,
    };
    if target.hidden_size != hidden_size {
        bail!("--verifier {name}: hidden size {}, the drafter's is {hidden_size}: another model", target.hidden_size);
    }
    // A local folder is named by its absolute path: the export is read from elsewhere (vLLM's working directory).
    let name_or_path = match Path::new(&name).is_dir() {
        true => {
            std::fs::canonicalize(&name).with_context(|| format!("--verifier {name}"))?.to_string_lossy().into_owned()
        }
        false => name,
    };
    Ok(Verifier {
        name_or_path,
        architectures: vec![target.architecture.hf_class().to_string()],
        num_hidden_layers: target.num_hidden_layers,
    })
}

/// The preset as a HuggingFace folder: its weights (built-in bytes as they are, or the random ones drawn), its
/// config and the tiny tokenizer. Only the tiny family has a tokenizer to go with it.
fn export_preset(preset: Preset, out: &std::path::Path) -> Result<()> {
    if !preset.is_tiny() {
        bail!(
            "--preset {preset}: only tiny-tasks, tiny, tiny-moe and tiny-gpt-oss can be exported (the others have no tokenizer)"
        );
    }
    let spec = preset.spec();
    let target = spec.build_target(Depth::Full, Device::Cpu, Kind::Float)?;
    match spec.weights {
        // The trained weights built into the binary, as they are.
        Some(bytes) => {
            let path = out.join("model.safetensors");
            std::fs::create_dir_all(out).with_context(|| format!("--out {}", out.display()))?;
            std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
            target.save_hf_config(out).with_context(|| format!("--out {}", out.display()))?;
        }
        None => target.save_hf(out, usize::MAX).with_context(|| format!("--out {}", out.display()))?,
    }
    write_tiny_tokenizer(out).with_context(|| format!("--out {}", out.display()))?;
    Ok(())
}

//! Live reload (SIGHUP, `POST /reload`): the configuration's layers are reread and the whole result validated; it
//! is accepted only if every changed key is one a running service can change ([`RELOADABLE`]) and its derived
//! values resolve. Nothing is applied here: the supervisor swaps an accepted configuration in at a step boundary.
use serde::Serialize;

use crate::config::{Change, Config, Layers, RELOADABLE, diff, resume_changes};

/// A reread configuration that may replace the running one.
pub struct Accepted {
    pub config: Config,
    /// Every changed key, with both values (none outside [`RELOADABLE`]).
    pub changes: Vec<Change>,
    /// The loss-weight decay the new `objective.gamma` resolves to.
    pub gamma: Option<f64>,
}

/// A reload that was applied.
#[derive(Debug, Clone, Serialize)]
pub struct Reloaded {
    pub config_version: u64,
    /// The first step trained with the new values (on every drafter); `None` when nothing changed.
    pub applies_from_step: Option<u64>,
    pub changes: Vec<Change>,
}

const KEPT: &str = "; the running configuration stays in effect";

/// Rereads `layers` against the running `current` (drafter block size `block_size`). `Ok(None)`: nothing changed.
/// `check` vets the new configuration further (for example, that evaluation prompts exist when it turns them on).
/// Errors say why, and that the running configuration stays.
pub fn reread(
    current: &Config,
    layers: &Layers,
    block_size: usize,
    check: impl FnOnce(&Config) -> Result<(), String>,
) -> Result<Option<Accepted>, String> {
    let mut config = Config::load(layers).map_err(|e| format!("{e}{KEPT}"))?;
    // Keys left to `auto` (the taps, the MASK token) keep what the running configuration resolved them to: the
    // comparison is of resolved values, not of the word `auto` against the ids it became.
    config.adopt_resolved(&current.merged);
    let changes = diff(&current.merged, &config.merged);
    if let Some(advice) = advice_for_fixed(&current.merged, &config.merged) {
        return Err(format!("{advice}{KEPT}"));
    }
    if changes.is_empty() {
        return Ok(None);
    }
    let gamma = config.objective.gamma.resolve(block_size).map_err(|e| format!("{e}{KEPT}"))?;
    check(&config).map_err(|e| format!("{e}{KEPT}"))?;
    Ok(Some(Accepted { config, changes, gamma }))
}

/// What to do about the keys a reload cannot change, `None` when there are none. The advice follows what
/// `serve-train --resume auto` accepts ([`resume_changes`]): a key it takes from the file is changed by a restart,
/// one that defines the run (what its checkpoints mean) only by a new run.
fn advice_for_fixed(running: &serde_json::Value, new: &serde_json::Value) -> Option<String> {
    let (defining, resumable) = resume_changes(running, new);
    let names = |changes: &[Change]| -> Vec<String> {
        changes.iter().filter(|c| !RELOADABLE.contains(&c.key.as_str())).map(|c| c.key.clone()).collect()
    };
    let (defining, resumable) = (names(&defining), names(&resumable));
    let mut advice = Vec::new();
    if !resumable.is_empty() {
        advice.push(format!(
            "{} cannot change while the service runs: stop it (SIGTERM or Ctrl-C checkpoints it) and start it again \
             with --resume auto to change them",
            resumable.join(", ")
        ));
    }
    if !defining.is_empty() {
        advice.push(format!(
            "{} define the run (what its checkpoints mean) and cannot change in it, not even on resume: start a new \
             run in another checkpoint.dir to change them",
            defining.join(", ")
        ));
    }
    (!advice.is_empty()).then(|| advice.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of its own per call (a reread reads the file again).
    fn layers(dir: &std::path::Path, text: &str) -> Layers {
        let n = std::fs::read_dir(dir).unwrap().count();
        let file = dir.join(format!("run-{n}.toml"));
        std::fs::write(&file, text).unwrap();
        Layers { file: Some(file), set: vec!["optim.epochs=2".into()], ..Layers::default() }
    }

    #[test]
    fn only_reloadable_keys_may_change_and_the_whole_file_must_be_valid() {
        let dir = tempfile::tempdir().unwrap();
        let base = "[optim]\nlr = 2e-3\n[data]\nbatch_size = 2\n";
        let current = Config::load(&layers(dir.path(), base)).unwrap();
        let ok = |_: &Config| Ok(());

        let same = layers(dir.path(), base);
        assert!(reread(&current, &same, 16, ok).unwrap().is_none(), "nothing changed");

        let lr = layers(dir.path(), "[optim]\nlr = 1e-3\nweight_decay = 0.01\n[data]\nbatch_size = 2\n");
        let accepted = reread(&current, &lr, 16, ok).unwrap().unwrap();
        let keys: Vec<&str> = accepted.changes.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(keys, ["optim.lr", "optim.weight_decay"]);
        assert_eq!((accepted.config.optim.lr, accepted.gamma), (1e-3, Some(7.0)));
        assert_eq!(accepted.config.optim.epochs, 2, "--set values stay layered on top");

        let batch = layers(dir.path(), "[optim]\nlr = 1e-3\n[data]\nbatch_size = 3\n");
        let err = reread(&current, &batch, 16, ok).err().unwrap();
        assert!(err.contains("data.batch_size") && err.contains("another checkpoint.dir") && err.contains("stays"));
        assert!(!err.contains("--resume auto"), "a resume refuses a changed batch size: {err}");

        let broken = layers(dir.path(), "[optim\nlr = 1e-3\n");
        let err = reread(&current, &broken, 16, ok).err().unwrap();
        assert!(err.contains(".toml") && err.contains("stays"), "{err}");

        let invalid = layers(dir.path(), "[optim]\nlr = -1\n[data]\nbatch_size = 2\n");
        let err = reread(&current, &invalid, 16, ok).err().unwrap();
        assert!(err.contains("optim.lr"), "{err}");

        // Derived values must resolve too: "auto" gamma has no default for a block size of 12.
        let err = reread(&current, &lr, 12, ok).err().unwrap();
        assert!(err.contains("block size 12"), "{err}");
        let err = reread(&current, &lr, 16, |_| Err("no prompts".into())).err().unwrap();
        assert!(err.starts_with("no prompts"), "{err}");
    }

    /// Every key a reload refuses gets advice that works: "--resume auto" only for what a resume takes from the file,
    /// a new run for what a resume refuses, as `resume_changes` (what `serve-train --resume auto` runs) decides.
    #[test]
    fn the_advice_for_a_refused_key_is_what_a_resume_does_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let current = Config::load(&layers(dir.path(), "")).unwrap();
        let ok = |_: &Config| Ok(());
        let edits = [
            ("[draft_model]\nnum_hidden_layers = 3\n", "draft_model.num_hidden_layers"),
            ("[objective]\nseed = 9\n", "objective.seed"),
            ("[drafters]\ndevices = [\"cpu\", \"cpu\", \"cpu\"]\n", "drafters.devices"),
            ("[data]\nledger = \"elsewhere.jsonl\"\n", "data.ledger"),
            ("[optim]\nmax_steps = 9\n", "optim.max_steps"),
        ];
        for (edit, key) in edits {
            let err = reread(&current, &layers(dir.path(), edit), 16, ok).err().expect(key);
            let edited = Config::load(&layers(dir.path(), edit)).unwrap();
            let (refused, _) = resume_changes(&current.merged, &edited.merged);
            let a_resume_refuses = refused.iter().any(|c| c.key == key);
            let advice = err.split("; ").find(|part| part.contains(key)).expect(key);
            assert_eq!(advice.contains("--resume auto"), !a_resume_refuses, "{key}: {err}");
            assert_eq!(advice.contains("new run in another checkpoint.dir"), a_resume_refuses, "{key}: {err}");
        }
    }

    /// With a model folder the taps and the MASK token default to `auto`, which the running configuration holds
    /// resolved: a reload that changes only the learning rate is accepted (it was refused as a change of the taps).
    #[test]
    fn keys_left_to_auto_compare_as_resolved() {
        let dir = tempfile::tempdir().unwrap();
        let model = tempfile::tempdir().unwrap();
        let base = format!("[target]\nmodel = {:?}\n[optim]\nlr = 2e-3\n", model.path().display().to_string());
        let mut current = Config::load(&layers(dir.path(), &base)).unwrap();
        assert!(current.taps_are_auto() && current.mask_is_auto());
        current.resolve_auto(&[1, 9, 17], 151669);
        let ok = |_: &Config| Ok(());

        let lr = layers(dir.path(), &base.replace("2e-3", "1e-3"));
        let accepted = reread(&current, &lr, 16, ok).unwrap().unwrap();
        let keys: Vec<&str> = accepted.changes.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(keys, ["optim.lr"]);
        assert!(reread(&current, &layers(dir.path(), &base), 16, ok).unwrap().is_none(), "nothing changed");

        // Taps written out that differ from the resolved ones are a change, and refused.
        let taps = layers(dir.path(), &format!("{base}[draft_model]\ntarget_layer_ids = [1, 2, 3]\n"));
        let err = reread(&current, &taps, 16, ok).err().unwrap();
        assert!(err.contains("draft_model.target_layer_ids"), "{err}");
    }
}

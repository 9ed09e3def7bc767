//! A run keeps the recipe it began with when a built-in default changes. Every checkpoint stores the configuration
//! its run used, but a key newer than the checkpoint's build is absent there, and a key the user never set took the
//! default of its day. Without this, a resume (or a host joining a resumed run) would take today's default for such a
//! key as if the user had changed it, and switch a run's recipe half way: a drafter trained on one loss for 90% of
//! its steps and on another for the rest. So each key whose default has changed is listed with the default it first
//! had; a resume keeps the run's value for it unless the user sets the key (file, environment or `--set`).
use serde_json::{Value, json};

use super::lookup;

/// Keys whose built-in default has changed, each with its first default: what a run that left the key unset
/// trained with when its checkpoint does not name the key (its build predates the key).
pub fn first_defaults() -> Vec<(&'static str, Value)> {
    vec![
        // D-PACE since 2026-12-03 (BENCHMARKS.md, "The recipe on the real model").
        ("objective.weights", json!("decay")),
    ]
}

/// The configuration a checkpoint's run trained with: its stored tree, with each key of [`first_defaults`] it lacks
/// at the key's first default.
pub fn as_trained(stored: &Value) -> Value {
    let mut tree = stored.clone();
    for (key, first) in first_defaults() {
        let Some((section, name)) = key.split_once('.') else { continue };
        if lookup(&tree, key).is_some() {
            continue;
        }
        if let Some(root) = tree.as_object_mut() {
            let section = root.entry(section).or_insert_with(|| json!({}));
            if let Some(section) = section.as_object_mut() {
                section.insert(name.to_string(), first);
            }
        }
    }
    tree
}

/// The keys of [`first_defaults`] that this process leaves to the built-in default (`user_set` says which it does
/// not) whose value in the run (`run`, read with [`as_trained`] or from rank 0) differs from this process's
/// (`current`): each with the run's value, which the process must take to continue the run as it began.
pub fn kept_from_run(
    run: impl Fn(&str) -> Option<Value>,
    current: impl Fn(&str) -> Option<Value>,
    user_set: impl Fn(&str) -> bool,
) -> Vec<(String, Value)> {
    first_defaults()
        .into_iter()
        .filter(|(key, _)| !user_set(key))
        .filter_map(|(key, _)| {
            let theirs = run(key)?;
            (current(key).as_ref() != Some(&theirs)).then(|| (key.to_string(), theirs))
        })
        .collect()
}

/// `--set` items that give each kept key its run's value.
pub fn as_overrides(kept: &[(String, Value)]) -> Vec<String> {
    kept.iter().map(|(key, value)| format!("{key}={value}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, Layers};

    #[test]
    fn a_checkpoint_that_predates_a_key_trained_with_its_first_default() {
        let stored = json!({"objective": {"num_anchors": 4}, "optim": {"lr": 1e-3}});
        let trained = as_trained(&stored);
        assert_eq!(lookup(&trained, "objective.weights"), Some(&json!("decay")));
        assert_eq!(lookup(&trained, "objective.num_anchors"), Some(&json!(4)));
        // A value the checkpoint stores is what it trained with.
        let stored = json!({"objective": {"weights": "dpace"}});
        assert_eq!(lookup(&as_trained(&stored), "objective.weights"), Some(&json!("dpace")));
        // A checkpoint without the section at all.
        assert_eq!(lookup(&as_trained(&json!({})), "objective.weights"), Some(&json!("decay")));
    }

    #[test]
    fn a_resume_keeps_the_runs_value_of_a_changed_default_unless_the_user_sets_the_key() {
        let today = Config::builtin().unwrap().merged;
        let current = |key: &str| lookup(&today, key).cloned();
        assert_eq!(current("objective.weights"), Some(json!("dpace")), "the default this module's table follows");
        let old_run = as_trained(&json!({"objective": {"num_anchors": 4}}));
        let run = |key: &str| lookup(&old_run, key).cloned();

        let kept = kept_from_run(run, current, |_| false);
        assert_eq!(kept, vec![("objective.weights".to_string(), json!("decay"))]);
        assert_eq!(as_overrides(&kept), vec!["objective.weights=\"decay\"".to_string()]);
        // The overrides load as the run's value.
        let layers = Layers { set: as_overrides(&kept), ..Layers::default() };
        assert_eq!(Config::load(&layers).unwrap().objective.weights, crate::config::SlotWeights::Decay);

        // Set by the user: theirs, whatever the run had (a resume then says what changed, or refuses).
        assert!(kept_from_run(run, current, |key| key == "objective.weights").is_empty());
        // A run that already trains with today's default keeps nothing.
        let new_run = json!({"objective": {"weights": "dpace"}});
        assert!(kept_from_run(|k| lookup(&new_run, k).cloned(), current, |_| false).is_empty());
        // Rank 0 of a run whose settings lack the key (a flat map that does not name it) asks nothing of a host.
        assert!(kept_from_run(|_| None, current, |_| false).is_empty());
    }
}

//! The drafter's shape from `[draft_model]` and the target, with what `auto` resolves to and why: serve-train builds
//! (and logs) it, `config show` prints it, so a user sees the taps and the MASK token before the data is prepared.
use std::collections::HashSet;

use anyhow::{Context, Result};
use serde_json::Map;

use crate::config::{Config, TargetSource};
use crate::data::chat::ChatTemplate;
use crate::data::tokenize::{TextTokenizer, declared_special_tokens};
use crate::model::{DrafterConfig, TargetConfig};

/// The drafter's configuration, and for each value left to `auto` the rule that gave it.
pub struct Shape {
    pub target: TargetConfig,
    pub drafter: DrafterConfig,
    /// Why the taps are what they are, when `auto` chose them.
    pub taps_rule: Option<String>,
    /// Why the MASK token is what it is, when `auto` chose it.
    pub mask_rule: Option<String>,
}

/// The drafter's configuration from `[draft_model]` and the target. What `auto` leaves to a rule (the default with a
/// model folder) is resolved here: the taps by z-lab's rule, the MASK token by the tokenizer
/// (`TextTokenizer::unused_mask_token`); with `draft_model.init`, both are the published drafter's.
pub fn shape(config: &Config) -> Result<Shape> {
    let target = match &config.target.source {
        TargetSource::Preset(p) => p.spec().target,
        TargetSource::Folder(dir) => TargetConfig::from_dir(dir)?,
    };
    // The published drafter (`draft_model.init`) when `auto` takes its values, and how the rule names it.
    let published = match &config.draft_model.init {
        Some(dir) if config.taps_are_auto() || config.mask_is_auto() => Some((
            DrafterConfig::from_dir(dir).with_context(|| format!("draft_model.init = {}", dir.display()))?,
            format!("the published drafter's, {}", dir.display()),
        )),
        _ => None,
    };
    let taps = match (&published, config.taps_are_auto()) {
        (Some((p, _)), true) => p.target_layer_ids.clone(),
        _ => config.target_layer_ids(target.num_hidden_layers)?,
    };
    let taps_rule = config.taps_are_auto().then(|| match &published {
        Some((_, from)) => from.clone(),
        None => {
            let layers = config.draft_model.num_hidden_layers;
            let plural = if layers == 1 { "" } else { "s" };
            format!("z-lab's rule for {} target layers and {layers} draft layer{plural}", target.num_hidden_layers)
        }
    });
    let (mask, mask_rule) = match (&config.target.source, config.draft_model.mask_token_id, &published) {
        (_, Some(m), _) => (m, None),
        (TargetSource::Preset(p), None, _) => (p.spec().mask_token_id, None),
        (TargetSource::Folder(_), None, Some((p, from))) => (p.mask_token_id, Some(from.clone())),
        (TargetSource::Folder(dir), None, None) => {
            let auto = |e: String| anyhow::anyhow!("draft_model.mask_token_id = auto: {e}");
            let tokenizer = TextTokenizer::from_dir(dir).map_err(auto)?;
            let declared = declared_special_tokens(dir).map_err(auto)?;
            // A folder without a chat template (a base model) writes no tokens around the text.
            let written = match ChatTemplate::from_dir(dir, &Map::new()) {
                Ok(template) => template.token_ids_written(&tokenizer).map_err(auto)?,
                Err(_) => HashSet::new(),
            };
            let (id, why) = tokenizer.unused_mask_token(target.vocab_size, &declared, &written).map_err(auto)?;
            (id as i64, Some(why))
        }
    };
    let dm = &config.draft_model;
    let drafter =
        DrafterConfig::for_target(&target, dm.num_hidden_layers, dm.intermediate_size, dm.block_size, taps, mask)
            .and_then(|d| d.with_layer_attention(dm.layer_attention.clone()))
            .and_then(|d| d.with_variant(dm.variant))
            .map_err(|e| anyhow::anyhow!("[draft_model]: {e}"))?;
    Ok(Shape { target, drafter, taps_rule, mask_rule })
}

/// `shape`, with what `auto` resolved to logged.
pub fn drafter_config(config: &Config) -> Result<(TargetConfig, DrafterConfig)> {
    let s = shape(config)?;
    if let Some(rule) = &s.taps_rule {
        tracing::info!("draft_model.target_layer_ids = auto: {:?} ({rule})", s.drafter.target_layer_ids);
    }
    if let Some(rule) = &s.mask_rule {
        tracing::info!("draft_model.mask_token_id = auto: {} ({rule})", s.drafter.mask_token_id);
    }
    Ok((s.target, s.drafter))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Layers;
    use crate::model::{Drafter, Init, Preset};
    use tch::{Device, Kind};

    /// `auto` taps with `draft_model.init` are the published drafter's, not the rule's (which would give [4] for the
    /// tiny target's 8 layers and one draft layer).
    #[test]
    fn auto_taps_with_a_published_drafter_are_its_taps() {
        let dir = tempfile::tempdir().unwrap();
        let spec = Preset::Tiny.spec();
        let published = DrafterConfig::for_target(&spec.target, 1, None, 4, vec![1, 3, 5], spec.mask_token_id).unwrap();
        Drafter::new(published, Device::Cpu, Kind::Float, Init::Portable(1))
            .unwrap()
            .save(dir.path(), Kind::Float)
            .unwrap();
        let layers = |set: Vec<String>| Layers { set, ..Layers::default() };
        let base = vec![
            "target.model=tiny".to_string(),
            "draft_model.num_hidden_layers=1".into(),
            "draft_model.block_size=4".into(),
            "draft_model.target_layer_ids=\"auto\"".into(),
        ];
        let rule = Config::load(&layers(base.clone())).unwrap();
        assert_eq!(drafter_config(&rule).unwrap().1.target_layer_ids, vec![4]);
        let mut with_init = base;
        with_init.push(format!("draft_model.init={}", dir.path().display()));
        let config = Config::load(&layers(with_init)).unwrap();
        assert_eq!(drafter_config(&config).unwrap().1.target_layer_ids, vec![1, 3, 5]);
    }
}

//! `dflash config`: the configuration a command would run with, each value with the layer it came from, and the
//! built-in defaults with their explanations (what every error about a key points to).
use anyhow::Result;
use clap::Subcommand;

use dflash::config::{Config, DEFAULT_TOML, Layers, TargetSource};
use dflash::service::drafter_shape::shape;

#[derive(Subcommand)]
pub enum ConfigCommand {
    /// The merged configuration (defaults, --config, DFLASH__* variables, --set), each key with where it came from
    Show,
    /// The built-in defaults: every key, explained (config/default.toml)
    Defaults,
}

pub fn run(config: &Config, layers: &Layers, command: ConfigCommand) -> Result<()> {
    match command {
        ConfigCommand::Defaults => print!("{DEFAULT_TOML}"),
        ConfigCommand::Show => print!("{}{}", show(config, layers), resolved_auto(config)),
    }
    Ok(())
}

/// The merged tree as TOML in the defaults' order, one `key = value  # origin` line per key.
fn show(config: &Config, layers: &Layers) -> String {
    let order = default_order();
    let rank = |name: &str| order.iter().position(|n| n == name).unwrap_or(usize::MAX);
    let mut out = String::new();
    let Some(sections) = config.merged.as_object() else { return out };
    let mut sections: Vec<_> = sections.iter().collect();
    sections.sort_by_key(|(s, _)| (rank(&format!("[{s}]")), s.to_string()));
    for (section, values) in sections {
        let Some(values) = values.as_object() else { continue };
        out.push_str(&format!("[{section}]\n"));
        let mut values: Vec<_> = values.iter().collect();
        values.sort_by_key(|(k, _)| (rank(&format!("{section}.{k}")), k.to_string()));
        for (key, value) in values {
            let shown = toml::Value::try_from(value).map_or_else(|_| value.to_string(), |v| v.to_string());
            let line = format!("{key} = {shown}");
            out.push_str(&format!("{line:<48} # {}\n", layers.origin(&format!("{section}.{key}"))));
        }
        out.push('\n');
    }
    out
}

/// What the keys left to `auto` (the taps and the MASK token, with a model folder) resolve to and by which rule, as
/// comments: what serve-train will use, seen before any data is prepared. A folder that cannot be read yet says why.
fn resolved_auto(config: &Config) -> String {
    let (taps, mask) = (config.taps_are_auto(), config.mask_is_auto());
    if !taps && !mask {
        return String::new();
    }
    let target = match &config.target.source {
        TargetSource::Folder(dir) => dir.display().to_string(),
        TargetSource::Preset(p) => p.to_string(),
    };
    let mut out = format!("# What `auto` resolves to for {target}:\n");
    match shape(config) {
        Ok(s) => {
            let lines = [
                ("target_layer_ids", format!("{:?}", s.drafter.target_layer_ids), s.taps_rule),
                ("mask_token_id", s.drafter.mask_token_id.to_string(), s.mask_rule),
            ];
            for (key, value, rule) in lines {
                if let Some(rule) = rule {
                    out.push_str(&format!("# draft_model.{key} = {value}  ({rule})\n"));
                }
            }
        }
        Err(e) => out.push_str(&format!("#   not resolved yet: {e:#}\n")),
    }
    out
}

/// Sections (`[name]`) and keys (`section.key`, commented-out ones included) in the order the defaults list them.
fn default_order() -> Vec<String> {
    let mut order = Vec::new();
    let mut section = String::new();
    for line in DEFAULT_TOML.lines() {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.to_string();
            order.push(format!("[{name}]"));
        } else if let Some((key, _)) = line.trim_start_matches("# ").split_once(" = ")
            && !key.is_empty()
            && key.chars().all(|c| c.is_ascii_lowercase() || c == '_')
        {
            order.push(format!("{section}.{key}"));
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key in the defaults' order, each with the layer that set it last.
    #[test]
    fn show_says_where_each_value_came_from() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("run.toml");
        std::fs::write(&file, "[optim]\nlr = 1e-4\nepochs = 2\n").unwrap();
        let layers = Layers {
            file: Some(file.clone()),
            env: vec![("DFLASH__OPTIM__EPOCHS".into(), "3".into())],
            set: vec!["optim.epochs=4".into(), "data.batch_size=3".into()],
        };
        let config = Config::load(&layers).unwrap();
        let text = show(&config, &layers);
        let line = |key: &str| text.lines().find(|l| l.starts_with(&format!("{key} = "))).unwrap().to_string();
        assert!(line("lr").contains("0.0001") && line("lr").ends_with(&format!("# {}", file.display())), "{text}");
        assert!(line("epochs").starts_with("epochs = 4") && line("epochs").ends_with("# --set"), "{text}");
        assert!(line("batch_size").ends_with("# --set") && line("max_len").ends_with("# default"), "{text}");
        assert!(text.starts_with("[target]\nmodel = "), "the defaults' order: {text}");
        let env = Layers { env: vec![("DFLASH__OPTIM__EPOCHS".into(), "3".into())], ..Layers::default() };
        let text = show(&Config::load(&env).unwrap(), &env);
        assert!(text.contains("# environment DFLASH__OPTIM__EPOCHS"), "{text}");
    }
}

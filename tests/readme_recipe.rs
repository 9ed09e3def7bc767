//! The documentation's commands as written: README's "Train a drafter for your model" `run.toml` files load
//! (`dflash config show`), and every `dflash` command of every shell block in README.md and docs/ parses, flags and
//! values (run with `--help` appended: clap refuses an unknown flag or a bad value before it reaches the help). Most
//! of them need an 8B model and a GPU; `scripts/checks/check_readme.sh` runs the blocks marked CPU-runnable.
mod doc_blocks;

use std::process::Command;

use doc_blocks::doc_block;

#[test]
fn both_run_tomls_load_as_written() {
    for (marker, expect) in [("# run.toml, one GPU", "devices = [\"cuda:0\"]"), ("# run.toml, eight GPUs", "\"nccl\"")]
    {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("models/Qwen3-8B")).unwrap();
        std::fs::write(dir.path().join("run.toml"), doc_block("README.md", "toml", marker)).unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_dflash"))
            .args(["--config", "run.toml", "config", "show"])
            .current_dir(dir.path())
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "{marker}: {err}");
        assert!(out.contains("model = \"models/Qwen3-8B\"") && out.contains(expect), "{marker}: {out}");
        assert!(out.contains("# run.toml"), "the values come from the file: {out}");
    }
}

/// Every configuration the repository ships loads as the docs run it: `config show` from the clone's root, with the
/// model folder it names in place.
#[test]
fn every_shipped_config_loads() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    for entry in std::fs::read_dir(root.join("config")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") || path.ends_with("default.toml") {
            continue;
        }
        let dir = tempfile::tempdir().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let model = text.lines().find_map(|l| l.strip_prefix("model = \"")).and_then(|m| m.strip_suffix('"'));
        if let Some(model) = model.filter(|m| m.contains('/')) {
            std::fs::create_dir_all(dir.path().join(model)).unwrap();
        }
        std::fs::create_dir_all(dir.path().join("config")).unwrap();
        std::fs::copy(&path, dir.path().join("config").join(path.file_name().unwrap())).unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_dflash"))
            .arg("--config")
            .arg(std::path::Path::new("config").join(path.file_name().unwrap()))
            .args(["config", "show"])
            .current_dir(dir.path())
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}: {}", path.display(), String::from_utf8_lossy(&o.stderr));
        checked += 1;
    }
    assert!(checked >= 2, "make-run.toml and smollm2-135m.toml at least");
}

#[test]
fn every_dflash_command_of_the_docs_parses() {
    let mut commands = Vec::new();
    for page in doc_blocks::doc_pages() {
        for block in doc_blocks::doc_blocks(&page, "bash") {
            let joined = block.replace("\\\n", " ");
            commands.extend(
                joined
                    .lines()
                    .map(str::trim)
                    .filter(|l| l.starts_with("dflash "))
                    .map(|l| (page.clone(), l.to_string())),
            );
        }
    }
    // The recipe alone has 9; the quick start, data, evaluation and serving pages add theirs.
    assert!(commands.len() >= 25, "{commands:#?}");
    assert!(commands.iter().any(|(_, c)| c.starts_with("dflash regenerate --endpoint")), "{commands:#?}");
    let dir = tempfile::tempdir().unwrap();
    for (page, command) in commands {
        // `dflash` as a shell function that asks for the help after the documented arguments.
        let script = format!("dflash() {{ \"$BIN\" \"$@\" --help > /dev/null; }}\n{command}");
        let o = Command::new("bash")
            .args(["-c", &script])
            .env("BIN", env!("CARGO_BIN_EXE_dflash"))
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(o.status.success(), "{page}: {command}: {}", String::from_utf8_lossy(&o.stderr));
    }
}

/// Every key of the built-in configuration has a row in docs/configuration.md's table ("| `section.key`", or a row
/// naming several keys of one section, "| `optim.lr`, `betas`").
#[test]
fn every_configuration_key_is_in_the_documentation_table() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let defaults: toml::Table = std::fs::read_to_string(root.join("config/default.toml")).unwrap().parse().unwrap();
    let doc = std::fs::read_to_string(root.join("docs/configuration.md")).unwrap();
    let mut documented = std::collections::HashSet::new();
    for row in doc.lines().filter(|l| l.starts_with("| `")) {
        let cell = row.split(" | ").next().unwrap();
        let names: Vec<&str> = cell.split('`').skip(1).step_by(2).collect();
        let section = names[0].rsplit_once('.').map_or("", |(s, _)| s);
        documented.insert(names[0].to_string());
        documented.extend(names[1..].iter().map(|n| format!("{section}.{n}")));
    }
    let mut missing = Vec::new();
    for (section, keys) in &defaults {
        for key in keys.as_table().unwrap().keys() {
            let key = format!("{section}.{key}");
            if !documented.contains(&key) {
                missing.push(key);
            }
        }
    }
    assert!(missing.is_empty(), "keys without a row in docs/configuration.md: {missing:?}");
}

/// docs/operations.md's Kubernetes manifest gives a starting pod longer than the default wait for a held checkpoint
/// folder (during which nothing answers its probes) before its liveness probe may kill it.
#[test]
fn the_kubernetes_manifest_outwaits_a_held_checkpoint_folder() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let defaults: toml::Table = std::fs::read_to_string(root.join("config/default.toml")).unwrap().parse().unwrap();
    let wait = defaults["checkpoint"]["lock_wait_s"]
        .as_float()
        .or(defaults["checkpoint"]["lock_wait_s"].as_integer().map(|i| i as f64))
        .unwrap();
    let doc = std::fs::read_to_string(root.join("docs/operations.md")).unwrap();
    let probe = doc.lines().find(|l| l.trim_start().starts_with("startupProbe:")).expect("a startupProbe");
    let field = |name: &str| -> f64 {
        let at = probe.find(&format!("{name}: ")).unwrap_or_else(|| panic!("{name} in {probe}")) + name.len() + 2;
        probe[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
    };
    let allowed = field("periodSeconds") * field("failureThreshold");
    assert!(allowed >= wait + 60.0, "{allowed} s of startup for a lock wait of {wait} s and a start: {probe}");
}

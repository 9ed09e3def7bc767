//! README's "Train a drafter for your model" as written: both `run.toml` files load (`dflash config show`), and
//! every `dflash` command of the recipe parses, flags and values (run with `--help` appended: clap refuses an unknown
//! flag or a bad value before it reaches the help). The commands themselves need an 8B model and a GPU.
mod support;

use std::process::Command;

use support::readme_block;

#[test]
fn both_run_tomls_load_as_written() {
    for (marker, expect) in [("# run.toml, one GPU", "devices = [\"cuda:0\"]"), ("# run.toml, eight GPUs", "\"nccl\"")]
    {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("models/Qwen3-8B")).unwrap();
        std::fs::write(dir.path().join("run.toml"), readme_block("toml", marker)).unwrap();
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

#[test]
fn every_dflash_command_of_the_recipe_parses() {
    let block = readme_block("bash", "# 1. The target");
    let joined = block.replace("\\\n", " ");
    let commands: Vec<&str> = joined.lines().map(str::trim).filter(|l| l.starts_with("dflash ")).collect();
    assert!(commands.len() >= 7, "{commands:#?}");
    let dir = tempfile::tempdir().unwrap();
    for command in commands {
        // `dflash` as a shell function that asks for the help after the recipe's arguments.
        let script = format!("dflash() {{ \"$BIN\" \"$@\" --help > /dev/null; }}\n{command}");
        let o = Command::new("bash")
            .args(["-c", &script])
            .env("BIN", env!("CARGO_BIN_EXE_dflash"))
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(o.status.success(), "{command}: {}", String::from_utf8_lossy(&o.stderr));
    }
}

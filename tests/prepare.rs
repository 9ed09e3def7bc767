//! `prepare` and `inspect` through their public interfaces: output format and contents, idempotence, every kind of
//! bad input, strict mode, and interrupted runs.
mod service_process;

use std::path::{Path, PathBuf};
use std::process::Command;

use dflash::data::SampleId;
use dflash::data::builtin::{sample_conversations, write_tiny_tokenizer};
use dflash::data::chat::Conversation;
use dflash::data::prepare::{LongConversations, ModelAssets, PrepareOptions, PrepareOutcome, prepare};
use dflash::data::sample::build_sample;
use dflash::data::shards::{Manifest, PreparedSplit};
use dflash::data::token_rows::read_token_rows;
use serde_json::{Map, json};

fn options(inputs: Vec<PathBuf>, out: &Path) -> PrepareOptions {
    PrepareOptions {
        long: Default::default(),
        inputs,
        out: out.to_path_buf(),
        max_len: 256,
        block_size: 4,
        holdout: 0.0,
        seed: 0,
        template_kwargs: Map::new(),
        strict: false,
        progress: false,
        force: false,
    }
}

fn write_lines(path: &Path, lines: &[String]) {
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

fn sample_lines(n: usize) -> Vec<String> {
    sample_conversations(n, 5).iter().map(|c| c.to_string()).collect()
}

#[test]
fn prepared_samples_are_the_conversations_tokenized_and_masked() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("chats.jsonl");
    let lines = sample_lines(60);
    write_lines(&input, &lines);
    let assets = ModelAssets::tiny(&Map::new());
    let out = dir.path().join("prepared");
    let mut opts = options(vec![input.clone()], &out);
    opts.holdout = 0.25;
    let PrepareOutcome::Written(m) = prepare(&assets, &opts).unwrap() else { panic!("expected a fresh output") };
    assert_eq!(m.report.lines, 60);
    assert_eq!(m.report.kept_train + m.report.kept_holdout + m.report.dropped.values().sum::<u64>(), 60);
    assert!(m.report.kept_holdout > 5 && m.report.kept_train > 30, "{:?}", m.report);
    let train = PreparedSplit::open(&out, "train", true).unwrap();
    let holdout = PreparedSplit::open(&out, "holdout", true).unwrap();
    assert_eq!(train.len() as u64, m.report.kept_train);
    assert_eq!(holdout.len() as u64, m.report.kept_holdout);
    // Every kept sample equals the conversation rendered, tokenized and masked directly.
    for split in [&train, &holdout] {
        for i in 0..split.len() {
            let s = split.get(i);
            let line = s.id.key();
            let conv = Conversation::from_json_line(&lines[line as usize], line).unwrap();
            let direct = build_sample(&assets.template, &assets.tokenizer, &conv).unwrap();
            let n = direct.input_ids.len().min(opts.max_len);
            let ids: Vec<i64> = direct.input_ids[..n].iter().map(|&t| t as i64).collect();
            assert_eq!(s.input_ids(), ids, "sample {}", s.id);
            assert_eq!(s.loss_mask, &direct.loss_mask[..n]);
        }
    }
    // The same inputs and settings: nothing to do. Other settings: refused (a run may be training on the folder),
    // and with --force a new output.
    assert!(matches!(prepare(&assets, &opts).unwrap(), PrepareOutcome::UpToDate(_)));
    opts.holdout = 0.0;
    let e = prepare(&assets, &opts).err().unwrap().to_string();
    assert!(e.contains("holdout 0.25 there, 0.0 now") && e.contains("--force"), "{e}");
    opts.force = true;
    let PrepareOutcome::Written(m2) = prepare(&assets, &opts).unwrap() else { panic!("changed settings must rewrite") };
    assert_eq!(m2.report.kept_holdout, 0);
    assert_ne!(m2.fingerprint, m.fingerprint);
}

#[test]
fn short_samples_are_dropped_and_long_ones_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("chats.jsonl");
    let long = "word ".repeat(100);
    write_lines(
        &input,
        &[
            json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]})
                .to_string(),
            json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": long}]})
                .to_string(),
        ],
    );
    let out = dir.path().join("p");
    let PrepareOutcome::Written(m) = prepare(&ModelAssets::tiny(&Map::new()), &options(vec![input], &out)).unwrap()
    else {
        panic!()
    };
    assert_eq!(m.report.dropped.values().sum::<u64>(), 1, "\"ok<|im_end|>\" has 3 supervised tokens < 2 x 4");
    assert_eq!(m.report.truncated, 1);
    let train = PreparedSplit::open(&out, "train", false).unwrap();
    assert_eq!(train.get(0).len(), 256);
    assert_eq!(train.get(0).id, &SampleId::Number(1), "no id: the line number");
}

/// `--long split`: a long conversation becomes pieces of `max_len` tokens that put it back together, ids `1`, `1#1`,
/// ..., all in the split its id draws; a short piece at the end that teaches too little is dropped and counted; and
/// the choice is part of the fingerprint.
#[test]
fn long_conversations_split_into_pieces_of_one_split() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("chats.jsonl");
    let assets = ModelAssets::tiny(&Map::new());
    // 29 tokens of template around the answer; the second conversation ends 4 tokens into its third piece.
    let conversations: Vec<String> = [500, 485, 700, 1000, 1300, 1500]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let answer = format!("{i} {}", "w".repeat(n));
            json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}]})
                .to_string()
        })
        .collect();
    write_lines(&input, &conversations);
    let out = dir.path().join("p");
    let opts = PrepareOptions { long: LongConversations::Split, holdout: 0.5, ..options(vec![input.clone()], &out) };
    let PrepareOutcome::Written(m) = prepare(&assets, &opts).unwrap() else { panic!() };
    assert_eq!((m.report.split, m.report.truncated), (6, 0));
    let splits = ["train", "holdout"].map(|name| PreparedSplit::open(&out, name, false).unwrap());
    assert!(splits.iter().all(|s| !s.is_empty()), "both splits hold pieces");
    let (mut pieces, mut dropped) = (0, 0);
    for (i, line) in conversations.iter().enumerate() {
        let whole =
            build_sample(&assets.template, &assets.tokenizer, &Conversation::from_json_line(line, i as u64).unwrap())
                .unwrap();
        // Every piece of conversation i: (piece number, split, tokens, mask), in order.
        let mut found: Vec<(usize, usize, Vec<u32>, Vec<u8>)> = Vec::new();
        for (k, split) in splits.iter().enumerate() {
            for j in 0..split.len() {
                let s = split.get(j);
                let n = match s.id {
                    SampleId::Number(n) if *n == i as u64 => Some(0),
                    SampleId::Text(t) => t.strip_prefix(&format!("{i}#")).and_then(|n| n.parse().ok()),
                    _ => None,
                };
                if let Some(n) = n {
                    found.push((n, k, s.input_ids().iter().map(|&t| t as u32).collect(), s.loss_mask.to_vec()));
                }
            }
        }
        found.sort_by_key(|(n, ..)| *n);
        assert!(found.iter().all(|(_, k, ..)| *k == found[0].1), "conversation {i}: its pieces are in one split");
        let expected: Vec<&[u32]> = whole.input_ids.chunks(256).collect();
        // The last piece is dropped when it has fewer than 2 x 4 supervised tokens.
        let kept = expected.len()
            - usize::from(whole.loss_mask.chunks(256).last().unwrap().iter().filter(|&&m| m != 0).count() < 8);
        assert_eq!(found.len(), kept, "conversation {i}");
        for (j, (n, _, ids, mask)) in found.iter().enumerate() {
            assert_eq!(*n, j);
            assert_eq!(ids.as_slice(), expected[j], "conversation {i}, piece {j}");
            assert_eq!(mask.as_slice(), whole.loss_mask.chunks(256).nth(j).unwrap());
        }
        pieces += kept;
        dropped += expected.len() - kept;
    }
    assert_eq!(m.report.kept_train + m.report.kept_holdout, pieces as u64);
    assert!(dropped > 0, "some conversation ends in a piece too short to teach");
    assert_eq!(m.report.dropped.values().sum::<u64>(), dropped as u64);
    // Truncating instead is another preparation.
    let truncating = PrepareOptions { holdout: 0.5, force: true, ..options(vec![input], &out) };
    let PrepareOutcome::Written(t) = prepare(&assets, &truncating).unwrap() else { panic!("not up to date") };
    assert_eq!((t.report.split, t.report.truncated, t.report.kept_train + t.report.kept_holdout), (0, 6, 6));
}

#[test]
fn bad_lines_are_skipped_counted_and_quoted_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("mixed.jsonl");
    let mut lines = sample_lines(3);
    lines.push("{not json".into());
    lines.push(json!({"messages": [{"role": "robot", "content": "x"}]}).to_string());
    lines.push(json!({"messages": []}).to_string());
    lines.push(json!({"id": 0, "messages": [{"role": "user", "content": "dup"}, {"role": "assistant", "content": "a long enough answer"}]}).to_string());
    write_lines(&input, &lines);
    let out = dir.path().join("p");
    let PrepareOutcome::Written(m) =
        prepare(&ModelAssets::tiny(&Map::new()), &options(vec![input.clone()], &out)).unwrap()
    else {
        panic!()
    };
    let bad = &m.report.bad_lines;
    assert_eq!(bad.get("malformed JSON"), Some(&1));
    assert_eq!(bad.get("unknown role"), Some(&1));
    assert_eq!(bad.get("empty conversation"), Some(&1));
    assert_eq!(bad.get("duplicate id"), Some(&1));
    let quoted = m.report.examples.join("\n");
    assert!(quoted.contains(&format!("{}:4:", input.display())) && quoted.contains("robot"), "{quoted}");
    assert_eq!(m.report.kept_train, 3);

    // --strict: the first bad line is fatal, named by file and line, and no output appears.
    let strict_out = dir.path().join("strict");
    let mut opts = options(vec![input.clone()], &strict_out);
    opts.strict = true;
    let err = prepare(&ModelAssets::tiny(&Map::new()), &opts).err().unwrap().to_string();
    assert!(err.contains(&format!("{}:4", input.display())), "{err}");
    assert!(!strict_out.exists(), "a failed run leaves no output");
    assert!(!dir.path().join(".strict.partial").exists(), "and no temporary folder");
}

#[test]
fn templates_that_fail_and_missing_tokenizers_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    write_tiny_tokenizer(&model).unwrap();
    // A template that refuses some conversations.
    let strict_template = "{% for m in messages %}{% if m.content == 'forbidden' %}{{ raise_exception('no forbidden words') }}\
        {% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
    let config = json!({"chat_template": strict_template, "eos_token": "<|im_end|>"});
    std::fs::write(model.join("tokenizer_config.json"), config.to_string()).unwrap();
    let input = dir.path().join("c.jsonl");
    write_lines(
        &input,
        &[
            json!({"messages": [{"role": "user", "content": "forbidden"}, {"role": "assistant", "content": "x"}]}).to_string(),
            json!({"messages": [{"role": "user", "content": "fine"}, {"role": "assistant", "content": "a fine answer here"}]}).to_string(),
        ],
    );
    let assets = ModelAssets::from_dir(&model, &Map::new()).unwrap();
    let PrepareOutcome::Written(m) = prepare(&assets, &options(vec![input], &dir.path().join("p"))).unwrap() else {
        panic!()
    };
    assert_eq!(m.report.bad_lines.get("template or tokenizer failed"), Some(&1));
    assert!(m.report.examples[0].contains("no forbidden words"), "{:?}", m.report.examples);
    assert_eq!(m.report.kept_train, 1);

    std::fs::remove_file(model.join("tokenizer.json")).unwrap();
    let err = ModelAssets::from_dir(&model, &Map::new()).err().unwrap().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
}

#[test]
fn an_interrupted_run_leaves_nothing_that_passes_for_output() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("c.jsonl");
    write_lines(&input, &sample_lines(20));
    let out = dir.path().join("p");
    // What a killed run leaves: a half-written staging folder (of a process that no longer runs, or of an earlier
    // build's single name).
    let stale = [dir.path().join(format!(".p.partial-{}-3", u32::MAX - 1)), dir.path().join(".p.partial")];
    for stale in &stale {
        std::fs::create_dir_all(stale).unwrap();
        std::fs::write(stale.join("train-00000.tokens"), b"junk").unwrap();
        assert!(Manifest::read(stale).is_err(), "no manifest: not an output");
    }
    let assets = ModelAssets::tiny(&Map::new());
    assert!(matches!(prepare(&assets, &options(vec![input.clone()], &out)).unwrap(), PrepareOutcome::Written(_)));
    assert!(stale.iter().all(|s| !s.exists()));
    PreparedSplit::open(&out, "train", true).unwrap();
    // A damaged output is detected, and a rerun repairs it.
    let tokens = out.join("train-00000.tokens");
    let len = std::fs::metadata(&tokens).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&tokens).unwrap().set_len(len - 4).unwrap();
    assert!(PreparedSplit::open(&out, "train", false).err().unwrap().to_string().contains("damaged"));
    assert!(matches!(prepare(&assets, &options(vec![input], &out)).unwrap(), PrepareOutcome::Written(_)));
    PreparedSplit::open(&out, "train", true).unwrap();
    // A folder that is not ours is never replaced.
    let foreign = dir.path().join("mine");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), "keep me").unwrap();
    let err = prepare(&assets, &options(vec![dir.path().join("c.jsonl")], &foreign)).err().unwrap().to_string();
    assert!(err.contains("not a prepared folder"), "{err}");
    assert!(foreign.join("notes.txt").exists());
}

#[test]
fn the_cli_prepares_inspects_and_feeds_eval() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("c.jsonl");
    write_lines(&input, &sample_lines(12));
    let out = dir.path().join("p");
    let dflash = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_dflash")).args(args).env("DFLASH__LOG__LEVEL", "warn").output().unwrap()
    };
    let o = dflash(&[
        "prepare",
        "--model",
        "tiny",
        "--input",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--max-len",
        "512",
        "--block-size",
        "4",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["written"], true);
    let o = dflash(&["inspect", out.to_str().unwrap(), "--limit", "2"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("── id") && text.contains("⟦") && text.contains("<|im_end|>⟧"), "{text}");
    // As JSON, the whole split unless --limit says otherwise (the README's held-out set is not cut short).
    let o = dflash(&["inspect", out.to_str().unwrap(), "--json"]);
    let rows_path = dir.path().join("rows.jsonl");
    std::fs::write(&rows_path, &o.stdout).unwrap();
    let rows = read_token_rows(&rows_path, 320).unwrap();
    assert!(rows.len() > 3);
    assert_eq!(rows.len() as u64, report["report"]["kept_train"].as_u64().unwrap());
    let o = dflash(&["inspect", out.to_str().unwrap(), "--json", "--limit", "2"]);
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 2);
    // Prompts only: each row cut before its first reply (as the in-training evaluation cuts), for eval --decode.
    let o = dflash(&["inspect", out.to_str().unwrap(), "--json", "--prompts"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let prompts: Vec<serde_json::Value> =
        String::from_utf8_lossy(&o.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(prompts.len(), rows.len());
    for (prompt, row) in prompts.iter().zip(&rows) {
        let ids: Vec<i64> = serde_json::from_value(prompt["input_ids"].clone()).unwrap();
        assert!(ids.len() < row.input_ids.len() && row.input_ids.starts_with(&ids), "a prefix of the row");
        assert_eq!(row.loss_mask[ids.len()], 1, "the cut is where the first reply begins");
        assert!(row.loss_mask[..ids.len()].iter().all(|&m| m == 0), "no supervised token before it");
        assert!(prompt.get("loss_mask").is_none());
    }
    let o = dflash(&["inspect", out.to_str().unwrap(), "--prompts"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--json"));
    let o = dflash(&["inspect", out.to_str().unwrap(), "--id", "999"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("no sample with id 999"));
}

/// A prepared split is checked against the target that will read it: a sample longer than its positions, or a
/// token id outside its vocabulary, is an error naming the shard file and the sample.
#[test]
fn a_split_that_does_not_fit_the_target_names_the_file_and_sample() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("chats.jsonl");
    write_lines(&input, &sample_lines(20));
    let out = dir.path().join("prepared");
    prepare(&ModelAssets::tiny(&Map::new()), &options(vec![input], &out)).unwrap();
    let train = PreparedSplit::open(&out, "train", false).unwrap();
    let longest = train.lengths().into_iter().max().unwrap();
    let max_id = (0..train.len()).flat_map(|i| train.get(i).input_ids()).max().unwrap() as usize;
    train.check_fits(&out, max_id + 1, longest).unwrap();
    let short = train.check_fits(&out, max_id + 1, longest - 1).unwrap_err().to_string();
    assert!(short.contains("train-00000.tokens") && short.contains("sample id"), "{short}");
    assert!(short.contains(&format!("{longest} tokens, more than the target's {} positions", longest - 1)), "{short}");
    let small = train.check_fits(&out, max_id, longest).unwrap_err().to_string();
    assert!(small.contains(&format!("token id {max_id} is outside the target's vocabulary (0..{max_id})")), "{small}");
}

/// `n` conversations in ShareGPT form (`{"id", "conversations": [{"from", "value"}]}`) with string ids, as public
/// chat sets give them.
fn sharegpt_lines(n: usize) -> Vec<String> {
    sample_conversations(n, 5)
        .iter()
        .enumerate()
        .map(|(i, c)| service_process::sharegpt(c, json!(format!("QWJhYvA_{i}"))).to_string())
        .collect()
}

fn ids_of(split: &PreparedSplit) -> Vec<SampleId> {
    (0..split.len()).map(|i| split.get(i).id.clone()).collect()
}

/// String ids (ShareGPT's) prepare, are kept as given in the splits, `inspect` and its JSON, and decide the holdout
/// split by themselves (not by line order); a repeated id is named with the file and line that used it first.
#[test]
fn string_ids_are_kept_as_given_and_split_by_id() {
    let dir = tempfile::tempdir().unwrap();
    let mut lines = sharegpt_lines(40);
    lines.push(json!({"id": 5, "messages": [{"role": "user", "content": "five"}, {"role": "assistant", "content": "an integer id, kept as one"}]}).to_string());
    lines.push(json!({"id": "5", "messages": [{"role": "user", "content": "five again"}, {"role": "assistant", "content": "the same id as a string"}]}).to_string());
    let input = dir.path().join("sharegpt.jsonl");
    write_lines(&input, &lines);
    let assets = ModelAssets::tiny(&Map::new());
    let out = dir.path().join("p");
    let mut opts = options(vec![input.clone()], &out);
    opts.holdout = 0.3;
    let PrepareOutcome::Written(m) = prepare(&assets, &opts).unwrap() else { panic!() };
    assert_eq!(m.report.bad_lines.get("duplicate id"), Some(&1), "{:?}", m.report);
    let quoted = m.report.examples.join("\n");
    assert!(
        quoted.contains(&format!("{}:42: id \"5\" was already used at {}:41", input.display(), input.display())),
        "{quoted}"
    );
    let train = PreparedSplit::open(&out, "train", true).unwrap();
    let holdout = PreparedSplit::open(&out, "holdout", true).unwrap();
    assert_eq!(train.len() + holdout.len(), 41);
    assert!(holdout.len() >= 5 && train.len() >= 20, "{} / {}", train.len(), holdout.len());
    let mut all: Vec<SampleId> = ids_of(&train).into_iter().chain(ids_of(&holdout)).collect();
    assert!(all.contains(&SampleId::Text("QWJhYvA_0".into())));
    let five = all.iter().find(|id| id.key() == 5).unwrap();
    assert!(matches!(five, SampleId::Number(5)), "an integer stays an integer: {five:?}");

    // The same conversations in reverse order: the same ids in each split.
    let reversed = dir.path().join("reversed.jsonl");
    write_lines(&reversed, &lines.iter().rev().cloned().collect::<Vec<_>>());
    let out2 = dir.path().join("p2");
    let mut opts2 = options(vec![reversed], &out2);
    opts2.holdout = 0.3;
    prepare(&assets, &opts2).unwrap();
    let mut holdout2 = ids_of(&PreparedSplit::open(&out2, "holdout", false).unwrap());
    let mut holdout1 = ids_of(&holdout);
    holdout1.retain(|id| id.key() != 5);
    holdout2.retain(|id| id.key() != 5);
    let sort = |v: &mut Vec<SampleId>| v.sort_by_key(|id| id.to_json().to_string());
    sort(&mut holdout1);
    sort(&mut holdout2);
    assert_eq!(holdout1, holdout2, "the holdout split is a function of the id");
    all.retain(|id| id.key() != 5);
    assert_eq!(all.len(), 40);

    // inspect: by a string id, and as JSON with the ids as given.
    let dflash = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_dflash")).args(args).output().unwrap();
    let first = train.get(0).id.to_json();
    let first = first.as_str().unwrap();
    let o = dflash(&["inspect", out.to_str().unwrap(), "--id", first]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && text.contains(&format!("── id \"{first}\"")), "{text}");
    let o = dflash(&["inspect", out.to_str().unwrap(), "--json", "--limit", "1"]);
    let row: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(row["id"], json!(first));
}

/// Folders prepared before string ids (format 1: no `.ids` files) still open, their ids the integers they were.
#[test]
fn format_1_folders_are_still_read() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("c.jsonl");
    write_lines(&input, &sample_lines(12));
    let out = dir.path().join("p");
    prepare(&ModelAssets::tiny(&Map::new()), &options(vec![input], &out)).unwrap();
    let now = ids_of(&PreparedSplit::open(&out, "train", true).unwrap());
    // Make it what format 1 wrote: the same shards without `.ids` files.
    let manifest_path = out.join("manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest_path).unwrap()).unwrap();
    assert_eq!(manifest["format"], "dflash-prepared/2");
    manifest["format"] = json!("dflash-prepared/1");
    for split in manifest["splits"].as_object_mut().unwrap().values_mut() {
        for shard in split["shards"].as_array_mut().unwrap() {
            let files = shard["files"].as_array_mut().unwrap();
            let ids = files.pop().unwrap();
            std::fs::remove_file(out.join(ids["file"].as_str().unwrap())).unwrap();
        }
    }
    std::fs::write(&manifest_path, manifest.to_string()).unwrap();
    let old = PreparedSplit::open(&out, "train", true).unwrap();
    assert_eq!(ids_of(&old), now);
    assert!(now.iter().all(|id| matches!(id, SampleId::Number(_))));
}

/// Token rows prepare without a tokenizer: checked against the target (vocabulary, positions) with the bad line
/// named, rows with too few supervised tokens dropped and counted, ids kept as given.
#[test]
fn token_rows_are_checked_against_the_target_and_prepared() {
    use dflash::data::prepare::{Lines, prepare_lines};
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("rows.jsonl");
    let row = |id: serde_json::Value, n: usize, supervised: usize| {
        let mask: Vec<u8> = (0..n).map(|i| u8::from(i >= n - supervised)).collect();
        json!({"id": id, "input_ids": (0..n as u32).collect::<Vec<_>>(), "loss_mask": mask}).to_string()
    };
    write_lines(&input, &[row(json!("a"), 20, 10), row(json!(3), 20, 7), row(json!("c"), 30, 30)]);
    let lines = Lines::TokenRows { vocab_size: 100 };
    let mut opts = options(vec![input.clone()], &dir.path().join("p"));
    opts.max_len = 30;
    opts.strict = true;
    let PrepareOutcome::Written(m) = prepare_lines(lines, &opts).unwrap() else { panic!() };
    assert_eq!((m.report.kept_train, m.report.dropped.values().sum::<u64>()), (2, 1), "{:?}", m.report);
    let train = PreparedSplit::open(&opts.out, "train", true).unwrap();
    assert_eq!(ids_of(&train), vec![SampleId::Text("a".into()), SampleId::Text("c".into())]);
    assert_eq!(train.get(1).input_ids(), (0..30).collect::<Vec<i64>>());

    (opts.max_len, opts.force) = (29, true);
    let e = prepare_lines(lines, &opts).err().unwrap().to_string();
    assert!(e.contains("rows.jsonl:3") && e.contains("30 tokens, more than the target's 29 positions"), "{e}");
    let e = prepare_lines(Lines::TokenRows { vocab_size: 15 }, &opts).err().unwrap().to_string();
    assert!(e.contains("rows.jsonl:1") && e.contains("outside the target's vocabulary (0..15)"), "{e}");
}

/// Preparations of the same data into the same folder at once (runs starting together on the built-in data) each
/// write their own staging folder: all succeed, each writes the folder or finds it up to date (also when another moved
/// its folder in between its check and its move), and no staging or moved-aside folder is left. A shared staging
/// folder made one delete the other's files mid-write.
#[test]
fn preparations_of_one_folder_at_once_all_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("chats.jsonl");
    write_lines(&input, &sample_lines(400));
    let out = dir.path().join("prepared");
    // A staging folder a killed process left (no process has this pid).
    let abandoned = dir.path().join(format!(".prepared.partial-{}-0", u32::MAX - 1));
    std::fs::create_dir_all(&abandoned).unwrap();
    let opts = options(vec![input], &out);
    std::thread::scope(|s| {
        let runs: Vec<_> = (0..4).map(|_| s.spawn(|| prepare(&ModelAssets::tiny(&Map::new()), &opts))).collect();
        for run in runs {
            run.join().unwrap().unwrap();
        }
    });
    let manifest = Manifest::read(&out).unwrap();
    let train = PreparedSplit::open(&out, "train", true).unwrap();
    assert_eq!(train.len() as u64, manifest.report.kept_train);
    let names: Vec<String> =
        dir.path().read_dir().unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert!(names.iter().all(|n| !n.contains(".partial")), "{names:?}");
}

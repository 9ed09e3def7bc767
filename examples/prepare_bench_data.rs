//! Makes the input of the `prepare` benchmark in BENCHMARKS.md: a 32k-token byte-level BPE tokenizer trained on real
//! text (Rust sources and docs found under a folder), written as a model folder with the Qwen3 chat template and
//! Qwen's special tokens, and N conversations whose turns are chunks of that text (about 300 and 2,000 characters).
//!
//!   cargo run --release --example prepare_bench_data -- ~/.cargo/registry/src OUT_DIR 100000
use std::io::Write;
use std::path::{Path, PathBuf};

use dflash::data::builtin::QWEN3_CHAT_TEMPLATE;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, TokenizerBuilder, TokenizerImpl};

fn collect(dir: &Path, out: &mut Vec<PathBuf>, limit: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if out.len() >= limit {
            return;
        }
        let p = e.path();
        if p.is_dir() {
            collect(&p, out, limit);
        } else if p.extension().is_some_and(|x| x == "rs" || x == "md") {
            out.push(p);
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    anyhow::ensure!(args.len() == 4, "usage: prepare_bench_data SOURCE_DIR OUT_DIR COUNT");
    let (src, out, n): (PathBuf, PathBuf, usize) = (args[1].clone().into(), args[2].clone().into(), args[3].parse()?);
    let mut files = Vec::new();
    collect(&src, &mut files, 20_000);
    let text: Vec<String> = files.iter().filter_map(|f| std::fs::read_to_string(f).ok()).collect();
    let corpus: String = text.concat();
    let chars: Vec<char> = corpus.chars().collect();
    eprintln!("{} files, {} MB of text", files.len(), corpus.len() >> 20);
    std::fs::create_dir_all(&out)?;
    let train_file = out.join("train.txt");
    std::fs::write(&train_file, &corpus[..corpus.len().min(64 << 20)])?;
    let specials: Vec<AddedToken> =
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
            .iter()
            .map(|t| AddedToken::from(t.to_string(), true))
            .collect();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(32_000)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(specials)
        .build();
    let mut tokenizer: TokenizerImpl<BPE, NormalizerWrapper, ByteLevel, PostProcessorWrapper, ByteLevel> =
        TokenizerBuilder::new()
            .with_model(BPE::default())
            .with_pre_tokenizer(Some(ByteLevel::default()))
            .with_decoder(Some(ByteLevel::default()))
            .build()
            .map_err(anyhow::Error::msg)?;
    tokenizer
        .train_from_files(&mut trainer, vec![train_file.to_string_lossy().into_owned()])
        .map_err(anyhow::Error::msg)?;
    std::fs::create_dir_all(out.join("model"))?;
    tokenizer.save(out.join("model/tokenizer.json"), false).map_err(anyhow::Error::msg)?;
    std::fs::remove_file(&train_file)?;
    let config = json!({"chat_template": QWEN3_CHAT_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"});
    std::fs::write(out.join("model/tokenizer_config.json"), config.to_string())?;
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let mut chunk = |len: usize| -> String {
        let start = rng.random_range(0..chars.len() - len);
        chars[start..start + len].iter().collect()
    };
    let mut w = std::io::BufWriter::new(std::fs::File::create(out.join("conversations.jsonl"))?);
    for id in 0..n {
        let (q, a) = (chunk(300), chunk(2000));
        writeln!(
            w,
            "{}",
            json!({"id": id, "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
        )?;
    }
    eprintln!("wrote {n} conversations");
    Ok(())
}

//! Built-in data so the default run and the tests need nothing from outside: the `tiny` preset's tokenizer (byte
//! tokens 0-255, then `<|endoftext|>` `<|im_start|>` `<|im_end|>` `<think>` `</think>` at the preset's ids) with the
//! Qwen3 chat template, and a generated set of small conversations (counting, arithmetic, repeating, reversing,
//! spelling) whose answers follow from the question.
use std::path::Path;

use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Map, Value, json};

use super::DataError;
use super::chat::ChatTemplate;
use super::prepare::ModelAssets;
use super::tokenize::{TextTokenizer, byte_level_tokenizer};

/// The Qwen3 chat template (as published in Qwen3's `tokenizer_config.json`), used by the `tiny` preset.
pub const QWEN3_CHAT_TEMPLATE: &str = include_str!("qwen3_chat_template.jinja");

/// The special tokens of the tiny tokenizer, in id order from 256.
pub const TINY_SPECIALS: [&str; 5] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"];

/// The tiny tokenizer.
pub fn tiny_tokenizer() -> tokenizers::Tokenizer {
    byte_level_tokenizer(&[], &TINY_SPECIALS).expect("the tiny tokenizer builds")
}

fn tiny_tokenizer_config() -> Value {
    json!({
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
    })
}

impl ModelAssets {
    /// The `tiny` preset's tokenizer and template.
    pub fn tiny(template_kwargs: &Map<String, Value>) -> Self {
        let config = tiny_tokenizer_config();
        let mut specials = Map::new();
        for key in ["bos_token", "eos_token", "pad_token"] {
            specials.insert(key.into(), config[key].clone());
        }
        let template = ChatTemplate::new(QWEN3_CHAT_TEMPLATE, specials, template_kwargs).expect("the template parses");
        let tokenizer = TextTokenizer::from_tokenizer(tiny_tokenizer());
        let identity = ModelAssets::identity_of(&tokenizer, &template).expect("the tiny tokenizer serializes");
        ModelAssets { template, tokenizer, identity, name: "tiny".into() }
    }

    /// A model folder's assets, or the built-in ones for `tiny` and `tiny-tasks`.
    pub fn resolve(model: &str, template_kwargs: &Map<String, Value>) -> Result<Self, DataError> {
        if model.parse::<crate::model::Preset>().is_ok_and(|p| p.is_tiny()) {
            return Ok(Self::tiny(template_kwargs));
        }
        if let Some(reason) = crate::model::presets::no_such_model(model) {
            return Err(DataError::File { path: model.into(), reason });
        }
        Self::from_dir(Path::new(model), template_kwargs)
    }
}

/// Writes the tiny tokenizer files (`tokenizer.json`, `tokenizer_config.json`) into `dir`; with the tiny preset's
/// weights saved beside them (`Target::save_hf`) the folder is a complete HuggingFace model folder.
pub fn write_tiny_tokenizer(dir: &Path) -> Result<(), DataError> {
    let io = |path: std::path::PathBuf| move |err| DataError::Io { path, err };
    std::fs::create_dir_all(dir).map_err(io(dir.to_path_buf()))?;
    let path = dir.join("tokenizer.json");
    tiny_tokenizer().save(&path, false).map_err(|e| DataError::File { path: path.clone(), reason: e.to_string() })?;
    let path = dir.join("tokenizer_config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&tiny_tokenizer_config()).expect("json")).map_err(io(path))
}

const WORDS: [&str; 24] = [
    "apple", "river", "stone", "cloud", "green", "light", "music", "paper", "quiet", "sugar", "table", "water",
    "bread", "chair", "dream", "earth", "flame", "glass", "honey", "ivory", "jelly", "lemon", "maple", "north",
];

/// One question and the answer that follows from it.
fn exchange(rng: &mut ChaCha8Rng) -> (String, String) {
    match rng.random_range(0..5) {
        0 => {
            let a = rng.random_range(0..60);
            let b = a + rng.random_range(10..25);
            let nums: Vec<String> = (a..=b).map(|n| n.to_string()).collect();
            (format!("Count from {a} to {b}."), nums.join(" "))
        }
        1 => {
            let (a, b) = (rng.random_range(10..500), rng.random_range(10..500));
            (format!("What is {a} + {b}?"), format!("{a} + {b} = {}. The sum of {a} and {b} is {}.", a + b, a + b))
        }
        2 => {
            let words: Vec<&str> = (0..rng.random_range(5..9)).map(|_| *WORDS.choose(rng).expect("words")).collect();
            (format!("Repeat after me: {}", words.join(" ")), words.join(" "))
        }
        3 => {
            let words: Vec<&str> = (0..rng.random_range(5..9)).map(|_| *WORDS.choose(rng).expect("words")).collect();
            let reversed: Vec<&str> = words.iter().rev().copied().collect();
            (format!("Reverse the words: {}", words.join(" ")), reversed.join(" "))
        }
        _ => {
            let words: Vec<&str> = (0..3).map(|_| *WORDS.choose(rng).expect("words")).collect();
            let spelled: Vec<String> =
                words.iter().map(|w| w.chars().map(String::from).collect::<Vec<_>>().join("-")).collect();
            (format!("Spell these words: {}", words.join(", ")), spelled.join(", "))
        }
    }
}

/// `count` conversations in OpenAI form (`{"id", "messages"}`), one or two exchanges each, some with a system
/// prompt; the same for the same seed.
pub fn sample_conversations(count: usize, seed: u64) -> Vec<Value> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..count)
        .map(|id| {
            let mut messages = Vec::new();
            if rng.random_bool(0.3) {
                messages.push(json!({"role": "system", "content": "You are a careful assistant."}));
            }
            for _ in 0..rng.random_range(1..=2) {
                let (q, a) = exchange(&mut rng);
                messages.push(json!({"role": "user", "content": q}));
                messages.push(json!({"role": "assistant", "content": a}));
            }
            json!({"id": id, "messages": messages})
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::chat::Conversation;
    use crate::data::sample::build_sample;
    use crate::model::presets::tiny;

    #[test]
    fn the_tiny_tokenizer_fits_the_tiny_preset() {
        let t = TextTokenizer::from_tokenizer(tiny_tokenizer());
        assert_eq!(t.token_id("<|endoftext|>"), Some(tiny::ENDOFTEXT as u32));
        assert_eq!(t.token_id("<|im_start|>"), Some(tiny::IM_START as u32));
        assert_eq!(t.token_id("<|im_end|>"), Some(tiny::IM_END as u32));
        assert_eq!(t.token_id("<think>"), Some(tiny::THINK as u32));
        assert_eq!(t.token_id("</think>"), Some(tiny::END_THINK as u32));
        assert!(t.vocab_size() <= tiny::VOCAB_SIZE && (t.vocab_size() as i64) <= tiny::MASK);
    }

    #[test]
    fn sample_conversations_are_stable_and_prepare_cleanly() {
        let a = sample_conversations(50, 3);
        assert_eq!(a, sample_conversations(50, 3));
        assert_ne!(a, sample_conversations(50, 4));
        let assets = ModelAssets::tiny(&Map::new());
        for line in &a {
            let conv = Conversation::from_json_line(&line.to_string(), 0).unwrap();
            let s = build_sample(&assets.template, &assets.tokenizer, &conv).unwrap();
            assert!(s.supervised() > 8, "{line}");
            assert!(s.input_ids.iter().all(|&t| (t as i64) < tiny::MASK));
        }
    }
}

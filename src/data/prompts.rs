//! Prompts for decoding evaluations, from JSONL: token ids as they are (`{"id"?, "input_ids": [...]}`), or a
//! conversation (`{"id"?, "messages": [...]}` or ShareGPT `conversations`) rendered with the target's chat template
//! and a generation prompt, so the target answers its last user turn. Trailing assistant messages are dropped
//! (they are the answers being regenerated). Any bad line is an error naming the file and line.
use std::cell::OnceCell;
use std::io::BufRead;
use std::path::Path;

use serde_json::Value;

use super::chat::Conversation;
use super::prepare::ModelAssets;
use super::sample_id::FirstUse;
use super::{DataError, SampleId};

/// One prompt's token ids and its id (the line's `id`, else its 0-based line number).
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub id: SampleId,
    pub input_ids: Vec<i64>,
}

/// Reads every prompt of `path`. `chat_assets` loads the tokenizer and chat template, called only at the first
/// conversation line: token-id prompts never need a tokenizer.
pub fn read_prompts(
    path: &Path,
    vocab_size: usize,
    chat_assets: &dyn Fn() -> Result<ModelAssets, String>,
) -> Result<Vec<Prompt>, DataError> {
    let file = std::fs::File::open(path).map_err(|err| DataError::Io { path: path.to_path_buf(), err })?;
    let loaded = OnceCell::new();
    let assets = || -> Result<&ModelAssets, String> {
        if let Some(a) = loaded.get() {
            return Ok(a);
        }
        let a = chat_assets().map_err(|e| format!("conversation prompts need the target's tokenizer: {e}"))?;
        Ok(loaded.get_or_init(|| a))
    };
    let mut prompts: Vec<Prompt> = Vec::new();
    let mut seen = FirstUse::default();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|err| DataError::Io { path: path.to_path_buf(), err })?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| DataError::Line { path: path.to_path_buf(), line: i + 1, reason };
        let prompt = parse_prompt(&line, i as u64, vocab_size, &assets).map_err(bad)?;
        seen.record(&prompt.id, || format!("line {}", i + 1)).map_err(bad)?;
        prompts.push(prompt);
    }
    if prompts.is_empty() {
        return Err(DataError::File { path: path.to_path_buf(), reason: "no prompts".into() });
    }
    Ok(prompts)
}

fn parse_prompt<'a>(
    line: &str,
    line_number: u64,
    vocab_size: usize,
    assets: &dyn Fn() -> Result<&'a ModelAssets, String>,
) -> Result<Prompt, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("not valid JSON: {e}"))?;
    let input_ids = match value.get("input_ids") {
        Some(ids) => serde_json::from_value::<Vec<i64>>(ids.clone())
            .map_err(|_| "`input_ids` must be a list of integers".to_string())?,
        None => {
            let conv = Conversation::from_json_line(line, line_number).map_err(|e| {
                format!("{e}; expected {{\"input_ids\": [...]}} or a conversation {{\"messages\": [...]}}")
            })?;
            let assets = assets()?;
            let keep = conv.messages.iter().rposition(|m| m["role"] != "assistant").map_or(0, |i| i + 1);
            if keep == 0 {
                return Err("the conversation has no message before its assistant turns".into());
            }
            let text =
                assets.template.render(&conv.messages[..keep], conv.tools.as_ref(), true).map_err(|e| e.to_string())?;
            assets.tokenizer.encode(&text)?.ids.iter().map(|&t| t as i64).collect()
        }
    };
    if input_ids.is_empty() {
        return Err("the prompt has no tokens".into());
    }
    if let Some(t) = input_ids.iter().find(|&&t| t < 0 || t as usize >= vocab_size) {
        return Err(format!("token id {t} is outside the target's vocabulary (0..{vocab_size})"));
    }
    let id = SampleId::from_json(value.get("id"), line_number)?;
    Ok(Prompt { id, input_ids })
}

/// Where a prepared row's prompt ends: its first supervised token, where its first reply begins (`None`: no reply,
/// or one that begins the row and so has no prompt). The in-training evaluation and `inspect --prompts` cut held-out
/// rows here, so that the target answers anew rather than continuing past its own answer.
pub fn prompt_end(loss_mask: &[u8]) -> Option<usize> {
    loss_mask.iter().position(|&m| m != 0).filter(|&first| first > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

    /// Reads `text` as a prompts file; `tiny`: with the tiny tokenizer, else as a folder without one.
    fn read(text: &str, tiny: bool) -> Result<Vec<Prompt>, DataError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        std::fs::write(&path, text).unwrap();
        let assets = || match tiny {
            true => Ok(ModelAssets::tiny(&Map::new())),
            false => Err("no tokenizer.json in the model folder".to_string()),
        };
        read_prompts(&path, 320, &assets)
    }

    #[test]
    fn token_and_chat_prompts() {
        let assets = ModelAssets::tiny(&Map::new());
        let text = concat!(
            "{\"input_ids\": [1, 2, 3]}\n",
            "\n",
            "{\"id\": \"q-7\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n",
        );
        let p = read(text, true).unwrap();
        assert_eq!(p[0], Prompt { id: SampleId::Number(0), input_ids: vec![1, 2, 3] });
        assert_eq!(p[1].id, SampleId::Text("q-7".into()));
        let expected =
            assets.template.render(&[serde_json::json!({"role": "user", "content": "hi"})], None, true).unwrap();
        assert!(expected.ends_with("<|im_start|>assistant\n"), "{expected:?}");
        let ids: Vec<i64> = assets.tokenizer.encode(&expected).unwrap().ids.iter().map(|&t| t as i64).collect();
        assert_eq!(p[1].input_ids, ids, "the assistant answer is dropped and a generation prompt added");
    }

    #[test]
    fn bad_lines_name_the_line() {
        let e = read("{\"input_ids\": [1]}\n{\"input_ids\": [400]}\n", false).unwrap_err().to_string();
        assert!(e.contains(":2:") && e.contains("400"), "{e}");
        let e = read("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n", false).unwrap_err().to_string();
        assert!(e.contains(":1:") && e.contains("tokenizer.json"), "{e}");
        assert_eq!(read("{\"input_ids\": [1]}\n", false).unwrap().len(), 1, "token ids need no tokenizer");
        assert!(read("{\"input_ids\": []}\n", false).unwrap_err().to_string().contains("no tokens"));
        assert!(read("\n", false).unwrap_err().to_string().contains("no prompts"));
        let e = read("{\"id\": \"a\", \"input_ids\": [1]}\n{\"id\": \"a\", \"input_ids\": [2]}\n", false).unwrap_err();
        assert!(e.to_string().contains(":2:") && e.to_string().contains("already used at line 1"), "{e}");
    }

    #[test]
    fn a_prompt_ends_where_the_first_reply_begins() {
        assert_eq!(prompt_end(&[0, 0, 1, 1, 0, 0, 0, 1, 1, 1]), Some(2), "the first of two turns");
        assert_eq!(prompt_end(&[0, 0, 0, 0, 1]), Some(4));
        assert_eq!(prompt_end(&[0, 0, 0]), None, "no reply");
        assert_eq!(prompt_end(&[1, 1, 0]), None, "a reply with no prompt before it");
    }
}

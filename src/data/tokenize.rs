//! Tokenizing rendered conversations as HuggingFace's `apply_chat_template(..., tokenize=True)` does (the template
//! already wrote every special token, so none are added), and turning supervised byte ranges into a per-token loss
//! mask. Also builds byte-level BPE tokenizers: the built-in one of the `tiny` preset, and the ones tests create.
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// A model folder's `tokenizer.json`.
pub struct TextTokenizer {
    inner: Tokenizer,
}

/// Token ids of a text and the byte range of the text each came from.
pub struct Encoded {
    pub ids: Vec<u32>,
    pub offsets: Vec<(usize, usize)>,
}

impl TextTokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, String> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(format!("{}: not found; the model folder needs its tokenizer.json", path.display()));
        }
        let inner = Tokenizer::from_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(TextTokenizer { inner })
    }

    pub fn from_tokenizer(inner: Tokenizer) -> Self {
        TextTokenizer { inner }
    }

    /// Tokenizes `text` without adding special tokens.
    pub fn encode(&self, text: &str) -> Result<Encoded, String> {
        let enc = self.inner.encode(text, false).map_err(|e| e.to_string())?;
        Ok(Encoded { ids: enc.get_ids().to_vec(), offsets: enc.get_offsets().to_vec() })
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.inner.decode(ids, false).map_err(|e| e.to_string())
    }

    /// The id of a token written out (`<|im_end|>`), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The ids of the special tokens the tokenizer declares (`<|im_start|>`, `<|im_end|>`, ...): text a person types
    /// never holds them.
    pub fn special_ids(&self) -> std::collections::HashSet<u32> {
        self.inner.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, _)| id).collect()
    }

    /// The tokenizer's whole definition as the tokenizers library writes it (vocabulary, merges, normalisation,
    /// special tokens): the same for the same tokenizer however its file was formatted.
    pub fn definition(&self) -> Result<String, String> {
        self.inner.to_string(false).map_err(|e| e.to_string())
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The MASK token `draft_model.mask_token_id = "auto"` picks for a target of `vocab_size` embedding rows, and the
    /// rule that picked it, given the special tokens the folder declares (`declared_special_tokens`) and the ids its
    /// chat template writes (`written`, [`ChatTemplate::token_ids_written`](crate::data::chat::ChatTemplate::token_ids_written)): a
    /// MASK that every rendered chat holds would share its embedding with real context. In order:
    /// - the tokenizer's own `mask_token`, as speculators takes it;
    /// - the first row no token uses (Qwen3: 151669; speculators adds `<|MASK|>` there);
    /// - the lowest-id reserved special token (Llama-3: `<|reserved_special_token_0|>`, 128002, z-lab's choice for
    ///   Llama-3.1; GPT-OSS: `<|reserved_200000|>`);
    /// - the pad, end-of-sequence or unknown token the template never writes, speculators' fallback when every row is
    ///   used;
    /// - the lowest-id special token the template never writes (SmolLM2, whose end of sequence is `<|im_start|>`).
    ///
    /// None of these: an error listing the special tokens, to choose one the data never contains.
    pub fn unused_mask_token(
        &self,
        vocab_size: usize,
        declared: &[(String, String)],
        written: &std::collections::HashSet<u32>,
    ) -> Result<(u32, String), String> {
        let unwritten = |id: &u32| !written.contains(id) && (*id as usize) < vocab_size;
        let id_of = |role: &str| {
            declared
                .iter()
                .find(|(r, _)| r == role)
                .and_then(|(_, content)| Some((self.token_id(content)?, content)))
                .filter(|(id, _)| unwritten(id))
        };
        if let Some((id, content)) = id_of("mask_token") {
            return Ok((id, format!("the tokenizer's mask token, {content}")));
        }
        let rows_used = self.inner.get_vocab(true).values().copied().max().map_or(0, |m| m + 1);
        if (rows_used as usize) < vocab_size {
            return Ok((
                rows_used,
                format!("the first embedding row no token uses ({vocab_size} rows, tokens 0..{rows_used})"),
            ));
        }
        let mut specials: Vec<(u32, String)> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        specials.sort();
        let reserved = |(id, c): &&(u32, String)| unwritten(id) && c.to_lowercase().contains("reserved");
        if let Some((id, content)) = specials.iter().find(reserved) {
            return Ok((*id, format!("the first reserved special token, {content}")));
        }
        let shared = "every embedding row is used and no special token is reserved, so the MASK shares its \
                      embedding with a token the chat template never writes (set draft_model.mask_token_id to a \
                      token your data never contains to choose another)";
        for (role, name) in [("pad_token", "pad"), ("eos_token", "end-of-sequence"), ("unk_token", "unknown")] {
            if let Some((id, content)) = id_of(role) {
                return Ok((id, format!("the tokenizer's {name} token {content}: {shared}, as speculators does")));
            }
        }
        if let Some((id, content)) = specials.iter().find(|(id, _)| unwritten(id)) {
            return Ok((*id, format!("the lowest-id special token, {content}: {shared}")));
        }
        let listed: Vec<String> = specials.iter().take(20).map(|(id, c)| format!("{id} {c}")).collect();
        Err(format!(
            "the tokenizer uses all {vocab_size} embedding rows and has no mask, reserved or other special token that \
             its chat template does not write: set draft_model.mask_token_id to a token the data never contains \
             (special tokens: {})",
            if listed.is_empty() { "none".to_string() } else { listed.join(", ") }
        ))
    }
}

/// The special tokens a model folder declares by role (`mask_token`, `pad_token`, `eos_token`, `unk_token`, ...):
/// `tokenizer_config.json`'s, overridden by `special_tokens_map.json`'s as transformers 4 reads them (a string, or an
/// object with its `content`). Neither file: none.
pub fn declared_special_tokens(dir: &Path) -> Result<Vec<(String, String)>, String> {
    let mut declared: Vec<(String, String)> = Vec::new();
    for file in ["tokenizer_config.json", "special_tokens_map.json"] {
        let path = dir.join(file);
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: not valid JSON: {e}", path.display()))?;
        for role in ["mask_token", "pad_token", "eos_token", "unk_token"] {
            let Some(content) = special_token(&json, role) else { continue };
            declared.retain(|(r, _)| r != role);
            declared.push((role.to_string(), content));
        }
    }
    Ok(declared)
}

/// The special token a tokenizer configuration declares for `role` (`eos_token`, ...): a string, or an object with
/// its `content`, as transformers writes either; `None` when absent or null.
pub fn special_token(config: &serde_json::Value, role: &str) -> Option<String> {
    match config.get(role)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// 1 for every token whose text starts inside one of `spans` (byte ranges), else 0.
pub fn loss_mask(offsets: &[(usize, usize)], spans: &[Range<usize>]) -> Vec<u8> {
    offsets
        .iter()
        .map(|&(start, end)| {
            let inside = spans.iter().any(|s| start >= s.start && start < s.end && end <= s.end);
            u8::from(inside)
        })
        .collect()
}

/// GPT-2's reversible map from bytes to printable characters, which byte-level BPE vocabularies are written in.
pub fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            extra += 1;
            char::from_u32(255 + extra).expect("valid code point")
        };
    }
    table
}

/// A byte-level BPE tokenizer: byte b is token b, then `merges` (pairs of byte strings) as tokens 256.., then the
/// `special` tokens in order.
pub fn byte_level_tokenizer(merges: &[(&str, &str)], special: &[&str]) -> Result<Tokenizer, String> {
    let chars = byte_to_char();
    let encode = |s: &str| -> String { s.bytes().map(|b| chars[b as usize]).collect() };
    let mut vocab: HashMap<String, u32> = (0..256).map(|b| (chars[b].to_string(), b as u32)).collect();
    let mut merge_list = Vec::new();
    for (a, b) in merges {
        let (a, b) = (encode(a), encode(b));
        let next = vocab.len() as u32;
        vocab.entry(format!("{a}{b}")).or_insert(next);
        merge_list.push((a, b));
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab.into_iter().collect::<tokenizers::models::bpe::Vocab>(), merge_list)
        .build()
        .map_err(|e| e.to_string())?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    let special: Vec<AddedToken> = special.iter().map(|t| AddedToken::from(t.to_string(), true)).collect();
    tokenizer.add_special_tokens(&special);
    Ok(tokenizer)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// The tokenizer's mask token first, then the first unused embedding row, the lowest reserved special token, the
    /// pad, end-of-sequence or unknown token; else an error that lists the special tokens.
    #[test]
    fn the_mask_token_follows_the_rule_in_order() {
        let none: Vec<(String, String)> = vec![];
        let nothing = HashSet::new();
        let declare = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs.iter().map(|(r, c)| (r.to_string(), c.to_string())).collect()
        };
        let t = TextTokenizer::from_tokenizer(byte_level_tokenizer(&[], &["<|im_end|>", "<think>"]).unwrap());
        assert_eq!(
            t.unused_mask_token(300, &none, &nothing).unwrap().0,
            258,
            "256 bytes and two specials use rows 0..258"
        );
        let (id, why) = t.unused_mask_token(300, &declare(&[("mask_token", "<think>")]), &nothing).unwrap();
        assert_eq!((id, why.contains("mask token")), (257, true), "the tokenizer's own mask token first: {why}");
        let specials = ["<|begin|>", "<|end|>", "<|reserved_special_token_1|>", "<|reserved_special_token_0|>"];
        let t = TextTokenizer::from_tokenizer(byte_level_tokenizer(&[], &specials).unwrap());
        let (id, why) = t.unused_mask_token(260, &declare(&[("pad_token", "<|end|>")]), &nothing).unwrap();
        assert_eq!(id, 258, "the lowest-id reserved one, whatever its name's number, before the pad: {why}");
        assert!(why.contains("reserved_special_token_1"), "{why}");
        let t = TextTokenizer::from_tokenizer(byte_level_tokenizer(&[], &["<|begin|>", "<|end|>"]).unwrap());
        let (id, why) =
            t.unused_mask_token(258, &declare(&[("eos_token", "<|end|>"), ("unk_token", "x")]), &nothing).unwrap();
        assert_eq!(id, 257, "no free row, no reserved token: the end-of-sequence token, as speculators: {why}");
        assert!(why.contains("end-of-sequence token <|end|>"), "{why}");
        let (id, _) = t
            .unused_mask_token(258, &declare(&[("unk_token", "<|begin|>"), ("pad_token", "<|end|>")]), &nothing)
            .unwrap();
        assert_eq!(id, 257, "pad before unknown, whatever the order they are declared in");
        let both: HashSet<u32> = [256, 257].into();
        let err = t.unused_mask_token(258, &declare(&[("pad_token", "<|end|>")]), &both).unwrap_err();
        assert!(err.contains("draft_model.mask_token_id") && err.contains("256 <|begin|>"), "{err}");
    }

    /// A token the chat template writes into every chat is never the MASK, whatever role it is declared in
    /// (SmolLM2's folder declares `<|im_start|>` its end of sequence): the next candidate is taken, and the rule says so.
    #[test]
    fn the_mask_token_is_never_one_the_chat_template_writes() {
        let declare = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs.iter().map(|(r, c)| (r.to_string(), c.to_string())).collect()
        };
        let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<|reserved_0|>"];
        let t = TextTokenizer::from_tokenizer(byte_level_tokenizer(&[], &specials).unwrap());
        let written: HashSet<u32> = [257, 258, 260].into();
        let roles =
            declare(&[("eos_token", "<|im_start|>"), ("unk_token", "<|endoftext|>"), ("mask_token", "<|im_end|>")]);
        let (id, why) = t.unused_mask_token(261, &roles, &written).unwrap();
        assert_eq!(id, 256, "not the written mask, reserved or end-of-sequence token: the unknown token: {why}");
        assert!(why.contains("unknown token <|endoftext|>") && why.contains("never writes"), "{why}");
        let written: HashSet<u32> = [256, 257, 258, 260].into();
        let (id, why) = t.unused_mask_token(261, &roles, &written).unwrap();
        assert_eq!(id, 259, "no role left: the lowest special token the template does not write: {why}");
        assert!(why.contains("<repo_name>"), "{why}");
    }

    /// transformers 4 reads both files, the special tokens map over the tokenizer's configuration; the object form
    /// gives its content.
    #[test]
    fn declared_special_tokens_read_both_files() {
        let dir = tempfile::tempdir().unwrap();
        assert!(declared_special_tokens(dir.path()).unwrap().is_empty(), "neither file: none");
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"eos_token": "<|end|>", "pad_token": null, "unk_token": {"content": "<unk>", "special": true}}"#,
        )
        .unwrap();
        std::fs::write(dir.path().join("special_tokens_map.json"), r#"{"eos_token": "<|eot|>"}"#).unwrap();
        let mut got = declared_special_tokens(dir.path()).unwrap();
        got.sort();
        assert_eq!(got, vec![("eos_token".into(), "<|eot|>".into()), ("unk_token".into(), "<unk>".into())]);
        std::fs::write(dir.path().join("special_tokens_map.json"), "{").unwrap();
        assert!(declared_special_tokens(dir.path()).unwrap_err().contains("special_tokens_map.json"));
    }

    #[test]
    fn byte_level_ids_are_bytes_and_specials_follow() {
        let t = TextTokenizer::from_tokenizer(byte_level_tokenizer(&[("h", "i")], &["<|a|>", "<|b|>"]).unwrap());
        assert_eq!(t.vocab_size(), 256 + 1 + 2);
        assert_eq!(t.token_id("<|a|>"), Some(257));
        let e = t.encode("hi é<|b|>x").unwrap();
        assert_eq!(e.ids, vec![256, 32, 0xC3, 0xA9, 258, b'x' as u32]);
        assert_eq!(e.offsets[4], (5, 10)); // the special token's bytes
        assert_eq!(t.decode(&e.ids).unwrap(), "hi é<|b|>x");
    }

    #[test]
    fn the_mask_covers_tokens_starting_in_a_span() {
        let offsets = [(0, 2), (2, 4), (4, 6), (6, 8)];
        assert_eq!(loss_mask(&offsets, std::slice::from_ref(&(2..6))), vec![0, 1, 1, 0]);
        assert_eq!(loss_mask(&offsets, &[3..8, 0..1]), vec![0, 0, 1, 1]); // (0, 2) straddles 0..1
    }
}

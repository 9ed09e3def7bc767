//! A sample's id as the data gives it, and the 64-bit key the trainer uses for it.
//!
//! Public chat sets carry string ids (ShareGPT's `"QWJhYvA_0"`, UltraChat's hex `prompt_id`), other tools integer
//! ids, and some none. An id is kept as given (an integer stays an integer, a string a string) in every output and
//! report; a line without one is numbered by its 0-based line. Two ids are the same when their text is: `5` and
//! `"5"` are one id, `"05"` is another.
//!
//! The trainer works with a `u64` key per sample (the holdout draw, the anchors' random stream, the index of a
//! prepared shard). An integer's key is the integer itself (so integer-id data keeps the keys, holdout split and
//! anchors it always had), and so is a string's that is an integer written plainly (`"5"`); any other string's key
//! is the first 8 bytes of its SHA-256 (little-endian) with the top bit set: the same on every machine and in every
//! version, and apart from every integer below 2^63.
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::hash::{Hash, Hasher};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SampleId {
    Number(u64),
    Text(String),
}

impl SampleId {
    /// The id of a JSON line: its `id` field (`value`; `None` or null when it has none), else `line`, the line's
    /// 0-based number.
    pub fn from_json(value: Option<&Value>, line: u64) -> Result<Self, String> {
        match value {
            None | Some(Value::Null) => Ok(SampleId::Number(line)),
            Some(Value::Number(n)) if n.is_u64() => Ok(SampleId::Number(n.as_u64().expect("checked"))),
            Some(Value::String(s)) if !s.is_empty() => Ok(SampleId::Text(s.clone())),
            Some(other) => Err(format!("`id` {other} is neither a non-negative integer nor a non-empty string")),
        }
    }

    /// An id typed by a person (`inspect --id`): its text.
    pub fn parse(text: &str) -> Self {
        SampleId::Text(text.to_string())
    }

    /// The trainer's key (see the module documentation).
    pub fn key(&self) -> u64 {
        match self {
            SampleId::Number(n) => *n,
            SampleId::Text(s) => plain_integer(s).unwrap_or_else(|| {
                let digest = Sha256::digest(s.as_bytes());
                u64::from_le_bytes(digest[..8].try_into().expect("8 bytes")) | 1 << 63
            }),
        }
    }

    /// The id as it was given, for JSON outputs.
    pub fn to_json(&self) -> Value {
        match self {
            SampleId::Number(n) => Value::from(*n),
            SampleId::Text(s) => Value::from(s.as_str()),
        }
    }

    /// The id of piece `n` (from 0) of a sample cut into pieces: the sample's own id for the first, `"{id}#{n}"`
    /// after it.
    pub fn piece(&self, n: usize) -> Self {
        match n {
            0 => self.clone(),
            _ => SampleId::Text(format!("{}#{n}", self.text())),
        }
    }

    fn text(&self) -> std::borrow::Cow<'_, str> {
        match self {
            SampleId::Number(n) => n.to_string().into(),
            SampleId::Text(s) => s.as_str().into(),
        }
    }
}

/// Where each id of an input was first used (`line 3`, `file:3`): a repeated id is an error naming that place.
#[derive(Default)]
pub struct FirstUse(HashMap<SampleId, String>);

impl FirstUse {
    /// Records `id` as used at `here`; an id used before is an error naming where it was first used.
    pub fn record(&mut self, id: &SampleId, here: impl FnOnce() -> String) -> Result<(), String> {
        match self.0.entry(id.clone()) {
            Entry::Occupied(first) => {
                Err(format!("id {id} was already used at {}; give every line a unique id", first.get()))
            }
            Entry::Vacant(slot) => {
                slot.insert(here());
                Ok(())
            }
        }
    }
}

/// `s` as an integer when it is one written plainly: decimal digits, no sign, no leading zero, at most `u64::MAX`.
fn plain_integer(s: &str) -> Option<u64> {
    let plain = s.bytes().all(|b| b.is_ascii_digit()) && !(s.len() > 1 && s.starts_with('0'));
    if plain { s.parse().ok() } else { None }
}

impl PartialEq for SampleId {
    fn eq(&self, other: &Self) -> bool {
        self.text() == other.text()
    }
}

impl Eq for SampleId {}

impl Hash for SampleId {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

impl From<u64> for SampleId {
    fn from(n: u64) -> Self {
        SampleId::Number(n)
    }
}

/// Integers bare, strings quoted (as in the JSON they came from).
impl fmt::Display for SampleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SampleId::Number(n) => write!(f, "{n}"),
            SampleId::Text(s) => write!(f, "{s:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn integers_and_plain_integer_strings_are_one_id_with_the_integer_as_key() {
        let five = SampleId::from_json(Some(&json!(5)), 0).unwrap();
        let text = SampleId::from_json(Some(&json!("5")), 0).unwrap();
        assert_eq!(five, text);
        assert_eq!((five.key(), text.key()), (5, 5));
        assert_eq!(five.to_json(), json!(5), "kept as given");
        assert_eq!(text.to_json(), json!("5"), "kept as given");
        for other in ["05", "+5", "5.0", " 5"] {
            let id = SampleId::parse(other);
            assert_ne!(id, five, "{other}");
            assert!(id.key() >= 1 << 63, "{other}: a hashed key");
        }
        assert_eq!(SampleId::parse("18446744073709551615").key(), u64::MAX);
        assert!(SampleId::parse("18446744073709551616").key() >= 1 << 63, "too large: a text id");
    }

    #[test]
    fn text_keys_are_fixed_forever() {
        // The first 8 bytes of SHA-256("QWJhYvA_0"), little-endian, top bit set. A change here reshuffles every
        // prepared data set's holdout split: never change it.
        // (Python: int.from_bytes(hashlib.sha256(b"QWJhYvA_0").digest()[:8], "little") | 1 << 63.)
        let id = SampleId::parse("QWJhYvA_0");
        assert_eq!(id.key(), 0xacd3_71ec_f2b8_a958);
        assert_ne!(SampleId::parse("QWJhYvA_1").key(), id.key());
    }

    #[test]
    fn missing_ids_are_line_numbers_and_bad_ids_are_named() {
        assert_eq!(SampleId::from_json(None, 7).unwrap(), SampleId::Number(7));
        assert_eq!(SampleId::from_json(Some(&Value::Null), 7).unwrap(), SampleId::Number(7));
        for bad in [json!(-1), json!(1.5), json!(""), json!([1]), json!(true)] {
            let e = SampleId::from_json(Some(&bad), 0).unwrap_err();
            assert!(e.contains("`id`") && e.contains("non-empty string"), "{e}");
        }
    }

    #[test]
    fn serde_keeps_the_type() {
        let ids: Vec<SampleId> = serde_json::from_str(r#"[3, "a", "3"]"#).unwrap();
        assert_eq!(serde_json::to_string(&ids).unwrap(), r#"[3,"a","3"]"#);
        assert_eq!(format!("{} {}", ids[0], ids[1]), "3 \"a\"");
    }
}

//! Token rows as JSON lines: `{"id"?: int|string, "input_ids": [int...], "loss_mask": [0|1...]}`, one conversation
//! per line. `dflash eval --data` reads them (and keeps reading them once prepared shards exist).
use std::io::BufRead;
use std::path::Path;

use serde::Deserialize;

use super::sample_id::FirstUse;
use super::{DataError, SampleId};

/// One conversation: token ids and the loss mask (1 on supervised tokens).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenRow {
    /// The row's id as given (the line number, 0-based, when the file gives none).
    pub id: SampleId,
    pub input_ids: Vec<i64>,
    pub loss_mask: Vec<u8>,
}

/// Other fields (text, metadata from other tools) are ignored.
#[derive(Deserialize)]
struct RawRow {
    id: Option<serde_json::Value>,
    input_ids: Vec<i64>,
    loss_mask: Vec<u8>,
}

/// Reads every row of a JSONL file; any bad line (a repeated id among them) is an error naming the file and line.
/// Token ids must be below `vocab_size`.
pub fn read_token_rows(path: &Path, vocab_size: usize) -> Result<Vec<TokenRow>, DataError> {
    let file = std::fs::File::open(path).map_err(|err| DataError::Io { path: path.to_path_buf(), err })?;
    let mut rows = Vec::new();
    let mut seen = FirstUse::default();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|err| DataError::Io { path: path.to_path_buf(), err })?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| DataError::Line { path: path.to_path_buf(), line: i + 1, reason };
        let row = parse_row(&line, i as u64, vocab_size).map_err(bad)?;
        seen.record(&row.id, || format!("line {}", i + 1)).map_err(bad)?;
        rows.push(row);
    }
    if rows.is_empty() {
        return Err(DataError::File { path: path.to_path_buf(), reason: "no rows".into() });
    }
    Ok(rows)
}

/// One line as a row, checked: JSON of the expected shape, a valid id (`line_number`, 0-based, when it has none), as
/// many mask values as tokens, masks of 0 and 1, token ids below `vocab_size`.
pub(crate) fn parse_row(line: &str, line_number: u64, vocab_size: usize) -> Result<TokenRow, String> {
    let raw: RawRow = serde_json::from_str(line).map_err(|e| {
        let value = serde_json::from_str::<serde_json::Value>(line).unwrap_or_default();
        if value.get("messages").is_some() || value.get("conversations").is_some() {
            return "a conversation, not a token row: tokenize conversations with `dflash prepare` and train from its \
                    folder"
                .to_string();
        }
        format!("{e}; expected {{\"id\"?: int|string, \"input_ids\": [int...], \"loss_mask\": [0|1...]}}")
    })?;
    if raw.input_ids.is_empty() {
        return Err("input_ids is empty".into());
    }
    if raw.input_ids.len() != raw.loss_mask.len() {
        return Err(format!("input_ids has {} tokens but loss_mask has {}", raw.input_ids.len(), raw.loss_mask.len()));
    }
    if let Some(m) = raw.loss_mask.iter().find(|&&m| m > 1) {
        return Err(format!("loss_mask holds {m}; only 0 and 1 are allowed"));
    }
    if let Some(t) = raw.input_ids.iter().find(|&&t| t < 0 || t as usize >= vocab_size) {
        return Err(format!(
            "token id {t} is outside the target's vocabulary (0..{vocab_size}): rows made for another model?"
        ));
    }
    let id = SampleId::from_json(raw.id.as_ref(), line_number)?;
    Ok(TokenRow { id, input_ids: raw.input_ids, loss_mask: raw.loss_mask })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<Vec<TokenRow>, DataError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows.jsonl");
        std::fs::write(&path, text).unwrap();
        read_token_rows(&path, 100)
    }

    #[test]
    fn reads_rows_and_numbers_missing_ids_by_line() {
        let rows = read("{\"input_ids\": [1, 2], \"loss_mask\": [0, 1], \"text\": \"ignored\"}\n\n{\"id\": 9, \"input_ids\": [3], \"loss_mask\": [1]}\n{\"id\": \"a-1\", \"input_ids\": [3], \"loss_mask\": [1]}\n").unwrap();
        assert_eq!(rows[0].id, SampleId::Number(0));
        assert_eq!(rows[1].id, SampleId::Number(9));
        assert_eq!(rows[2].id, SampleId::Text("a-1".into()));
        assert_eq!(rows[1].input_ids, vec![3]);
    }

    #[test]
    fn bad_lines_name_file_line_and_problem() {
        let cases = [
            ("{\"input_ids\": [1, 2], \"loss_mask\": [1]}", "loss_mask has 1"),
            ("{\"input_ids\": [1], \"loss_mask\": [2]}", "only 0 and 1"),
            ("{\"input_ids\": [100], \"loss_mask\": [1]}", "outside the target's vocabulary"),
            ("{\"input_ids\": [], \"loss_mask\": []}", "empty"),
            ("not json", "expected"),
            ("{\"messages\": []}", "a conversation, not a token row"),
            ("{\"id\": -2, \"input_ids\": [1], \"loss_mask\": [1]}", "`id` -2"),
        ];
        for (line, expected) in cases {
            let err = read(&format!("{{\"input_ids\": [1], \"loss_mask\": [1]}}\n{line}\n")).unwrap_err().to_string();
            assert!(err.contains("rows.jsonl:2:") && err.contains(expected), "{err}");
        }
        assert!(read("").unwrap_err().to_string().contains("no rows"));
        let twice = read(
            "{\"id\": 5, \"input_ids\": [1], \"loss_mask\": [1]}\n{\"id\": \"5\", \"input_ids\": [1], \"loss_mask\": [1]}\n",
        );
        let err = twice.unwrap_err().to_string();
        assert!(err.contains("rows.jsonl:2:") && err.contains("already used at line 1"), "{err}");
    }
}

//! What the recording may keep (`[proxy]`'s `redact` and `skip_headers`): an exchange whose request carries one of the
//! named headers is not recorded; every text of a recorded conversation (each message's `content`, a string or its
//! text parts, and the answer's reasoning and tool-call arguments) passes the redaction rules in order, each masking
//! what its regular expression matches, or dropping the whole exchange on a match. Decided here, on the recorded line,
//! before anything is written; the proxy only counts what was decided.
use serde_json::Value;

use crate::config::RedactRule;

/// The recording's policy.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    /// In order; a rule's `replace` masks what it matches (`$1`, `${name}` name its groups), `None` drops.
    pub rules: Vec<RedactRule>,
    /// Request headers (lower case) whose presence keeps an exchange out of the recording.
    pub skip_headers: Vec<String>,
}

/// What the policy made of an exchange.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Record the line, with this many matches masked.
    Keep { masked: usize },
    /// Not recorded: this rule (its pattern) matched.
    DroppedByRule(String),
}

impl Policy {
    /// Whether the request's header names (any case) keep it out of the recording: the first listed one it carries.
    pub fn skipped_by<'a>(&self, mut names: impl Iterator<Item = &'a str>) -> Option<String> {
        names.find_map(|n| {
            let n = n.to_ascii_lowercase();
            self.skip_headers.contains(&n).then_some(n)
        })
    }

    /// Applies the rules to `line` (a recorded conversation, `messages` in it), masking in place.
    pub fn apply(&self, line: &mut Value) -> Verdict {
        let mut masked = 0;
        let Some(messages) = line.get_mut("messages").and_then(Value::as_array_mut) else {
            return Verdict::Keep { masked };
        };
        for message in messages {
            for text in texts_of(message) {
                for rule in &self.rules {
                    let found = rule.pattern.find_iter(text).count();
                    if found == 0 {
                        continue;
                    }
                    match &rule.replace {
                        None => return Verdict::DroppedByRule(rule.pattern.as_str().to_string()),
                        Some(with) => {
                            masked += found;
                            *text = rule.pattern.replace_all(text, with.as_str()).into_owned();
                        }
                    }
                }
            }
        }
        Verdict::Keep { masked }
    }
}

/// Every text a message carries that a user or the model wrote: its content (a string, or the `text` of its parts),
/// its reasoning, and its tool calls' arguments.
fn texts_of(message: &mut Value) -> Vec<&mut String> {
    let Some(m) = message.as_object_mut() else { return Vec::new() };
    let mut texts = Vec::new();
    for (key, value) in m.iter_mut() {
        match (key.as_str(), value) {
            ("content" | "reasoning_content", Value::String(s)) => texts.push(s),
            ("content", Value::Array(parts)) => {
                texts.extend(parts.iter_mut().filter_map(|p| match p.get_mut("text") {
                    Some(Value::String(s)) => Some(s),
                    _ => None,
                }));
            }
            ("tool_calls", Value::Array(calls)) => {
                texts.extend(calls.iter_mut().filter_map(|c| match c.pointer_mut("/function/arguments") {
                    Some(Value::String(s)) => Some(s),
                    _ => None,
                }));
            }
            _ => {}
        }
    }
    texts
}

#[cfg(test)]
mod tests {
    use super::*;
    use regex::Regex;
    use serde_json::json;

    fn policy() -> Policy {
        Policy {
            rules: vec![
                RedactRule { pattern: Regex::new(r"[\w.]+@[\w.]+\.\w+").unwrap(), replace: Some("[EMAIL]".into()) },
                RedactRule { pattern: Regex::new(r"(?i)password:\s*(\S+)").unwrap(), replace: None },
                RedactRule { pattern: Regex::new(r"key-(\d+)").unwrap(), replace: Some("key-<${1}>".into()) },
            ],
            skip_headers: vec!["x-no-record".into()],
        }
    }

    #[test]
    fn matches_are_masked_in_every_text_of_every_message() {
        let mut line = json!({"messages": [
            {"role": "system", "content": "mail a@b.com or c.d@e.org"},
            {"role": "user", "content": [{"type": "text", "text": "key-42 for x@y.io"}, {"type": "image_url"}]},
            {"role": "assistant", "content": "sent to a@b.com", "reasoning_content": "a@b.com asked",
             "tool_calls": [{"function": {"name": "send", "arguments": "{\"to\": \"q@r.st\"}"}}]},
        ]});
        assert_eq!(policy().apply(&mut line), Verdict::Keep { masked: 7 });
        assert_eq!(line["messages"][0]["content"], "mail [EMAIL] or [EMAIL]");
        assert_eq!(line["messages"][1]["content"][0]["text"], "key-<42> for [EMAIL]");
        assert_eq!(line["messages"][2]["content"], "sent to [EMAIL]");
        assert_eq!(line["messages"][2]["reasoning_content"], "[EMAIL] asked");
        assert_eq!(line["messages"][2]["tool_calls"][0]["function"]["arguments"], "{\"to\": \"[EMAIL]\"}");
        assert_eq!(line["messages"][1]["content"][1], json!({"type": "image_url"}), "non-text parts untouched");
    }

    #[test]
    fn a_drop_rule_keeps_the_exchange_out_and_a_clean_one_is_kept_as_it_was() {
        let mut secret = json!({"messages": [{"role": "user", "content": "my Password: hunter2"}]});
        assert_eq!(policy().apply(&mut secret), Verdict::DroppedByRule(r"(?i)password:\s*(\S+)".into()));
        let clean = json!({"messages": [{"role": "user", "content": "hello"}], "recorded": {"model": "m"}});
        let mut line = clean.clone();
        assert_eq!(policy().apply(&mut line), Verdict::Keep { masked: 0 });
        assert_eq!(line, clean);
        assert_eq!(Policy::default().apply(&mut secret.clone()), Verdict::Keep { masked: 0 }, "no rules, no change");
    }

    #[test]
    fn a_listed_header_in_any_case_skips_the_exchange() {
        let p = policy();
        assert_eq!(p.skipped_by(["content-type", "X-No-Record"].into_iter()), Some("x-no-record".into()));
        assert_eq!(p.skipped_by(["content-type", "authorization"].into_iter()), None);
    }
}

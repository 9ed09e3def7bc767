//! Conversations and the model's chat template: reading OpenAI `messages` and ShareGPT `conversations` lines,
//! rendering with the template from `tokenizer_config.json` as HuggingFace's `apply_chat_template` does (minijinja
//! with Python string methods, `raise_exception`, `strftime_now` and a `tojson` that writes what Python's
//! `json.dumps` writes), and finding, in the FULL rendering, the text each assistant turn contributes.
//!
//! Finding assistant spans: templates rewrite turns (Qwen3 drops reasoning before the last user message, inserts an
//! empty `<think>` block in the last turn, Llama-3 trims content), so the content cannot simply be searched for. For
//! assistant turn i the full conversation is rendered a second time with that turn's content replaced by a marker
//! no text contains: the text before the marker that both renderings share is the template's (role header,
//! inserted blocks), and the text after it, up to the end-of-turn marker, is the turn's own. The turns before i
//! rendered with the generation prompt also tell where generation starts, when the full rendering begins with them
//! (the only clue for a turn whose content the template does not print, such as a Llama-3 tool call); with both,
//! the later start wins. The span ends with the first end-of-turn marker after the content (`<|im_end|>`,
//! `<|eot_id|>`), which is included.
use std::ops::Range;
use std::path::Path;

use minijinja::value::Value as JValue;
use minijinja::{Environment, Error as JError, ErrorKind};
use serde_json::{Map, Value, json};

use super::SampleId;
use super::tokenize::{TextTokenizer, special_token};

/// Strings that end an assistant turn, in the order they are tried.
const END_OF_TURN: [&str; 4] = ["<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>"];

/// Replaces an assistant turn's content when locating it; private-use characters no conversation contains.
fn marker(i: usize) -> String {
    format!("\u{E000}dflash-turn-{i}\u{E001}")
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum ChatError {
    #[error("not valid JSON: {0}")]
    Json(String),
    #[error("{0}")]
    Shape(String),
    #[error("unknown role {0:?} (expected system, user, assistant or tool; ShareGPT: human, gpt, system, tool)")]
    UnknownRole(String),
    #[error("empty conversation")]
    Empty,
    #[error("no assistant turn to learn from")]
    NoAssistant,
    #[error("the chat template failed to render: {0}")]
    Template(String),
    #[error("assistant turn {0} could not be located in the rendered conversation")]
    Unlocated(usize),
}

/// One conversation in OpenAI form: `{"role", "content", ...}` messages, roles normalised.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// The line's `id`, else its 0-based line number.
    pub id: SampleId,
    pub messages: Vec<Value>,
    /// Tool definitions, passed to the template as `tools`.
    pub tools: Option<Value>,
}

impl Conversation {
    /// Parses one JSONL line: `{"messages": [...]}` (OpenAI) or `{"conversations": [{"from", "value"}]}`
    /// (ShareGPT), with an optional `id` (an integer or a string).
    pub fn from_json_line(line: &str, line_number: u64) -> Result<Self, ChatError> {
        let v: Value = serde_json::from_str(line).map_err(|e| ChatError::Json(e.to_string()))?;
        let obj = v.as_object().ok_or_else(|| ChatError::Shape("a line must be a JSON object".into()))?;
        let id = SampleId::from_json(obj.get("id"), line_number).map_err(ChatError::Shape)?;
        let messages = if let Some(m) = obj.get("messages") {
            let list = m.as_array().ok_or_else(|| ChatError::Shape("`messages` must be a list".into()))?;
            list.iter().map(openai_message).collect::<Result<Vec<_>, _>>()?
        } else if let Some(c) = obj.get("conversations") {
            let list = c.as_array().ok_or_else(|| ChatError::Shape("`conversations` must be a list".into()))?;
            list.iter().map(sharegpt_message).collect::<Result<Vec<_>, _>>()?
        } else {
            return Err(ChatError::Shape("expected a `messages` (OpenAI) or `conversations` (ShareGPT) list".into()));
        };
        if messages.is_empty() {
            return Err(ChatError::Empty);
        }
        let tools = obj.get("tools").filter(|t| !t.is_null()).cloned();
        Ok(Conversation { id, messages, tools })
    }

    /// Indices of the assistant messages.
    pub fn assistant_turns(&self) -> Vec<usize> {
        (0..self.messages.len()).filter(|&i| self.messages[i]["role"] == "assistant").collect()
    }
}

fn normal_role(role: &str) -> Option<&'static str> {
    Some(match role {
        "system" | "developer" => "system",
        "user" | "human" => "user",
        "assistant" | "gpt" | "model" | "chatgpt" => "assistant",
        "tool" | "function" | "ipython" | "observation" => "tool",
        _ => return None,
    })
}

/// ShareGPT's names for roles, which an OpenAI `messages` list does not use: a line mixing the two forms is more
/// likely broken than meant.
const SHAREGPT_ONLY: [&str; 4] = ["human", "gpt", "chatgpt", "observation"];

fn openai_message(m: &Value) -> Result<Value, ChatError> {
    let obj = m.as_object().ok_or_else(|| ChatError::Shape("each message must be an object".into()))?;
    let role =
        obj.get("role").and_then(Value::as_str).ok_or_else(|| ChatError::Shape("a message has no `role`".into()))?;
    if SHAREGPT_ONLY.contains(&role) {
        return Err(ChatError::Shape(format!(
            "role {role:?} is ShareGPT's: OpenAI `messages` take system, user, assistant or tool (or write the turns \
             as ShareGPT's `conversations` of `from` and `value`)"
        )));
    }
    let normal = normal_role(role).ok_or_else(|| ChatError::UnknownRole(role.to_string()))?;
    let mut out: Map<String, Value> = obj.clone();
    out.insert("role".into(), json!(normal));
    match out.get("content") {
        // An assistant's tool call needs no text; a request or a system prompt without any is a broken line.
        None | Some(Value::Null) if normal == "user" || normal == "system" => {
            return Err(ChatError::Shape(format!("a {role} message has no `content`")));
        }
        None | Some(Value::Null) => {
            if normal != "assistant" || !out.contains_key("tool_calls") {
                out.insert("content".into(), json!(""));
            }
        }
        Some(Value::String(_)) => {}
        Some(Value::Array(parts)) => {
            // OpenAI content parts: keep the text parts, joined.
            let text: Vec<&str> = parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect();
            out.insert("content".into(), json!(text.join("")));
        }
        Some(other) => {
            return Err(ChatError::Shape(format!("message content {other} is not text")));
        }
    }
    Ok(Value::Object(out))
}

fn sharegpt_message(m: &Value) -> Result<Value, ChatError> {
    let from = m
        .get("from")
        .and_then(Value::as_str)
        .ok_or_else(|| ChatError::Shape("a ShareGPT turn has no `from`".into()))?;
    let role = normal_role(from).ok_or_else(|| ChatError::UnknownRole(from.to_string()))?;
    let value = m
        .get("value")
        .and_then(Value::as_str)
        .ok_or_else(|| ChatError::Shape("a ShareGPT turn has no text `value`".into()))?;
    Ok(json!({ "role": role, "content": value }))
}

/// A rendered conversation and the byte ranges the assistant produced (content through its end-of-turn marker).
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    pub text: String,
    pub supervised: Vec<Range<usize>>,
}

/// The chat template of a model folder, ready to render.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, ... and the user's template variables.
    globals: Map<String, Value>,
    end_of_turn: Vec<String>,
    /// What renders: the template's source and its special-token variables (not the user's variables).
    identity: String,
}

impl ChatTemplate {
    /// Reads `dir/tokenizer_config.json` (`chat_template`, a string or a list of named templates, `default` first;
    /// or `dir/chat_template.jinja`), with `kwargs` passed to the template as variables.
    pub fn from_dir(dir: &Path, kwargs: &Map<String, Value>) -> Result<Self, String> {
        let path = dir.join("tokenizer_config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => format!(
                "{}: not found; the model folder needs its tokenizer_config.json (the chat template and special \
                 tokens, beside tokenizer.json in the model's repository)",
                path.display()
            ),
            _ => format!("{}: {e}", path.display()),
        })?;
        let config: Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: not valid JSON: {e}", path.display()))?;
        let template = match config.get("chat_template") {
            Some(Value::String(t)) => t.clone(),
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t["name"] == "default")
                .or_else(|| list.first())
                .and_then(|t| t["template"].as_str())
                .map(str::to_string)
                .ok_or_else(|| format!("{}: `chat_template` list has no template", path.display()))?,
            _ => {
                let jinja = dir.join("chat_template.jinja");
                std::fs::read_to_string(&jinja).map_err(|_| {
                    format!("{}: no `chat_template`, and no chat_template.jinja beside it", path.display())
                })?
            }
        };
        let mut specials = Map::new();
        for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            specials.insert(key.into(), special_token(&config, key).map_or(Value::Null, Value::String));
        }
        Self::new(&template, specials, kwargs).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// A template from its source, with special-token variables (`bos_token`, `eos_token`, ...) and kwargs.
    pub fn new(source: &str, specials: Map<String, Value>, kwargs: &Map<String, Value>) -> Result<Self, String> {
        let mut env = Environment::new();
        // HuggingFace renders chat templates with these two on.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<JValue, JError> {
            Err(JError::new(ErrorKind::InvalidOperation, message))
        });
        env.add_function("strftime_now", |format: String| -> String {
            chrono::Local::now().format(&format).to_string()
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| format!("the chat template does not parse: {e}"))?;
        let eos = specials.get("eos_token").and_then(Value::as_str).map(str::to_string);
        let mut end_of_turn: Vec<String> = END_OF_TURN
            .iter()
            .filter(|m| source.contains(*m) || eos.as_deref() == Some(m))
            .map(|m| m.to_string())
            .collect();
        if let Some(e) = eos.filter(|e| !end_of_turn.contains(e)) {
            end_of_turn.push(e);
        }
        // The special tokens a template can print (unset ones are as good as absent).
        let set: Map<String, Value> =
            specials.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
        let identity = format!("{source}\n{}", Value::Object(set));
        let mut globals = specials;
        globals.extend(kwargs.clone());
        Ok(ChatTemplate { env, globals, end_of_turn, identity })
    }

    /// The template's source and special-token variables, which decide what it renders (with the user's variables,
    /// which are settings of their own).
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// The token ids the template writes around the messages (role markers, turn ends, a default system prompt), as
    /// `tokenizer` reads them: those of a conversation of a system prompt and two exchanges, and of a generation
    /// prompt, rendered with every message's content the letter `x`. A template that refuses a system prompt is
    /// rendered without one.
    pub fn token_ids_written(&self, tokenizer: &TextTokenizer) -> Result<std::collections::HashSet<u32>, String> {
        let turn = |role: &str| json!({"role": role, "content": "x"});
        let exchanges = [turn("user"), turn("assistant"), turn("user"), turn("assistant")];
        let with_system: Vec<Value> = std::iter::once(turn("system")).chain(exchanges.iter().cloned()).collect();
        let rendered = self
            .render(&with_system, None, false)
            .or_else(|_| self.render(&exchanges, None, false))
            .map_err(|e| e.to_string())?;
        let prompt = self.render(&exchanges[..1], None, true).map_err(|e| e.to_string())?;
        let mut ids = std::collections::HashSet::new();
        for text in [rendered, prompt] {
            ids.extend(tokenizer.encode(&text)?.ids);
        }
        Ok(ids)
    }

    /// Renders `messages` as `apply_chat_template(messages, tools, add_generation_prompt, **kwargs)` would.
    pub fn render(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let mut ctx = self.globals.clone();
        ctx.insert("messages".into(), Value::Array(messages.to_vec()));
        ctx.insert("tools".into(), tools.cloned().unwrap_or(Value::Null));
        ctx.insert("documents".into(), Value::Null);
        ctx.insert("add_generation_prompt".into(), json!(add_generation_prompt));
        let template = self.env.get_template("chat").expect("added in new()");
        template.render(JValue::from_serialize(&ctx)).map_err(|e| ChatError::Template(template_error(&e)))
    }

    /// The text that opens a new user turn after `messages`: the rendering of `messages` and a user turn, up to where
    /// that turn's content starts (Magpie's pre-query template: an aligned model given it writes a user's request).
    /// The template's own additions stay (a default system prompt when `messages` has none, a BOS token).
    pub fn user_opening(&self, messages: &[Value]) -> Result<String, ChatError> {
        let mark = marker(usize::MAX);
        let mut probe = messages.to_vec();
        probe.push(json!({"role": "user", "content": mark}));
        let rendered = self.render(&probe, None, false)?;
        let at = rendered.find(&mark).ok_or_else(|| {
            ChatError::Template(
                "a user turn's content does not appear in its rendering (the template rewrites it)".into(),
            )
        })?;
        Ok(rendered[..at].to_string())
    }

    /// Renders the whole conversation and finds the byte ranges each assistant turn produced.
    pub fn render_supervised(&self, conv: &Conversation) -> Result<Rendered, ChatError> {
        let turns = conv.assistant_turns();
        if turns.is_empty() {
            return Err(ChatError::NoAssistant);
        }
        let tools = conv.tools.as_ref();
        let full = self.render(&conv.messages, tools, false)?;
        let mut supervised = Vec::with_capacity(turns.len());
        let mut cursor = 0;
        for &i in &turns {
            let span = self.locate(conv, &full, i, cursor)?;
            cursor = span.end;
            supervised.push(span);
        }
        Ok(Rendered { text: full, supervised })
    }

    /// The byte range of assistant turn `i` in `full`, at or after `cursor`.
    fn locate(&self, conv: &Conversation, full: &str, i: usize, cursor: usize) -> Result<Range<usize>, ChatError> {
        let tools = conv.tools.as_ref();
        // Where generation starts, if the full rendering begins with the rendering of the turns before `i`
        // followed by the generation prompt.
        let prompt = self.render(&conv.messages[..i], tools, true)?;
        let from_prompt = (full.starts_with(&prompt) && prompt.len() >= cursor).then_some(prompt.len());
        // The turn's content replaced by a marker.
        let mark = marker(i);
        let mut probe = conv.messages.clone();
        probe[i]["content"] = json!(mark);
        if let Some(obj) = probe[i].as_object_mut() {
            obj.remove("reasoning_content");
        }
        let probed = self.render(&probe, tools, false)?;
        let content = probed.find(&mark).map(|at| {
            let shared_prefix = common_prefix(full, &probed);
            let start = at.min(shared_prefix);
            let after = &probed[at + mark.len()..];
            let shared_suffix = common_suffix(&full[start..], after);
            (start, full.len() - shared_suffix)
        });
        let (start, content_end) = match (from_prompt, content) {
            // Both: the later start, so text the template inserts after the generation prompt (Qwen3's empty
            // `<think>` block in the last turn) stays unsupervised.
            (Some(p), Some((s, end))) => (p.max(s), end.max(p.max(s))),
            (Some(p), None) => (p, p),
            (None, Some((s, end))) if s >= cursor => (s, end.max(s)),
            _ => return Err(ChatError::Unlocated(i)),
        };
        let end = self
            .end_of_turn
            .iter()
            .filter_map(|m| full[content_end..].find(m.as_str()).map(|at| content_end + at + m.len()))
            .min()
            .ok_or(ChatError::Unlocated(i))?;
        Ok(start..end)
    }
}

/// The first line of a template error, with its source line when minijinja knows it.
fn template_error(e: &JError) -> String {
    let mut msg = e.to_string();
    if let Some(line) = e.line() {
        msg = format!("{msg} (template line {line})");
    }
    msg
}

fn common_prefix(a: &str, b: &str) -> usize {
    let n = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    floor_char_boundary(a, n)
}

fn common_suffix(a: &str, b: &str) -> usize {
    let n = a.bytes().rev().zip(b.bytes().rev()).take_while(|(x, y)| x == y).count();
    let mut start = a.len() - n;
    while !a.is_char_boundary(start) {
        start += 1;
    }
    a.len() - start
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// `tojson` as HuggingFace's chat templates get it: Python's `json.dumps(x, ensure_ascii=False, indent=indent)`
/// (`", "` and `": "` separators when compact), not minijinja's HTML-safe variant.
fn tojson(value: JValue, kwargs: minijinja::value::Kwargs) -> Result<JValue, JError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json: Value =
        serde_json::to_value(&value).map_err(|e| JError::new(ErrorKind::BadSerialization, e.to_string()))?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser =
                serde_json::Serializer::with_formatter(&mut out, serde_json::ser::PrettyFormatter::with_indent(&pad));
            serde::Serialize::serialize(&json, &mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonCompact);
            serde::Serialize::serialize(&json, &mut ser)
        }
    };
    written.map_err(|e| JError::new(ErrorKind::BadSerialization, e.to_string()))?;
    Ok(JValue::from_safe_string(String::from_utf8(out).expect("serde_json writes UTF-8")))
}

/// Python's default `json.dumps` separators: `", "` between items, `": "` after keys.
struct PythonCompact;

impl serde_json::ser::Formatter for PythonCompact {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_shapes_and_normalises_roles() {
        let a = Conversation::from_json_line(
            r#"{"id": 7, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}"#,
            3,
        )
        .unwrap();
        let b = Conversation::from_json_line(
            r#"{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}"#,
            3,
        )
        .unwrap();
        let c = Conversation::from_json_line(
            r#"{"id": "QWJhYvA_0", "conversations": [{"from": "human", "value": "hi"}]}"#,
            3,
        )
        .unwrap();
        assert_eq!(a.id, SampleId::Number(7));
        assert_eq!(b.id, SampleId::Number(3), "no id: the line number");
        assert_eq!(c.id, SampleId::Text("QWJhYvA_0".into()));
        assert_eq!(a.messages, b.messages);
        assert_eq!(a.assistant_turns(), vec![1]);
    }

    #[test]
    fn bad_lines_say_what_is_wrong() {
        let cases = [
            ("not json", "not valid JSON"),
            ("[1]", "JSON object"),
            (r#"{"messages": []}"#, "empty conversation"),
            (r#"{"messages": [{"role": "wizard", "content": "x"}]}"#, "unknown role \"wizard\""),
            (r#"{"conversations": [{"from": "alien", "value": "x"}]}"#, "unknown role \"alien\""),
            (r#"{"text": "x"}"#, "expected a `messages`"),
            (r#"{"id": -1, "messages": [{"role": "user", "content": "x"}]}"#, "`id`"),
            (r#"{"messages": [{"role": "human", "content": "x"}]}"#, "role \"human\" is ShareGPT's"),
            (r#"{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}"#, "a user message has no"),
            (r#"{"messages": [{"role": "system", "content": null}]}"#, "a system message has no `content`"),
        ];
        for (line, expected) in cases {
            let err = Conversation::from_json_line(line, 0).unwrap_err().to_string();
            assert!(err.contains(expected), "{line}: {err}");
        }
    }

    #[test]
    fn tojson_writes_what_python_writes() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}", Map::new(), &Map::new()).unwrap();
        let mut ctx = Map::new();
        ctx.insert("x".into(), json!({"b": [1, "é<>"], "a": {"k": null}}));
        let out = t.env.get_template("chat").unwrap().render(JValue::from_serialize(&ctx)).unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, \"é<>\"], \"a\": {\"k\": null}}|{\n  \"b\": [\n    1,\n    \"é<>\"\n  ],\n  \"a\": {\n    \"k\": null\n  }\n}"
        );
    }

    #[test]
    fn template_functions_exist() {
        let t = ChatTemplate::new("{{ raise_exception('bad turn') }}", Map::new(), &Map::new()).unwrap();
        let err = t.render(&[], None, false).unwrap_err().to_string();
        assert!(err.contains("bad turn"), "{err}");
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", Map::new(), &Map::new()).unwrap();
        assert_eq!(t.render(&[], None, false).unwrap().len(), 4);
    }
}

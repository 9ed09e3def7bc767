//! What a finished chat completion becomes in the recording: one JSON line that `prepare` reads as a conversation
//! (`messages`, the target's answer last), with what made it (`model`, the sampling settings, `finish_reason`,
//! whether it was streamed, when). Built from the request's body and the response's bytes as the client got them,
//! whole JSON or server-sent events.
use serde_json::{Map, Value, json};

/// Why an exchange is not recorded.
#[derive(Debug, Clone, PartialEq)]
pub enum NotRecorded {
    /// The request is not a chat completion the recording can use (no `messages`, several choices asked).
    NotAChat(&'static str),
    /// The response could not be read as a completion.
    Unreadable(String),
}

/// The recorded line for the request `request` (its JSON body) answered by `response` (the body the client got),
/// at `time` (RFC 3339).
pub fn record(request: &[u8], response: &[u8], time: &str) -> Result<Value, NotRecorded> {
    let request: Value =
        serde_json::from_slice(request).map_err(|_| NotRecorded::NotAChat("a body that is not JSON"))?;
    let Some(messages) = request.get("messages").and_then(Value::as_array) else {
        return Err(NotRecorded::NotAChat("no messages"));
    };
    if request.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return Err(NotRecorded::NotAChat("several choices asked (n > 1)"));
    }
    let streamed = request.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let (answer, finish_reason) = match streamed {
        true => from_events(response)?,
        false => from_json(response)?,
    };
    let mut conversation = messages.clone();
    conversation.push(answer);
    let settings: Map<String, Value> = request
        .as_object()
        .map(|o| o.iter().filter(|(k, _)| !matches!(k.as_str(), "messages" | "stream" | "stream_options")))
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok(json!({
        "messages": conversation,
        "recorded": {
            "time": time,
            "model": request.get("model").cloned().unwrap_or(Value::Null),
            "settings": settings,
            "finish_reason": finish_reason,
            "streamed": streamed,
        }
    }))
}

/// The first choice's message of a whole JSON completion.
fn from_json(body: &[u8]) -> Result<(Value, Value), NotRecorded> {
    let body: Value = serde_json::from_slice(body)
        .map_err(|e| NotRecorded::Unreadable(format!("a completion that is not JSON: {e}")))?;
    let choice = body.pointer("/choices/0").ok_or_else(|| NotRecorded::Unreadable("no choices".into()))?;
    let mut message = choice.get("message").cloned().ok_or_else(|| NotRecorded::Unreadable("no message".into()))?;
    if let Some(m) = message.as_object_mut() {
        m.entry("role").or_insert_with(|| json!("assistant"));
    }
    Ok((message, choice.get("finish_reason").cloned().unwrap_or(Value::Null)))
}

/// The first choice's message assembled from server-sent events (`data: {chunk}` lines, `data: [DONE]` last): its
/// content deltas joined, and its tool-call deltas joined by index. A stream without `[DONE]` was cut short.
fn from_events(body: &[u8]) -> Result<(Value, Value), NotRecorded> {
    let text = std::str::from_utf8(body).map_err(|_| NotRecorded::Unreadable("events that are not UTF-8".into()))?;
    let (mut content, mut reasoning, mut finish_reason, mut done) = (String::new(), String::new(), Value::Null, false);
    let mut tool_calls: Vec<Value> = Vec::new();
    for data in text.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim) {
        if data == "[DONE]" {
            done = true;
            break;
        }
        let chunk: Value = serde_json::from_str(data)
            .map_err(|e| NotRecorded::Unreadable(format!("an event that is not JSON: {e}")))?;
        let Some(choice) = chunk.pointer("/choices/0") else { continue };
        let delta = choice.get("delta").cloned().unwrap_or(Value::Null);
        content.push_str(delta.get("content").and_then(Value::as_str).unwrap_or(""));
        reasoning.push_str(delta.get("reasoning_content").and_then(Value::as_str).unwrap_or(""));
        for call in delta.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
            merge_tool_call(&mut tool_calls, call);
        }
        if let Some(reason) = choice.get("finish_reason").filter(|r| !r.is_null()) {
            finish_reason = reason.clone();
        }
    }
    if !done {
        return Err(NotRecorded::Unreadable("the stream ended before [DONE]".into()));
    }
    let mut message = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        message["reasoning_content"] = json!(reasoning);
    }
    if !tool_calls.is_empty() {
        message["tool_calls"] = json!(tool_calls);
    }
    Ok((message, finish_reason))
}

/// Adds a streamed tool-call delta to the calls so far: a new index starts a call, the same index appends to its
/// function's arguments.
fn merge_tool_call(calls: &mut Vec<Value>, delta: &Value) {
    let index = delta.get("index").and_then(Value::as_u64).unwrap_or(calls.len() as u64) as usize;
    while calls.len() <= index {
        calls.push(json!({"type": "function", "function": {"name": "", "arguments": ""}}));
    }
    let call = &mut calls[index];
    if let Some(id) = delta.get("id") {
        call["id"] = id.clone();
    }
    for key in ["name", "arguments"] {
        if let Some(part) = delta.pointer(&format!("/function/{key}")).and_then(Value::as_str) {
            let so_far = call["function"][key].as_str().unwrap_or("").to_string();
            call["function"][key] = json!(so_far + part);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REQUEST: &str =
        r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 8}"#;

    #[test]
    fn a_whole_completion_is_the_conversation_with_its_answer_and_settings() {
        let response = r#"{"choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}]}"#;
        let line = record(REQUEST.as_bytes(), response.as_bytes(), "t").unwrap();
        assert_eq!(
            line["messages"],
            json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
        );
        assert_eq!(line["recorded"]["settings"], json!({"model": "m", "temperature": 0, "max_tokens": 8}));
        assert_eq!(
            (&line["recorded"]["finish_reason"], &line["recorded"]["streamed"]),
            (&json!("stop"), &json!(false))
        );
    }

    #[test]
    fn streamed_events_are_joined_into_one_answer() {
        let request = REQUEST.replace("\"max_tokens\": 8", "\"max_tokens\": 8, \"stream\": true");
        let events = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hel\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"length\"}]}\n\n",
            "data: [DONE]\n\n"
        );
        let line = record(request.as_bytes(), events.as_bytes(), "t").unwrap();
        assert_eq!(line["messages"][1], json!({"role": "assistant", "content": "hello"}));
        assert_eq!(
            (&line["recorded"]["finish_reason"], &line["recorded"]["streamed"]),
            (&json!("length"), &json!(true))
        );
        let cut = events.replace("data: [DONE]\n\n", "");
        assert!(matches!(record(request.as_bytes(), cut.as_bytes(), "t"), Err(NotRecorded::Unreadable(_))));
    }

    #[test]
    fn streamed_tool_calls_are_assembled_by_index() {
        let request = REQUEST.replace("\"max_tokens\": 8", "\"stream\": true");
        let events = concat!(
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c1\",\"function\":{\"name\":\"get\",\"arguments\":\"{\\\"a\"}}]}}]}\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\\\":1}\"}}]}}]}\n",
            "data: [DONE]\n"
        );
        let line = record(request.as_bytes(), events.as_bytes(), "t").unwrap();
        assert_eq!(line["messages"][1]["tool_calls"][0]["function"], json!({"name": "get", "arguments": "{\"a\":1}"}));
        assert_eq!(line["messages"][1]["tool_calls"][0]["id"], "c1");
    }

    #[test]
    fn what_cannot_be_a_conversation_is_not_recorded() {
        assert_eq!(record(b"not json", b"{}", "t"), Err(NotRecorded::NotAChat("a body that is not JSON")));
        assert_eq!(record(br#"{"prompt": "x"}"#, b"{}", "t"), Err(NotRecorded::NotAChat("no messages")));
        let several = REQUEST.replace("\"max_tokens\": 8", "\"n\": 2");
        assert!(matches!(record(several.as_bytes(), b"{}", "t"), Err(NotRecorded::NotAChat(_))));
        assert!(matches!(record(REQUEST.as_bytes(), b"{\"error\": 1}", "t"), Err(NotRecorded::Unreadable(_))));
    }
}

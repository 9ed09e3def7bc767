//! Loss masks token by token for the real Qwen3 and Llama-3.1 chat templates, on model folders the tests create
//! (byte-level BPE `tokenizer.json` with merges and the models' special tokens, `tokenizer_config.json` with the
//! template).
use std::path::Path;

use dflash::data::chat::{ChatTemplate, Conversation};
use dflash::data::sample::{Sample, build_sample};
use dflash::data::tokenize::{TextTokenizer, byte_level_tokenizer};
use serde_json::{Map, Value, json};

const MERGES: [(&str, &str); 6] = [("t", "h"), ("th", "e"), ("i", "n"), ("a", "n"), ("e", "r"), ("l", "l")];
const QWEN_SPECIALS: [&str; 9] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
];
const LLAMA_SPECIALS: [&str; 7] = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
];

fn model_dir(dir: &Path, template: &str, specials: &[&str], bos: &str, eos: &str) {
    byte_level_tokenizer(&MERGES, specials).unwrap().save(dir.join("tokenizer.json"), false).unwrap();
    let config = json!({ "chat_template": template, "bos_token": bos, "eos_token": eos, "model_max_length": 4096 });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

struct Model {
    _dir: tempfile::TempDir,
    template: ChatTemplate,
    tokenizer: TextTokenizer,
}

fn qwen3(kwargs: Value) -> Model {
    let dir = tempfile::tempdir().unwrap();
    model_dir(dir.path(), include_str!("../src/data/qwen3_chat_template.jinja"), &QWEN_SPECIALS, "", "<|im_end|>");
    let kwargs: Map<String, Value> = serde_json::from_value(kwargs).unwrap();
    Model {
        template: ChatTemplate::from_dir(dir.path(), &kwargs).unwrap(),
        tokenizer: TextTokenizer::from_dir(dir.path()).unwrap(),
        _dir: dir,
    }
}

fn llama31() -> Model {
    let dir = tempfile::tempdir().unwrap();
    let t = include_str!("fixtures/templates/llama3.1.jinja");
    model_dir(dir.path(), t, &LLAMA_SPECIALS, "<|begin_of_text|>", "<|eot_id|>");
    Model {
        template: ChatTemplate::from_dir(dir.path(), &Map::new()).unwrap(),
        tokenizer: TextTokenizer::from_dir(dir.path()).unwrap(),
        _dir: dir,
    }
}

fn conversation(v: Value) -> Conversation {
    Conversation::from_json_line(&v.to_string(), 0).unwrap()
}

/// The supervised tokens, decoded run by run, after checking every token is one of two kinds.
fn runs(m: &Model, s: &Sample) -> Vec<String> {
    assert_eq!(s.input_ids.len(), s.loss_mask.len());
    let mut out = Vec::new();
    let mut current: Vec<u32> = Vec::new();
    for (&id, &mask) in s.input_ids.iter().zip(&s.loss_mask) {
        assert!(mask <= 1);
        if mask == 1 {
            current.push(id);
        } else if !current.is_empty() {
            out.push(m.tokenizer.decode(&std::mem::take(&mut current)).unwrap());
        }
    }
    if !current.is_empty() {
        out.push(m.tokenizer.decode(&current).unwrap());
    }
    out
}

#[test]
fn qwen3_supervises_answers_and_end_markers_only() {
    let m = qwen3(json!({}));
    let conv = conversation(json!({"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"}
    ]}));
    let full = m.template.render(&conv.messages, None, false).unwrap();
    assert_eq!(
        full,
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n\
         <|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n\
         <|im_start|>assistant\n<think>\n\n</think>\n\n6<|im_end|>\n",
        "reasoning before the last user message is dropped; the last turn gets an empty think block"
    );
    let s = build_sample(&m.template, &m.tokenizer, &conv).unwrap();
    // Not the role headers, not the newline after <|im_end|>, not the template's empty think block.
    assert_eq!(runs(&m, &s), vec!["4<|im_end|>", "6<|im_end|>"]);
    assert_eq!(m.tokenizer.decode(&s.input_ids).unwrap(), full);
}

#[test]
fn qwen3_supervises_the_reasoning_the_model_wrote() {
    let m = qwen3(json!({}));
    let conv = conversation(json!({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello there!"}
    ]}));
    let s = build_sample(&m.template, &m.tokenizer, &conv).unwrap();
    assert_eq!(runs(&m, &s), vec!["Greet back.\n</think>\n\nHello there!<|im_end|>"]);
    // The same with the reasoning in its own field.
    let conv = conversation(json!({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there!", "reasoning_content": "Greet back."}
    ]}));
    let s = build_sample(&m.template, &m.tokenizer, &conv).unwrap();
    assert_eq!(runs(&m, &s), vec!["Greet back.\n</think>\n\nHello there!<|im_end|>"]);
}

#[test]
fn qwen3_tool_calls_are_supervised_and_tool_results_are_not() {
    let m = qwen3(json!({"enable_thinking": false}));
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let conv = conversation(json!({"tools": tools, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C"},
        {"role": "assistant", "content": "It is 18C."}
    ]}));
    let full = m.template.render(&conv.messages, conv.tools.as_ref(), false).unwrap();
    assert!(full.contains(
        "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather now\", \
         \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}}\n</tools>"
    ), "tojson writes Python's json.dumps: {full}");
    assert!(full.contains("<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n"));
    let s = build_sample(&m.template, &m.tokenizer, &conv).unwrap();
    assert_eq!(
        runs(&m, &s),
        vec![
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>",
            "It is 18C.<|im_end|>"
        ]
    );
}

#[test]
fn llama31_supervises_trimmed_answers_and_eot() {
    let m = llama31();
    let conv = conversation(json!({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "  Hello there. "},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye."}
    ]}));
    let full = m.template.render(&conv.messages, None, false).unwrap();
    assert_eq!(
        full,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\
         Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nHello there.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nGoodbye.<|eot_id|>"
    );
    let s = build_sample(&m.template, &m.tokenizer, &conv).unwrap();
    assert_eq!(runs(&m, &s), vec!["Hello there.<|eot_id|>", "Goodbye.<|eot_id|>"]);
    assert_eq!(s.input_ids[0], m.tokenizer.token_id("<|begin_of_text|>").unwrap(), "BOS comes from the template");
}

#[test]
fn llama31_tool_call_turns_are_found_without_content() {
    let m = llama31();
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let conv = conversation(json!({"tools": tools, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C"},
        {"role": "assistant", "content": "It is 18C."}
    ]}));
    let s = build_sample(&m.template, &m.tokenizer, &conv).unwrap();
    assert_eq!(
        runs(&m, &s),
        vec!["{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}<|eot_id|>", "It is 18C.<|eot_id|>"]
    );
}

#[test]
fn conversations_the_template_cannot_take_are_errors() {
    let m = qwen3(json!({}));
    let no_assistant = conversation(json!({"messages": [{"role": "user", "content": "Hi"}]}));
    let err = build_sample(&m.template, &m.tokenizer, &no_assistant).unwrap_err().to_string();
    assert!(err.contains("no assistant turn"), "{err}");
    let l = llama31();
    let two_calls = conversation(json!({"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": {}}},
                                             {"function": {"name": "b", "arguments": {}}}]}
    ]}));
    let err = build_sample(&l.template, &l.tokenizer, &two_calls).unwrap_err().to_string();
    assert!(err.contains("template failed") && err.contains("single tool-calls"), "{err}");
}

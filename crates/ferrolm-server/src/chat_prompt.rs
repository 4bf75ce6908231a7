//! A conversation to prompt tokens: messages are checked and normalised (content given as a list
//! of text parts becomes one string, a tool call's `arguments` JSON text becomes the object it
//! holds), rendered with the model's chat template, and tokenized without adding special tokens
//! again (the template already wrote them).
//!
//! NOTE: as vLLM does, each assistant tool call's `function.arguments` is parsed into an object
//! before rendering: templates such as Llama 3.1's write it with `tojson`, which would quote
//! the text a second time.

use ferrolm_tokenizer::{ChatTemplate, RenderOptions, Tokenizer};
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::limits::encode_within;

#[derive(Debug, Default, Clone, Copy)]
pub struct ChatPromptOptions<'a> {
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub tools: Option<&'a Value>,
    pub chat_template_kwargs: Option<&'a Map<String, Value>>,
}

/// Renders `messages` with the model's chat template and returns the prompt text.
pub fn render(tokenizer: &Tokenizer, messages: &[Value], options: ChatPromptOptions<'_>) -> Result<String, ApiError> {
    let template = tokenizer.chat_template().ok_or_else(|| {
        ApiError::invalid(
            "this model has no chat template (none in tokenizer_config.json or chat_template.jinja); \
             use /v1/completions with a prompt instead",
            None,
        )
    })?;
    render_with(template, messages, options)
}

/// Renders `messages` with `template`.
pub fn render_with(
    template: &ChatTemplate,
    messages: &[Value],
    options: ChatPromptOptions<'_>,
) -> Result<String, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages must not be empty", Some("messages")));
    }
    let messages = messages.iter().enumerate().map(|(i, m)| normalize(i, m)).collect::<Result<Vec<_>, _>>()?;
    let continue_final = options.continue_final_message.unwrap_or(false);
    if continue_final && options.add_generation_prompt == Some(true) {
        return Err(ApiError::invalid(
            "continue_final_message and add_generation_prompt cannot both be true",
            Some("continue_final_message"),
        ));
    }
    let render_options = RenderOptions {
        add_generation_prompt: !continue_final && options.add_generation_prompt.unwrap_or(true),
        tools: options.tools,
        documents: None,
        extra_context: options.chat_template_kwargs,
    };
    let rendered = template.render_with(&messages, &render_options)?;
    if !continue_final {
        return Ok(rendered);
    }
    // End the prompt right after the final message's text, dropping the template's end of turn.
    let last = messages.last().and_then(|m| m.get("content")).and_then(Value::as_str).unwrap_or_default();
    let cut = [last, last.trim_end()]
        .iter()
        .find_map(|needle| rendered.rfind(needle).map(|at| at + needle.len()))
        .ok_or_else(|| {
            ApiError::invalid(
                "continue_final_message is set but the final message does not appear in the rendered chat",
                Some("continue_final_message"),
            )
        })?;
    Ok(rendered[..cut].to_string())
}

/// A chat request's conversation and template options, owned, to be rendered on the tokenizer
/// threads.
#[derive(Debug, Default)]
pub struct Conversation {
    pub messages: Vec<Value>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub tools: Option<Value>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

/// A rendered conversation: its text and its token ids.
#[derive(Debug)]
pub struct Prompt {
    pub text: String,
    pub ids: Vec<u32>,
}

impl Conversation {
    /// Renders and tokenizes; a rendered text too long for the context by its bytes alone is
    /// refused before tokenizing.
    pub fn prompt(&self, tokenizer: &Tokenizer, max_model_len: usize) -> Result<Prompt, ApiError> {
        let options = ChatPromptOptions {
            add_generation_prompt: self.add_generation_prompt,
            continue_final_message: self.continue_final_message,
            tools: self.tools.as_ref(),
            chat_template_kwargs: self.chat_template_kwargs.as_ref(),
        };
        let text = render(tokenizer, &self.messages, options)?;
        let ids = encode_within(tokenizer, &text, false, max_model_len, "messages")?;
        Ok(Prompt { text, ids })
    }
}

/// Roles a message may have: OpenAI's, `function` of its older API, and `ipython`, which Llama 3
/// templates give tool results.
const ROLES: [&str; 7] = ["system", "developer", "user", "assistant", "tool", "function", "ipython"];

/// A message as the template expects it: an object with one of OpenAI's roles, and `content` a
/// string (text parts joined with newlines, as vLLM does for string-content templates). Only an
/// assistant message may leave `content` out or null (it may carry only `tool_calls`).
fn normalize(i: usize, message: &Value) -> Result<Value, ApiError> {
    let param = |field: &str| format!("messages[{i}].{field}");
    let Value::Object(fields) = message else {
        return Err(ApiError::invalid(format!("messages[{i}] must be an object"), Some(&format!("messages[{i}]"))));
    };
    let Some(role) = fields.get("role").and_then(Value::as_str) else {
        return Err(ApiError::invalid(format!("{} must be a string", param("role")), Some(&param("role"))));
    };
    if !ROLES.contains(&role) {
        return Err(ApiError::invalid(
            format!("{} must be one of {}, got {role:?}", param("role"), ROLES.join(", ")),
            Some(&param("role")),
        ));
    }
    let mut out = fields.clone();
    let content = match fields.get("content") {
        None | Some(Value::Null) if role != "assistant" => {
            return Err(ApiError::invalid(
                format!("{} is required for a {role} message", param("content")),
                Some(&param("content")),
            ))
        }
        None | Some(Value::Null) if fields.contains_key("tool_calls") => Value::Null,
        None | Some(Value::Null) => Value::String(String::new()),
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(text)) => texts.push(text),
                    (Some("text"), None) => {
                        let p = format!("{}[{j}].text", param("content"));
                        return Err(ApiError::invalid(format!("{p} must be a string"), Some(&p)));
                    }
                    _ => {
                        let p = format!("{}[{j}]", param("content"));
                        return Err(ApiError::invalid(
                            format!("{p}: only content parts of type \"text\" are supported"),
                            Some(&p),
                        ));
                    }
                }
            }
            Value::String(texts.join("\n"))
        }
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{} must be a string or a list of text parts", param("content")),
                Some(&param("content")),
            ))
        }
    };
    out.insert("content".into(), content);
    if let Some(calls) = fields.get("tool_calls") {
        out.insert("tool_calls".into(), tool_calls(i, calls)?);
    }
    Ok(Value::Object(out))
}

/// An assistant message's `tool_calls`, each call's `function.arguments` parsed from JSON text
/// into the object it holds (empty text is `{}`; an object is kept as it is).
fn tool_calls(i: usize, calls: &Value) -> Result<Value, ApiError> {
    let param = format!("messages[{i}].tool_calls");
    let Value::Array(calls) = calls else {
        return Err(ApiError::invalid(format!("{param} must be a list of tool calls"), Some(&param)));
    };
    let mut out = Vec::with_capacity(calls.len());
    for (j, call) in calls.iter().enumerate() {
        let param = format!("{param}[{j}]");
        let mut call = match call {
            Value::Object(call) => call.clone(),
            _ => return Err(ApiError::invalid(format!("{param} must be an object"), Some(&param))),
        };
        let Some(Value::Object(function)) = call.get_mut("function") else {
            let param = format!("{param}.function");
            return Err(ApiError::invalid(format!("{param} must be an object with a name"), Some(&param)));
        };
        if !function.get("name").is_some_and(Value::is_string) {
            let param = format!("{param}.function.name");
            return Err(ApiError::invalid(format!("{param} must be a string"), Some(&param)));
        }
        if let Some(Value::String(text)) = function.get("arguments") {
            let parsed = match text.trim() {
                "" => Value::Object(Map::new()),
                text => serde_json::from_str(text).map_err(|e| {
                    let param = format!("{param}.function.arguments");
                    ApiError::invalid(format!("{param} must be JSON text: {e}"), Some(&param))
                })?,
            };
            function.insert("arguments".into(), parsed);
        }
        out.push(Value::Object(call));
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_parts_become_one_string() -> Result<(), ApiError> {
        let m = normalize(
            0,
            &json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
        )?;
        assert_eq!(m, json!({"role": "user", "content": "a\nb"}));
        let m = normalize(0, &json!({"role": "assistant", "tool_calls": []}))?;
        assert_eq!(m["content"], Value::Null);
        Ok(())
    }

    #[test]
    fn tool_call_arguments_become_objects() -> Result<(), ApiError> {
        let call = |arguments: Value| {
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
            ]})
        };
        let m = normalize(0, &call(json!("{\"b\": 1, \"a\": [2.5, \"x\"]}")))?;
        let arguments = &m["tool_calls"][0]["function"]["arguments"];
        assert_eq!(arguments, &json!({"b": 1, "a": [2.5, "x"]}));
        assert_eq!(serde_json::to_string(arguments).ok().as_deref(), Some(r#"{"b":1,"a":[2.5,"x"]}"#));
        assert_eq!(m["tool_calls"][0]["id"], "call_1");
        assert_eq!(normalize(0, &call(json!("")))?["tool_calls"][0]["function"]["arguments"], json!({}));
        assert_eq!(normalize(0, &call(json!({"k": 1})))?["tool_calls"][0]["function"]["arguments"], json!({"k": 1}));
        let tool = json!({"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "ok"}]});
        assert_eq!(normalize(1, &tool)?, json!({"role": "tool", "tool_call_id": "call_1", "content": "ok"}));
        Ok(())
    }

    #[test]
    fn malformed_tool_calls_name_the_field() {
        let cases = [
            (json!({"role": "assistant", "tool_calls": {}}), "messages[2].tool_calls"),
            (json!({"role": "assistant", "tool_calls": [1]}), "messages[2].tool_calls[0]"),
            (json!({"role": "assistant", "tool_calls": [{"id": "x"}]}), "messages[2].tool_calls[0].function"),
            (
                json!({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}),
                "messages[2].tool_calls[0].function.name",
            ),
            (
                json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}),
                "messages[2].tool_calls[0].function.arguments",
            ),
        ];
        for (message, want) in cases {
            match normalize(2, &message) {
                Err(ApiError::InvalidRequest { param, .. }) => assert_eq!(param.as_deref(), Some(want)),
                other => panic!("{message}: {other:?}"),
            }
        }
    }

    #[test]
    fn malformed_messages_name_the_field() {
        let cases = [
            (json!("hi"), "messages[3]"),
            (json!({"content": "x"}), "messages[3].role"),
            (json!({"role": "user", "content": 5}), "messages[3].content"),
            (json!({"role": "user", "content": [{"type": "image_url"}]}), "messages[3].content[0]"),
            (json!({"role": "user", "content": [{"type": "text"}]}), "messages[3].content[0].text"),
            (json!({"role": "hacker", "content": "x"}), "messages[3].role"),
            (json!({"role": "user", "content": null}), "messages[3].content"),
            (json!({"role": "system"}), "messages[3].content"),
        ];
        for (message, want) in cases {
            match normalize(3, &message) {
                Err(ApiError::InvalidRequest { param, .. }) => assert_eq!(param.as_deref(), Some(want)),
                other => panic!("{message}: {other:?}"),
            }
        }
    }
}

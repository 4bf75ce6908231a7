//! Chat templates: the Jinja program shipped with a model that turns a list of messages into
//! the prompt text, rendered with minijinja configured to behave as HF's Jinja2 environment.
//!
//! What HF's `apply_chat_template` sets up, and ferrolm mirrors:
//! - `trim_blocks` and `lstrip_blocks` on, trailing newline of the template dropped;
//! - globals `raise_exception(msg)` (fails the render with `msg`) and `strftime_now(fmt)`;
//! - `tojson` is Python's `json.dumps` (keys in insertion order, `", "` separators, no HTML
//!   escaping) and `{{ value }}` prints Python's `str()` (`None`, `True`);
//! - Python string and dict methods (`.strip()`, `.startswith()`, `.items()`) work;
//! - the context holds `messages`, `add_generation_prompt`, `tools`, `documents` (both
//!   `None` when not given, so `tools is not none` is the test that works), the special
//!   token strings (`bos_token`, `eos_token`, ...) and any extra variables of the request.

use std::collections::BTreeMap;

use minijinja::value::{Kwargs, Serde, ValueKind};
use minijinja::{escape_formatter, AutoEscape, Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::config::SpecialTokens;
use crate::error::{Result, TokenizerError};
use crate::pyfmt::{json_dumps, python_str, DumpOptions};
use crate::strftime::strftime_now;

const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation in its plain form. Messages with tool calls or content
/// parts can be passed to [`ChatTemplate::render`] as `serde_json::Value`s instead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// Everything besides the messages that a render takes.
#[derive(Debug, Clone, Copy, Default)]
pub struct RenderOptions<'a> {
    /// End the prompt with the header of an assistant turn.
    pub add_generation_prompt: bool,
    /// JSON schemas of the tools the model may call (a list), as the client sent them.
    pub tools: Option<&'a serde_json::Value>,
    /// Documents for retrieval-augmented templates (a list).
    pub documents: Option<&'a serde_json::Value>,
    /// More top-level variables (a request's `chat_template_kwargs`, e.g. `enable_thinking`).
    /// They cannot replace `messages`, `add_generation_prompt`, `tools` or `documents`.
    pub extra_context: Option<&'a serde_json::Map<String, serde_json::Value>>,
}

/// Marks an error as raised by the template itself through `raise_exception`.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct RaisedException(String);

/// A compiled chat template. Cheap to share: rendering takes `&self`.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    special_tokens: SpecialTokens,
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is reported here rather than at the first render.
    pub fn new(source: &str, special_tokens: SpecialTokens) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TokenizerError::ChatTemplateSyntax(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, state, value| match python_str(value) {
            Some(text) => out.write_str(&text).map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string())),
            None => escape_formatter(out, state, value),
        });
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| TokenizerError::ChatTemplateSyntax(describe(&e, false)))?;
        Ok(ChatTemplate { env, source: source.to_string(), special_tokens })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` (anything that serializes to a list of message objects:
    /// [`ChatMessage`]s or `serde_json::Value`s).
    pub fn render<M: Serialize>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String> {
        self.render_with(messages, &RenderOptions { add_generation_prompt, tools, ..Default::default() })
    }

    /// Renders `messages` with every option spelled out.
    pub fn render_with<M: Serialize>(&self, messages: &[M], options: &RenderOptions<'_>) -> Result<String> {
        let mut context: BTreeMap<String, Value> = BTreeMap::new();
        let special = [
            ("bos_token", &self.special_tokens.bos_token),
            ("eos_token", &self.special_tokens.eos_token),
            ("pad_token", &self.special_tokens.pad_token),
            ("unk_token", &self.special_tokens.unk_token),
        ];
        for (name, token) in special {
            if let Some(token) = token {
                context.insert(name.to_string(), Value::from(token.as_str()));
            }
        }
        if let Some(extra) = options.extra_context {
            for (name, value) in extra {
                context.insert(name.clone(), Value::from(Serde(value)));
            }
        }
        context.insert("messages".to_string(), Value::from(Serde(messages)));
        context.insert("add_generation_prompt".to_string(), Value::from(options.add_generation_prompt));
        context.insert("tools".to_string(), optional_json(options.tools));
        context.insert("documents".to_string(), optional_json(options.documents));

        let template =
            self.env.get_template(TEMPLATE_NAME).map_err(|e| TokenizerError::ChatTemplateRender(describe(&e, true)))?;
        template.render(context).map_err(render_error)
    }
}

fn optional_json(value: Option<&serde_json::Value>) -> Value {
    match value {
        Some(v) => Value::from(Serde(v)),
        None => Value::from(()),
    }
}

/// Splits failures the template raised on purpose (usually a bad conversation from the
/// client) from other render failures (usually a template minijinja cannot run).
fn render_error(err: Error) -> TokenizerError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = cause {
        if let Some(raised) = e.downcast_ref::<RaisedException>() {
            return TokenizerError::ChatTemplateRaised(raised.0.clone());
        }
        cause = e.source();
    }
    TokenizerError::ChatTemplateRender(describe(&err, true))
}

/// minijinja's message with the line, without the internal template name.
fn describe(err: &Error, with_kind: bool) -> String {
    let mut text = match (err.detail(), with_kind) {
        (Some(detail), true) => format!("{}: {detail}", err.kind()),
        (Some(detail), false) => detail.to_string(),
        (None, _) => err.kind().to_string(),
    };
    if let Some(line) = err.line() {
        text.push_str(&format!(" at line {line}"));
    }
    text
}

fn raise_exception(message: Value) -> std::result::Result<Value, Error> {
    let message = match message.as_str() {
        Some(s) => s.to_string(),
        None => message.to_string(),
    };
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedException(message)))
}

/// HF's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, Error> {
    let ensure_ascii = kwargs.get::<Option<Value>>("ensure_ascii")?.or(ensure_ascii);
    let indent = kwargs.get::<Option<Value>>("indent")?.or(indent);
    let separators = kwargs.get::<Option<Value>>("separators")?;
    let sort_keys = kwargs.get::<Option<Value>>("sort_keys")?;
    kwargs.assert_all_used()?;

    // Python: an int indents by that many spaces (negative counts as 0), a string is the unit.
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
            ValueKind::Number => Some(" ".repeat(v.as_i64().unwrap_or(0).clamp(0, 64) as usize)),
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int or a string")),
        },
    };
    let mut options = DumpOptions::new(indent);
    options.ensure_ascii = ensure_ascii.is_some_and(|v| v.is_true());
    options.sort_keys = sort_keys.is_some_and(|v| v.is_true());
    if let Some(separators) = separators.filter(|v| !v.is_none()) {
        let parts: Vec<Value> = separators.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] => {
                options.item_separator = item.as_str().unwrap_or_default().to_string();
                options.key_separator = key.as_str().unwrap_or_default().to_string();
            }
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair of strings")),
        }
    }
    json_dumps(value, &options).map(Value::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> Result<ChatTemplate> {
        ChatTemplate::new(
            source,
            SpecialTokens { bos_token: Some("<s>".into()), eos_token: Some("</s>".into()), ..Default::default() },
        )
    }

    fn conversation() -> Vec<ChatMessage> {
        vec![ChatMessage::new("system", "  Be brief.  "), ChatMessage::new("user", "Hi")]
    }

    #[test]
    fn python_string_methods_work() -> Result<()> {
        let t = template(
            "{% for m in messages %}{% if m.role.startswith('sys') %}[{{ m.content.strip() }}]\
             {% else %}{{ m.content.upper() }}|{{ 'a,b'.split(',')|join('+') }}{% endif %}{% endfor %}",
        )?;
        assert_eq!(t.render(&conversation(), false, None)?, "[Be brief.]HI|a+b");
        Ok(())
    }

    #[test]
    fn raise_exception_carries_the_message() -> Result<()> {
        let t = template(
            "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok",
        )?;
        let result = t.render(&conversation(), false, None);
        assert!(
            matches!(&result, Err(TokenizerError::ChatTemplateRaised(msg)) if msg == "Conversation must start with user"),
            "{result:?}"
        );
        Ok(())
    }

    #[test]
    fn tojson_keeps_insertion_order_and_python_separators() -> Result<()> {
        let t = template("{{ tools|tojson }}|{{ {'b': 1, 'a': [1, 2]}|tojson }}|{{ messages[1]|tojson(indent=2) }}")?;
        let tools =
            serde_json::json!([{"type": "function", "function": {"name": "get", "parameters": {"z": 1, "a": "<&>"}}}]);
        let out = t.render(&conversation(), false, Some(&tools))?;
        assert_eq!(
            out,
            "[{\"type\": \"function\", \"function\": {\"name\": \"get\", \"parameters\": {\"z\": 1, \"a\": \"<&>\"}}}]\
             |{\"b\": 1, \"a\": [1, 2]}|{\n  \"role\": \"user\",\n  \"content\": \"Hi\"\n}"
        );
        Ok(())
    }

    #[test]
    fn context_matches_hf() -> Result<()> {
        let t = template(
            "{{ bos_token }}{{ tools is defined }} {{ tools is none }} {{ documents is none }} \
             {{ add_generation_prompt }} {{ enable_thinking }} {{ none }} {{ [1, 'x'] }}{{ eos_token }}",
        )?;
        let extra = serde_json::json!({"enable_thinking": false});
        let options = RenderOptions { extra_context: extra.as_object(), ..Default::default() };
        assert_eq!(t.render_with(&conversation(), &options)?, "<s>True True True False False None [1, 'x']</s>");
        Ok(())
    }

    #[test]
    fn trim_and_lstrip_blocks_as_hf() -> Result<()> {
        // With trim_blocks the newline after a block tag goes; with lstrip_blocks the
        // indentation before it goes; the template's single trailing newline goes too.
        let t = template(
            "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}\n",
        )?;
        assert_eq!(t.render(&conversation(), false, None)?, "Hi\n");
        Ok(())
    }

    #[test]
    fn strftime_now_is_available() -> Result<()> {
        let t = template("{{ strftime_now('%Y')|length }}")?;
        assert_eq!(t.render(&conversation(), false, None)?, "4");
        Ok(())
    }

    #[test]
    fn syntax_error_is_reported_at_compile_time() {
        let result = template("{% for m in messages %}{{ m.content }}");
        assert!(
            matches!(&result, Err(TokenizerError::ChatTemplateSyntax(msg)) if msg.contains("unexpected end of input")),
            "{result:?}"
        );
    }

    #[test]
    fn unknown_function_is_a_render_error() -> Result<()> {
        let t = template("{{ no_such_function() }}")?;
        let result = t.render(&conversation(), false, None);
        assert!(
            matches!(&result, Err(TokenizerError::ChatTemplateRender(msg)) if msg.contains("no_such_function")),
            "{result:?}"
        );
        Ok(())
    }
}

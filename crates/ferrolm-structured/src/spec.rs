//! `StructuredOutput`: what a request's output must match, and its llguidance grammar.

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Value};

/// A request's constraint on its output.
#[derive(Clone, Debug, PartialEq)]
pub enum StructuredOutput {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid for this schema.
    JsonSchema(Value),
    /// Text the regex matches in full.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text of this Lark grammar (llguidance's dialect).
    Grammar(String),
}

impl StructuredOutput {
    /// What the cache of compiled grammars tells constraints apart by.
    pub(crate) fn key(&self) -> String {
        match self {
            StructuredOutput::JsonObject => "object".into(),
            StructuredOutput::JsonSchema(schema) => format!("schema:{schema}"),
            StructuredOutput::Regex(rx) => format!("regex:{rx}"),
            StructuredOutput::Choice(choices) => format!("choice:{}", Value::from(choices.clone())),
            StructuredOutput::Grammar(lark) => format!("lark:{lark}"),
        }
    }

    pub(crate) fn grammar(&self) -> TopLevelGrammar {
        match self {
            StructuredOutput::JsonObject => TopLevelGrammar::from_json_schema(with_options(json!({"type": "object"}))),
            StructuredOutput::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_options(schema.clone())),
            StructuredOutput::Regex(rx) => TopLevelGrammar::from_regex(rx),
            StructuredOutput::Choice(choices) => TopLevelGrammar::from_lark(choice_grammar(choices)),
            StructuredOutput::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

/// `schema` with ferrolm's JSON layout (llguidance's `x-guidance` options) unless it has its
/// own: `", "` and `": "` between items and keys and no other whitespace, as `json.dumps` writes,
/// so that a model cannot wander into endless whitespace; `oneOf` read as `anyOf` (Pydantic
/// writes `oneOf` for unions whose branches rarely overlap).
fn with_options(mut schema: Value) -> Value {
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| {
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": true})
        });
    }
    schema
}

/// A Lark grammar whose only texts are `choices`: JSON string literals are Lark string literals.
fn choice_grammar(choices: &[String]) -> String {
    let alternatives: Vec<String> = choices.iter().map(|c| Value::from(c.as_str()).to_string()).collect();
    format!("start: {}", alternatives.join(" | "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_are_quoted_lark_literals() {
        let lark = choice_grammar(&["a".into(), "say \"hi\"\n".into()]);
        assert_eq!(lark, r#"start: "a" | "say \"hi\"\n""#);
    }

    #[test]
    fn keys_tell_kinds_apart() {
        let regex = StructuredOutput::Regex("a".into());
        let lark = StructuredOutput::Grammar("a".into());
        assert_ne!(regex.key(), lark.key());
        assert_eq!(StructuredOutput::JsonSchema(serde_json::json!({"a": 1})).key(), "schema:{\"a\":1}");
    }
}

//! Structured output at the API edge: OpenAI's `response_format` and vLLM's
//! `structured_outputs` read into one [`StructuredOutput`], compiled on the tokenizer threads
//! against the model's vocabulary before anything runs.
//!
//! - `response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}`,
//!   `{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}`.
//! - `structured_outputs`: exactly one of `json` (a schema, or its JSON text), `regex`, `choice`
//!   (strings), `grammar` (Lark), `json_object: true`.
//!
//! A request may give one of the two. Whatever cannot be compiled (a schema feature llguidance
//! does not support, a bad regex) is a 400 naming the field; the grammar compiler is built on the
//! first constrained request, so servers that never see one pay nothing.

use std::sync::{Arc, OnceLock};

use ferrolm_structured::{Grammar, GrammarCompiler, StructuredError, StructuredOutput};
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::state::SharedState;

const RESPONSE_FORMAT: &str = "response_format";
const STRUCTURED_OUTPUTS: &str = "structured_outputs";

/// A request's constraint and the field it came from (which a 400 names).
#[derive(Clone, Debug, PartialEq)]
pub struct Requested {
    pub output: StructuredOutput,
    pub param: &'static str,
}

/// The grammar compiler of the served model, built once, on first use.
#[derive(Default)]
pub struct Grammars {
    compiler: OnceLock<Result<Arc<GrammarCompiler>, String>>,
}

/// The constraint of a request's `response_format` and `structured_outputs`, if any.
pub fn requested(
    response_format: Option<Value>,
    structured_outputs: Option<Value>,
) -> Result<Option<Requested>, ApiError> {
    let from_format = response_format.map(from_response_format).transpose()?.flatten();
    let from_outputs = structured_outputs.map(from_structured_outputs).transpose()?;
    match (from_format, from_outputs) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "give either response_format or structured_outputs, not both",
            Some(STRUCTURED_OUTPUTS),
        )),
        (Some(output), None) => Ok(Some(Requested { output, param: RESPONSE_FORMAT })),
        (None, Some(output)) => Ok(Some(Requested { output, param: STRUCTURED_OUTPUTS })),
        (None, None) => Ok(None),
    }
}

/// Compiles `requested` on the tokenizer threads; `None` for an unconstrained request.
pub async fn compile(state: &SharedState, requested: Option<Requested>) -> Result<Option<Grammar>, ApiError> {
    let Some(Requested { output, param }) = requested else { return Ok(None) };
    let shared = Arc::clone(state);
    let grammar = state
        .work
        .run(move || {
            let compiler = shared.grammars.compiler(&shared)?;
            compiler.compile(&output).map_err(|err| match err {
                StructuredError::Invalid(msg) => ApiError::invalid(format!("{param}: {msg}"), Some(param)),
                other => ApiError::invalid(other.to_string(), Some(param)),
            })
        })
        .await?;
    Ok(Some(grammar))
}

impl Grammars {
    fn compiler(&self, state: &SharedState) -> Result<Arc<GrammarCompiler>, ApiError> {
        let built = self.compiler.get_or_init(|| {
            let eos = &state.engine.config().eos_token_ids;
            GrammarCompiler::new(&state.tokenizer, eos).map(Arc::new).map_err(|e| e.to_string())
        });
        built.clone().map_err(|msg| ApiError::invalid(msg, None))
    }
}

fn from_response_format(format: Value) -> Result<Option<StructuredOutput>, ApiError> {
    let bad = |msg: &str| ApiError::invalid(format!("response_format: {msg}"), Some(RESPONSE_FORMAT));
    let Value::Object(mut format) = format else { return Err(bad("must be an object")) };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(StructuredOutput::JsonObject)),
        Some("json_schema") => {
            let Some(Value::Object(mut spec)) = format.remove("json_schema") else {
                return Err(bad("type json_schema needs a json_schema object with a schema"));
            };
            match spec.remove("schema") {
                Some(schema @ Value::Object(_)) => Ok(Some(StructuredOutput::JsonSchema(schema))),
                Some(_) => Err(bad("json_schema.schema must be an object")),
                None => Err(bad("json_schema.schema is required")),
            }
        }
        Some(other) => Err(bad(&format!("unknown type {other:?} (text, json_object or json_schema)"))),
        None => Err(bad("needs a type")),
    }
}

fn from_structured_outputs(outputs: Value) -> Result<StructuredOutput, ApiError> {
    let bad = |msg: String| ApiError::invalid(format!("structured_outputs: {msg}"), Some(STRUCTURED_OUTPUTS));
    let Value::Object(outputs) = outputs else { return Err(bad("must be an object".into())) };
    let given: Vec<(&String, &Value)> = outputs.iter().filter(|(_, v)| !v.is_null()).collect();
    let [(key, value)] = given.as_slice() else {
        return Err(bad(format!(
            "give exactly one of json, regex, choice, grammar, json_object (got {})",
            keys(&outputs)
        )));
    };
    let text = |what: &str| value.as_str().map(str::to_string).ok_or_else(|| bad(format!("{what} must be a string")));
    match key.as_str() {
        "json" => match value {
            Value::Object(_) => Ok(StructuredOutput::JsonSchema((*value).clone())),
            Value::String(s) => match serde_json::from_str(s) {
                Ok(schema @ Value::Object(_)) => Ok(StructuredOutput::JsonSchema(schema)),
                _ => Err(bad("json must be a schema object or its JSON text".into())),
            },
            _ => Err(bad("json must be a schema object or its JSON text".into())),
        },
        "regex" => Ok(StructuredOutput::Regex(text("regex")?)),
        "grammar" => Ok(StructuredOutput::Grammar(text("grammar")?)),
        "choice" => {
            let choices: Option<Vec<String>> =
                value.as_array().and_then(|a| a.iter().map(|c| c.as_str().map(str::to_string)).collect());
            match choices {
                Some(choices) if !choices.is_empty() && choices.iter().all(|c| !c.is_empty()) => {
                    Ok(StructuredOutput::Choice(choices))
                }
                _ => Err(bad("choice must be a non-empty list of non-empty strings".into())),
            }
        }
        "json_object" if **value == Value::Bool(true) => Ok(StructuredOutput::JsonObject),
        "json_object" => Err(bad("json_object must be true".into())),
        other => Err(bad(format!("{other} is not supported (json, regex, choice, grammar, json_object)"))),
    }
}

fn keys(map: &Map<String, Value>) -> String {
    let keys: Vec<&str> = map.keys().map(String::as_str).collect();
    if keys.is_empty() {
        "none".into()
    } else {
        keys.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn output(format: Option<Value>, outputs: Option<Value>) -> Result<Option<StructuredOutput>, ApiError> {
        requested(format, outputs).map(|r| r.map(|r| r.output))
    }

    fn param_of(err: ApiError) -> Option<String> {
        match err {
            ApiError::InvalidRequest { param, .. } => param,
            other => panic!("not a 400: {other:?}"),
        }
    }

    #[test]
    fn response_formats_read_as_openai_defines_them() -> Result<(), ApiError> {
        assert_eq!(output(Some(json!({"type": "text"})), None)?, None);
        assert_eq!(output(Some(json!({"type": "json_object"})), None)?, Some(StructuredOutput::JsonObject));
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let format = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}});
        assert_eq!(output(Some(format), None)?, Some(StructuredOutput::JsonSchema(schema)));
        for bad in [json!("json"), json!({"type": "yaml"}), json!({"type": "json_schema"}), json!({})] {
            let err = output(Some(bad.clone()), None).expect_err(&bad.to_string());
            assert_eq!(param_of(err).as_deref(), Some("response_format"), "{bad}");
        }
        Ok(())
    }

    #[test]
    fn structured_outputs_take_exactly_one_kind() -> Result<(), ApiError> {
        let schema = json!({"type": "object"});
        assert_eq!(output(None, Some(json!({"json": schema})))?, Some(StructuredOutput::JsonSchema(schema.clone())));
        assert_eq!(
            output(None, Some(json!({"json": schema.to_string()})))?,
            Some(StructuredOutput::JsonSchema(schema)),
            "a schema as JSON text"
        );
        assert_eq!(output(None, Some(json!({"regex": "a+"})))?, Some(StructuredOutput::Regex("a+".into())));
        assert_eq!(
            output(None, Some(json!({"choice": ["x", "y"], "regex": null})))?,
            Some(StructuredOutput::Choice(vec!["x".into(), "y".into()]))
        );
        assert_eq!(
            output(None, Some(json!({"grammar": "start: \"a\""})))?,
            Some(StructuredOutput::Grammar("start: \"a\"".into()))
        );
        assert_eq!(output(None, Some(json!({"json_object": true})))?, Some(StructuredOutput::JsonObject));
        for bad in [
            json!({}),
            json!({"regex": "a", "choice": ["a"]}),
            json!({"choice": []}),
            json!({"choice": ["a", 3]}),
            json!({"regex": 5}),
            json!({"structural_tag": "x"}),
            json!({"json_object": false}),
            json!({"json": "not json"}),
        ] {
            let err = output(None, Some(bad.clone())).expect_err(&bad.to_string());
            assert_eq!(param_of(err).as_deref(), Some("structured_outputs"), "{bad}");
        }
        Ok(())
    }

    #[test]
    fn both_fields_at_once_are_refused() {
        let err = output(Some(json!({"type": "json_object"})), Some(json!({"regex": "a"}))).expect_err("both");
        assert_eq!(param_of(err).as_deref(), Some("structured_outputs"));
        assert_eq!(
            output(Some(json!({"type": "text"})), Some(json!({"regex": "a"}))).ok().flatten(),
            Some(StructuredOutput::Regex("a".into()))
        );
    }
}

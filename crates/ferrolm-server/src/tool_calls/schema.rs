//! The JSON schema a reply is decoded under so that it always parses, for the `tool_choice`s
//! that demand a call (as vLLM builds it):
//! - `required`: an array of at least one (at most one without parallel tool calls)
//!   `{"name": <one tool's name>, "parameters": <that tool's parameters>}`, any of the tools;
//!   the tools' `$defs` are gathered at the top, where their `$ref`s point. Unlike vLLM's, an
//!   item may hold no other keys: JSON schema allows them by default, and a call with them
//!   would not parse;
//! - a named function: that function's parameters (the whole reply is its arguments).

use serde_json::{json, Map, Value};

use super::request::{Tool, ToolChoice};
use crate::error::ApiError;

/// The schema for `choice`; `None` when the reply is free (`none`, `auto`). Fails when two tools
/// define the same `$defs` name differently.
pub fn tool_choice_schema(
    tools: &[Tool],
    choice: &ToolChoice,
    parallel_tool_calls: bool,
) -> Result<Option<Value>, ApiError> {
    match choice {
        ToolChoice::None | ToolChoice::Auto => Ok(None),
        ToolChoice::Named(name) => {
            Ok(Some(tools.iter().find(|t| &t.name == name).map_or_else(empty_object, |t| parameters(t, true))))
        }
        ToolChoice::Required => required_schema(tools, parallel_tool_calls).map(Some),
    }
}

fn empty_object() -> Value {
    json!({"type": "object", "properties": {}})
}

/// A tool's parameters schema, with or without its `$defs`.
fn parameters(tool: &Tool, with_defs: bool) -> Value {
    match &tool.parameters {
        Some(schema) if !schema.is_empty() => {
            let mut schema = schema.clone();
            if !with_defs {
                schema.remove("$defs");
            }
            Value::Object(schema)
        }
        _ => empty_object(),
    }
}

fn required_schema(tools: &[Tool], parallel_tool_calls: bool) -> Result<Value, ApiError> {
    let any_of: Vec<Value> = tools
        .iter()
        .map(|tool| {
            json!({
                "properties": {
                    "name": {"type": "string", "enum": [tool.name]},
                    "parameters": parameters(tool, false),
                },
                "required": ["name", "parameters"],
                "additionalProperties": false,
            })
        })
        .collect();
    let mut schema = json!({"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": any_of}});
    if !parallel_tool_calls {
        schema["maxItems"] = json!(1);
    }
    let defs = gathered_defs(tools)?;
    if !defs.is_empty() {
        schema["$defs"] = Value::Object(defs);
    }
    Ok(schema)
}

/// Every tool's `$defs`, in one map.
fn gathered_defs(tools: &[Tool]) -> Result<Map<String, Value>, ApiError> {
    let mut all = Map::new();
    for tool in tools {
        let Some(Value::Object(defs)) = tool.parameters.as_ref().and_then(|p| p.get("$defs")) else { continue };
        for (name, schema) in defs {
            match all.get(name) {
                Some(known) if known != schema => {
                    return Err(ApiError::invalid(
                        format!(
                            "tools define \"$defs\" {name:?} more than once, differently: tool_choice \"required\" \
                             needs one definition per name"
                        ),
                        Some("tools"),
                    ))
                }
                _ => {
                    all.insert(name.clone(), schema.clone());
                }
            }
        }
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, parameters: Value) -> Tool {
        Tool { name: name.into(), parameters: parameters.as_object().cloned() }
    }

    fn tools() -> Vec<Tool> {
        vec![
            tool(
                "get_weather",
                json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
            ),
            Tool { name: "now".into(), parameters: None },
        ]
    }

    #[test]
    fn free_choices_have_no_schema() -> Result<(), ApiError> {
        assert_eq!(tool_choice_schema(&tools(), &ToolChoice::None, true)?, None);
        assert_eq!(tool_choice_schema(&tools(), &ToolChoice::Auto, false)?, None);
        Ok(())
    }

    #[test]
    fn a_named_function_is_decoded_as_its_parameters() -> Result<(), ApiError> {
        let schema = tool_choice_schema(&tools(), &ToolChoice::Named("get_weather".into()), true)?;
        assert_eq!(schema, Some(Value::Object(tools()[0].parameters.clone().unwrap_or_default())));
        let schema = tool_choice_schema(&tools(), &ToolChoice::Named("now".into()), true)?;
        assert_eq!(schema, Some(json!({"type": "object", "properties": {}})));
        Ok(())
    }

    #[test]
    fn required_is_an_array_of_any_tool() -> Result<(), ApiError> {
        let want = json!({
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": false,
                },
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["now"]},
                        "parameters": {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": false,
                },
            ]},
        });
        assert_eq!(tool_choice_schema(&tools(), &ToolChoice::Required, true)?, Some(want.clone()));
        let mut single = want;
        single["maxItems"] = json!(1);
        assert_eq!(tool_choice_schema(&tools(), &ToolChoice::Required, false)?, Some(single));
        Ok(())
    }

    #[test]
    fn defs_are_gathered_at_the_top() -> Result<(), ApiError> {
        let place = json!({"type": "object", "properties": {"lat": {"type": "number"}}});
        let a = tool(
            "a",
            json!({"type": "object", "properties": {"p": {"$ref": "#/$defs/Place"}}, "$defs": {"Place": place}}),
        );
        let b = tool(
            "b",
            json!({"type": "object", "properties": {"q": {"$ref": "#/$defs/Place"}}, "$defs": {"Place": place}}),
        );
        let schema = tool_choice_schema(&[a.clone(), b], &ToolChoice::Required, true)?.unwrap_or_default();
        assert_eq!(schema["$defs"], json!({"Place": place}));
        assert_eq!(schema["items"]["anyOf"][0]["properties"]["parameters"].get("$defs"), None);
        // A named function keeps its own definitions.
        let named = tool_choice_schema(&[a], &ToolChoice::Named("a".into()), true)?.unwrap_or_default();
        assert_eq!(named["$defs"], json!({"Place": place}));
        let c = tool("c", json!({"type": "object", "$defs": {"Place": {"type": "string"}}}));
        let d = tool("d", json!({"type": "object", "$defs": {"Place": {"type": "number"}}}));
        assert!(tool_choice_schema(&[c, d], &ToolChoice::Required, true).is_err());
        Ok(())
    }
}

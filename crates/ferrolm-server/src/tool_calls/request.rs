//! A chat request's `tools` and `tool_choice`, checked: every mistake is a 400 that names the
//! field it is in.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// A function the client offers (`{"type": "function", "function": {...}}`).
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    /// The JSON schema of its arguments, when given.
    pub parameters: Option<Map<String, Value>>,
}

/// Whether and how the model must call a tool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No tool calls: the reply is text.
    None,
    /// The model chooses; calls it writes are parsed out of the reply.
    Auto,
    /// At least one call, decoded under a schema.
    Required,
    /// A call of this function, decoded under its parameters' schema.
    Named(String),
}

const TOOLS_SHAPE: &str =
    r#"a list of {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}"#;

fn invalid(param: &str, message: impl std::fmt::Display) -> ApiError {
    ApiError::invalid(format!("{param} {message}"), Some(param))
}

/// The functions of `tools` (none when it is absent or null).
pub fn parse_tools(tools: Option<&Value>) -> Result<Vec<Tool>, ApiError> {
    let items = match tools {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid("tools", format_args!("must be {TOOLS_SHAPE}"))),
    };
    let mut out: Vec<Tool> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let tool = parse_tool(i, item)?;
        if let Some(j) = out.iter().position(|t| t.name == tool.name) {
            let param = format!("tools[{i}].function.name");
            return Err(invalid(&param, format_args!("{:?} is already the name of tools[{j}]", tool.name)));
        }
        out.push(tool);
    }
    Ok(out)
}

fn parse_tool(i: usize, item: &Value) -> Result<Tool, ApiError> {
    let at = |field: &str| format!("tools[{i}]{field}");
    let Value::Object(fields) = item else {
        return Err(invalid(&at(""), format_args!("must be an object: tools must be {TOOLS_SHAPE}")));
    };
    if fields.get("type").and_then(Value::as_str) != Some("function") {
        return Err(invalid(&at(".type"), "must be \"function\""));
    }
    let Some(Value::Object(function)) = fields.get("function") else {
        return Err(invalid(&at(".function"), "must be an object with the function's name"));
    };
    let name = match function.get("name") {
        Some(Value::String(name)) if !name.is_empty() => name.clone(),
        _ => return Err(invalid(&at(".function.name"), "must be a non-empty string")),
    };
    match function.get("description") {
        None | Some(Value::Null | Value::String(_)) => {}
        Some(_) => return Err(invalid(&at(".function.description"), "must be a string")),
    }
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => None,
        Some(Value::Object(schema)) => Some(schema.clone()),
        Some(_) => return Err(invalid(&at(".function.parameters"), "must be a JSON schema object")),
    };
    Ok(Tool { name, parameters })
}

/// `tool_choice`: absent, it is `auto` with tools and `none` without.
pub fn parse_tool_choice(choice: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let choice = match choice {
        None | Some(Value::Null) if tools.is_empty() => ToolChoice::None,
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(invalid(
                    "tool_choice",
                    format_args!("must be \"none\", \"auto\", \"required\" or a named function, got {other:?}"),
                ))
            }
        },
        Some(Value::Object(fields)) => ToolChoice::Named(named_function(fields)?),
        Some(other) => {
            return Err(invalid("tool_choice", format_args!("must be a string or a named function, got {other}")))
        }
    };
    match &choice {
        ToolChoice::Required if tools.is_empty() => {
            Err(invalid("tool_choice", "\"required\" needs tools to choose from: give a non-empty tools list"))
        }
        ToolChoice::Named(name) if !tools.iter().any(|t| &t.name == name) => {
            let known: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
            Err(invalid(
                "tool_choice",
                format_args!("names the function {name:?}, which is not in tools ({})", known.join(", ")),
            ))
        }
        _ => Ok(choice),
    }
}

/// `{"type": "function", "function": {"name": ...}}`.
fn named_function(fields: &Map<String, Value>) -> Result<String, ApiError> {
    const SHAPE: &str = r#"{"type": "function", "function": {"name": ...}}"#;
    if fields.get("type").and_then(Value::as_str) != Some("function") {
        return Err(invalid("tool_choice", format_args!("must be \"none\", \"auto\", \"required\" or {SHAPE}")));
    }
    match fields.get("function").and_then(|f| f.get("name")) {
        Some(Value::String(name)) => Ok(name.clone()),
        _ => Err(invalid("tool_choice", format_args!("must name its function as {SHAPE}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param(err: ApiError) -> Option<String> {
        match err {
            ApiError::InvalidRequest { param, .. } => param,
            other => panic!("{other:?}"),
        }
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}})
    }

    #[test]
    fn tools_are_read() -> Result<(), ApiError> {
        let tools = parse_tools(Some(&json!([weather(), {"type": "function", "function": {"name": "now"}}])))?;
        assert_eq!(tools.len(), 2);
        assert_eq!(tools[0].parameters, json!({"type": "object"}).as_object().cloned());
        assert_eq!((tools[1].name.as_str(), &tools[1].parameters), ("now", &None));
        assert_eq!(parse_tools(None)?, []);
        Ok(())
    }

    #[test]
    fn bad_tools_name_the_field() {
        let cases = [
            (json!({"name": "f"}), "tools"),
            (json!(["f"]), "tools[0]"),
            (json!([{"type": "code", "function": {"name": "f"}}]), "tools[0].type"),
            (json!([weather(), {"type": "function"}]), "tools[1].function"),
            (json!([{"type": "function", "function": {"name": ""}}]), "tools[0].function.name"),
            (
                json!([{"type": "function", "function": {"name": "f", "description": 1}}]),
                "tools[0].function.description",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
                "tools[0].function.parameters",
            ),
            (json!([weather(), weather()]), "tools[1].function.name"),
        ];
        for (tools, want) in cases {
            let err = parse_tools(Some(&tools)).expect_err("invalid");
            assert_eq!(param(err).as_deref(), Some(want), "{tools}");
        }
    }

    #[test]
    fn tool_choice_defaults_and_forms() -> Result<(), ApiError> {
        let tools = parse_tools(Some(&json!([weather()])))?;
        assert_eq!(parse_tool_choice(None, &tools)?, ToolChoice::Auto);
        assert_eq!(parse_tool_choice(None, &[])?, ToolChoice::None);
        assert_eq!(parse_tool_choice(Some(&json!("none")), &tools)?, ToolChoice::None);
        assert_eq!(parse_tool_choice(Some(&json!("required")), &tools)?, ToolChoice::Required);
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        assert_eq!(parse_tool_choice(Some(&named), &tools)?, ToolChoice::Named("get_weather".into()));
        Ok(())
    }

    #[test]
    fn bad_tool_choices_name_tool_choice() -> Result<(), ApiError> {
        let tools = parse_tools(Some(&json!([weather()])))?;
        for (choice, tools) in [
            (json!("always"), &tools[..]),
            (json!(3), &tools[..]),
            (json!({"type": "function", "function": {"name": "get_time"}}), &tools[..]),
            (json!({"type": "function"}), &tools[..]),
            (json!({"function": {"name": "get_weather"}}), &tools[..]),
            (json!("required"), &[][..]),
        ] {
            let err = parse_tool_choice(Some(&choice), tools).expect_err("invalid");
            assert_eq!(param(err).as_deref(), Some("tool_choice"), "{choice}");
        }
        Ok(())
    }
}

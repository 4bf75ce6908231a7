//! Python-compatible text forms of template values, so that ferrolm renders chat templates
//! byte for byte as HF's Jinja2 does.
//!
//! Two forms matter: `json.dumps` (HF replaces Jinja2's `tojson` with it: `", "` and `": "`
//! separators, no HTML escaping, `ensure_ascii=False`, keys in insertion order) and `str()`
//! (what `{{ value }}` prints: `None`, `True`, `['a', 1]`, `1e+16`).

use std::fmt::Write as _;

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Value};

/// The keyword arguments of Python's `json.dumps` that HF's `tojson` forwards.
#[derive(Debug, Clone)]
pub(crate) struct DumpOptions {
    pub ensure_ascii: bool,
    /// `None` writes everything on one line; `Some(unit)` puts each item on its own line,
    /// indented by `unit` per level.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl DumpOptions {
    /// Python's defaults for a given `indent`: `", "` between items on one line, `","`
    /// (then a newline) when indenting.
    pub fn new(indent: Option<String>) -> Self {
        let item_separator = if indent.is_some() { "," } else { ", " };
        DumpOptions {
            ensure_ascii: false,
            indent,
            item_separator: item_separator.to_string(),
            key_separator: ": ".to_string(),
            sort_keys: false,
        }
    }
}

/// `json.dumps(value, **options)`.
pub(crate) fn json_dumps(value: &Value, options: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_json(&mut out, value, options, 0)?;
    Ok(out)
}

fn write_json(out: &mut String, value: &Value, opts: &DumpOptions, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number_repr(value)),
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_json_container(out, ('[', ']'), &items, opts, depth, |out, item, depth| {
                write_json(out, item, opts, depth)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_json_container(out, ('{', '}'), &entries, opts, depth, |out, (key, item), depth| {
                write_json_string(out, key, opts.ensure_ascii);
                out.push_str(&opts.key_separator);
                write_json(out, item, opts, depth)
            })?;
        }
        ValueKind::Undefined => {
            return Err(Error::new(ErrorKind::InvalidOperation, "tojson: undefined is not JSON serializable"))
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of kind {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

fn write_json_container<T>(
    out: &mut String,
    (open, close): (char, char),
    items: &[T],
    opts: &DumpOptions,
    depth: usize,
    mut write_item: impl FnMut(&mut String, &T, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&opts.item_separator);
        }
        if let Some(unit) = &opts.indent {
            out.push('\n');
            out.push_str(&unit.repeat(depth + 1));
        }
        write_item(out, item, depth + 1)?;
    }
    if let Some(unit) = &opts.indent {
        out.push('\n');
        out.push_str(&unit.repeat(depth));
    }
    out.push(close);
    Ok(())
}

/// Python converts non-string keys with `str()`-like rules (`true`, `null`, `1`, `1.5`).
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::None => Ok("null".to_string()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::Number => Ok(number_repr(key)),
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `str(value)`: what Jinja2 prints for `{{ value }}`. `None` for values printed as they
/// are (strings, undefined), which the caller hands to minijinja's own formatter.
pub(crate) fn python_str(value: &Value) -> Option<String> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
            let mut out = String::new();
            write_repr(&mut out, value);
            Some(out)
        }
        _ => None,
    }
}

/// `repr(value)` for the JSON-like values templates handle.
fn write_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&number_repr(value)),
        ValueKind::String => write_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Undefined => out.push_str("Undefined"),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &item);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &key);
                out.push_str(": ");
                write_repr(out, &value.get_item(&key).unwrap_or_default());
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
}

/// Python's `repr(str)`: single quotes unless the text holds a `'` and no `"`.
/// Non-printable characters are approximated as control characters and whitespace other
/// than the plain space.
fn write_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_control() || (c.is_whitespace() && c != ' ') => {
                let code = c as u32;
                let _ = match code {
                    0..=0xff => write!(out, "\\x{code:02x}"),
                    0x100..=0xffff => write!(out, "\\u{code:04x}"),
                    _ => write!(out, "\\U{code:08x}"),
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

fn number_repr(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    match f64::try_from(value.clone()) {
        Ok(f) => python_float_repr(f),
        Err(_) => value.to_string(),
    }
}

/// Python's `repr(float)` (also what `json.dumps` writes): the shortest digits that round
/// trip, positional notation for exponents in [-4, 16), otherwise `1.5e+16`, `1e-05`.
pub(crate) fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".to_string();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    let sign = if x.is_sign_negative() { "-" } else { "" };
    // Rust's `{:e}` gives the shortest round-trip digits, e.g. "1.2345e2", "0e0".
    let sci = format!("{:e}", x.abs());
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let body = if (-4..16).contains(&exponent) {
        let int_len = exponent + 1;
        if int_len <= 0 {
            format!("0.{}{digits}", "0".repeat(int_len.unsigned_abs() as usize))
        } else {
            let int_len = int_len as usize;
            if int_len >= digits.len() {
                format!("{digits}{}.0", "0".repeat(int_len - digits.len()))
            } else {
                format!("{}.{}", &digits[..int_len], &digits[int_len..])
            }
        }
    } else {
        let mantissa = if digits.len() == 1 { digits } else { format!("{}.{}", &digits[..1], &digits[1..]) };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{exp_sign}{:02}", exponent.unsigned_abs())
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::value::Serde;

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1.5, "1.5"),
            (123.456, "123.456"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (1e100, "1e+100"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (x, want) in cases {
            assert_eq!(python_float_repr(x), want, "{x}");
        }
    }

    #[test]
    fn dumps_uses_python_separators_and_keeps_order() -> Result<(), Error> {
        let value = Value::from(Serde(serde_json::json!({
            "z": [1, 2.5, null, true],
            "a": {"<tag>": "é\n\"q\""},
        })));
        let compact = json_dumps(&value, &DumpOptions::new(None))?;
        assert_eq!(compact, r#"{"z": [1, 2.5, null, true], "a": {"<tag>": "é\n\"q\""}}"#);
        let indented = json_dumps(&value, &DumpOptions::new(Some("  ".to_string())))?;
        let want = "{\n  \"z\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"a\": {\n    \"<tag>\": \"é\\n\\\"q\\\"\"\n  }\n}";
        assert_eq!(indented, want);
        let ascii = DumpOptions { ensure_ascii: true, sort_keys: true, ..DumpOptions::new(None) };
        let sorted = json_dumps(&value, &ascii)?;
        assert_eq!(sorted, r#"{"a": {"<tag>": "\u00e9\n\"q\""}, "z": [1, 2.5, null, true]}"#);
        Ok(())
    }

    #[test]
    fn str_matches_python() {
        let value = Value::from(Serde(serde_json::json!([null, true, 1, 0.5, "it's", "a'b\"c", {"k": "v"}])));
        let printed = python_str(&value).unwrap_or_default();
        assert_eq!(printed, r#"[None, True, 1, 0.5, "it's", 'a\'b"c', {'k': 'v'}]"#);
        assert_eq!(python_str(&Value::from("plain")), None);
    }
}

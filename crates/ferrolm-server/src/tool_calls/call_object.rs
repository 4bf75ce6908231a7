//! One call written as a JSON object (`{"name": "f", "arguments": {...}}`), read member by
//! member so that the name is known, and the arguments can be sent, before the object closes;
//! and a JSON array of such objects.
//!
//! Which keys a format allows is its [`CallKeys`]: any other key, a name that is not a non-empty
//! string, arguments that are not an object, or a key given twice makes the call invalid.

use super::json_scan::{self, scan_string, skip_ws, Scan, Stop};
use super::{Block, BlockEnd};

/// A call as far as the text goes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallSpan {
    /// Known once its string is complete.
    pub name: Option<String>,
    /// The byte where the arguments object begins, once it has begun.
    pub args_start: Option<usize>,
    /// The byte after the arguments object, once it closed.
    pub args_end: Option<usize>,
    /// The whole call was read and is well formed.
    pub complete: bool,
}

impl CallSpan {
    /// The arguments text so far; `{}` for a complete call that has none.
    pub fn arguments<'t>(&self, text: &'t str) -> &'t str {
        match self.args_start {
            Some(start) => &text[start..self.args_end.unwrap_or(text.len())],
            None if self.complete => "{}",
            None => "",
        }
    }
}

/// The keys of a format's call objects.
#[derive(Debug)]
pub struct CallKeys {
    /// Keys that hold the arguments (one of them at most per call).
    pub arguments: &'static [&'static str],
    /// Keys allowed and not used (`"type": "function"`, a call id).
    pub ignored: &'static [&'static str],
}

enum Key {
    Name,
    Arguments,
    Ignored,
}

/// Reads the call object that starts at `start`.
pub fn scan_call(text: &str, start: usize, keys: &CallKeys) -> (CallSpan, BlockEnd) {
    let mut call = CallSpan::default();
    let end = match read_call(text, start, keys, &mut call) {
        Ok(end) => {
            call.complete = true;
            BlockEnd::Complete(end)
        }
        Err(Stop::Partial) => BlockEnd::Partial,
        Err(Stop::Invalid(at)) => BlockEnd::Invalid(at),
    };
    (call, end)
}

fn read_call(text: &str, start: usize, keys: &CallKeys, call: &mut CallSpan) -> Result<usize, Stop> {
    let b = text.as_bytes();
    expect(b, start, b'{')?;
    let mut i = skip_ws(text, start + 1);
    if b.get(i) == Some(&b'}') {
        return Err(Stop::Invalid(i));
    }
    loop {
        let key_at = i;
        expect(b, i, b'"')?;
        let key_end = scan_string(b, i)?;
        let key: String = serde_json::from_str(&text[i..key_end]).map_err(|_| Stop::Invalid(i))?;
        i = skip_ws(text, key_end);
        expect(b, i, b':')?;
        i = skip_ws(text, i + 1);
        let value_end = match classify(&key, keys) {
            Some(Key::Name) if call.name.is_none() => {
                expect(b, i, b'"')?;
                let end = scan_string(b, i)?;
                let name: String = serde_json::from_str(&text[i..end]).map_err(|_| Stop::Invalid(i))?;
                if name.is_empty() {
                    return Err(Stop::Invalid(i));
                }
                call.name = Some(name);
                end
            }
            Some(Key::Arguments) if call.args_start.is_none() => {
                expect(b, i, b'{')?;
                call.args_start = Some(i);
                let end = complete(json_scan::value(text, i))?;
                call.args_end = Some(end);
                end
            }
            Some(Key::Ignored) => complete(json_scan::value(text, i))?,
            _ => return Err(Stop::Invalid(key_at)),
        };
        i = skip_ws(text, value_end);
        match b.get(i) {
            None => return Err(Stop::Partial),
            Some(b',') => i = skip_ws(text, i + 1),
            Some(b'}') if call.name.is_some() => return Ok(i + 1),
            Some(_) => return Err(Stop::Invalid(i)),
        }
    }
}

fn classify(key: &str, keys: &CallKeys) -> Option<Key> {
    if key == "name" {
        Some(Key::Name)
    } else if keys.arguments.contains(&key) {
        Some(Key::Arguments)
    } else if keys.ignored.contains(&key) {
        Some(Key::Ignored)
    } else {
        None
    }
}

fn expect(b: &[u8], i: usize, byte: u8) -> Result<(), Stop> {
    match b.get(i) {
        None => Err(Stop::Partial),
        Some(&c) if c == byte => Ok(()),
        Some(_) => Err(Stop::Invalid(i)),
    }
}

fn complete(scan: Scan) -> Result<usize, Stop> {
    match scan {
        Scan::Complete(end) => Ok(end),
        Scan::Partial => Err(Stop::Partial),
        Scan::Invalid(at) => Err(Stop::Invalid(at)),
    }
}

/// Reads a JSON array of call objects starting at the `[` at `start`. Once the text is final
/// (`at_end`), an array whose calls are complete but whose `]` never came is accepted.
pub fn scan_call_array(text: &str, start: usize, keys: &CallKeys, at_end: bool) -> Block {
    let b = text.as_bytes();
    let mut calls = Vec::new();
    let mut i = skip_ws(text, start + 1);
    loop {
        let (call, end) = scan_call(text, i, keys);
        calls.push(call);
        let after = match end {
            BlockEnd::Complete(after) => after,
            BlockEnd::Partial if at_end => return Block { calls, end: BlockEnd::Invalid(text.len()) },
            other => return Block { calls, end: other },
        };
        let j = skip_ws(text, after);
        let end = match b.get(j) {
            Some(b',') => {
                i = skip_ws(text, j + 1);
                continue;
            }
            Some(b']') => BlockEnd::Complete(j + 1),
            None if at_end => BlockEnd::Complete(text.len()),
            None => BlockEnd::Partial,
            Some(_) => BlockEnd::Invalid(j),
        };
        return Block { calls, end };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEYS: CallKeys = CallKeys { arguments: &["arguments"], ignored: &["type"] };

    #[test]
    fn a_call_is_read_as_far_as_the_text_goes() {
        let text = r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#;
        let (name_end, args_at) = (text.find(", ").expect("comma"), text.find("{\"city").expect("args"));
        for cut in 0..=text.len() {
            let (call, end) = scan_call(&text[..cut], 0, &KEYS);
            assert_eq!(end, if cut == text.len() { BlockEnd::Complete(cut) } else { BlockEnd::Partial });
            assert_eq!(call.name.is_some(), cut >= name_end, "cut {cut}");
            assert_eq!(call.args_start.is_some(), cut > args_at, "cut {cut}");
            assert!(r#"{"city": "Paris"}"#.starts_with(call.arguments(&text[..cut])));
        }
    }

    #[test]
    fn arguments_may_come_first_and_may_be_absent() {
        let text = r#"{"arguments": {"a": [1, {"b": 2}]}, "type": "function", "name": "f"}"#;
        let (call, end) = scan_call(text, 0, &KEYS);
        assert_eq!(end, BlockEnd::Complete(text.len()));
        assert_eq!((call.name.as_deref(), call.arguments(text)), (Some("f"), r#"{"a": [1, {"b": 2}]}"#));
        let (call, _) = scan_call(r#"{"name": "now"}"#, 0, &KEYS);
        assert!(call.complete);
        assert_eq!(call.arguments(""), "{}");
    }

    #[test]
    fn shapes_that_are_not_calls_are_invalid() {
        for bad in [
            r#"{"name": "f", "city": "Paris"}"#,
            r#"{"name": 3, "arguments": {}}"#,
            r#"{"name": "", "arguments": {}}"#,
            r#"{"name": "f", "arguments": "{}"}"#,
            r#"{"name": "f", "name": "g"}"#,
            r#"{"arguments": {}}"#,
            r#"{}"#,
            r#"{"name": "f", "arguments": {"a": 1,}}"#,
            r#"["name"]"#,
        ] {
            assert!(matches!(scan_call(bad, 0, &KEYS).1, BlockEnd::Invalid(_)), "{bad}");
        }
    }

    #[test]
    fn arrays_hold_several_calls() {
        let text = r#"[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}] tail"#;
        let block = scan_call_array(text, 0, &KEYS, false);
        assert_eq!(block.end, BlockEnd::Complete(text.len() - 5));
        let names: Vec<_> = block.calls.iter().map(|c| c.name.as_deref()).collect();
        assert_eq!(names, [Some("a"), Some("b")]);
        let cut = &text[..text.len() - 6];
        assert_eq!(scan_call_array(cut, 0, &KEYS, false).end, BlockEnd::Partial);
        assert_eq!(scan_call_array(cut, 0, &KEYS, true).end, BlockEnd::Complete(cut.len()));
    }
}

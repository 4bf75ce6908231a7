//! A JSON reader for text that may stop anywhere: a model's output read while it is being
//! generated. It says of a value whether it is complete (and where it ends), may still become
//! valid with more text (`Partial`), or can never be valid (`Invalid`, with the byte where that
//! became certain).
//!
//! Invariant: the answer for a prefix never contradicts the answer for a longer text. A value
//! `Complete` at `end` in a prefix is `Complete` at the same `end` in every extension; an
//! `Invalid` prefix stays `Invalid` at the same byte. (A number at the very end of the text is
//! `Partial`, since more digits may follow.)
//!
//! Nesting deeper than [`MAX_DEPTH`] is `Invalid`: a model's output must not overflow the stack.

/// Deepest nesting of arrays and objects accepted.
pub const MAX_DEPTH: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    /// A whole value ends right before this byte.
    Complete(usize),
    /// The text ends inside the value.
    Partial,
    /// Not JSON, whatever follows; certain from this byte on.
    Invalid(usize),
}

/// Why a scan stopped short of a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    Partial,
    Invalid(usize),
}

impl From<Stop> for Scan {
    fn from(stop: Stop) -> Scan {
        match stop {
            Stop::Partial => Scan::Partial,
            Stop::Invalid(at) => Scan::Invalid(at),
        }
    }
}

/// Scans the value that starts at `start` (no leading whitespace skipped).
pub fn value(text: &str, start: usize) -> Scan {
    match scan_value(text.as_bytes(), start, 0) {
        Ok(end) => Scan::Complete(end),
        Err(stop) => stop.into(),
    }
}

/// The first byte at or after `at` that is not JSON whitespace.
pub fn skip_ws(text: &str, at: usize) -> usize {
    let bytes = text.as_bytes();
    let mut i = at;
    while i < bytes.len() && matches!(bytes[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// Scans a string token starting at the `"` at `start`; returns the byte after its closing quote.
pub fn scan_string(b: &[u8], start: usize) -> Result<usize, Stop> {
    let mut i = start + 1;
    loop {
        let Some(&c) = b.get(i) else { return Err(Stop::Partial) };
        match c {
            b'"' => return Ok(i + 1),
            b'\\' => {
                let Some(&e) = b.get(i + 1) else { return Err(Stop::Partial) };
                match e {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => i += 2,
                    b'u' => {
                        for k in 0..4 {
                            match b.get(i + 2 + k) {
                                None => return Err(Stop::Partial),
                                Some(h) if h.is_ascii_hexdigit() => {}
                                Some(_) => return Err(Stop::Invalid(i + 2 + k)),
                            }
                        }
                        i += 6;
                    }
                    _ => return Err(Stop::Invalid(i + 1)),
                }
            }
            0x00..=0x1f => return Err(Stop::Invalid(i)),
            _ => i += 1,
        }
    }
}

fn scan_value(b: &[u8], i: usize, depth: usize) -> Result<usize, Stop> {
    let Some(&c) = b.get(i) else { return Err(Stop::Partial) };
    match c {
        b'{' => scan_object(b, i, depth + 1),
        b'[' => scan_array(b, i, depth + 1),
        b'"' => scan_string(b, i),
        b'-' | b'0'..=b'9' => scan_number(b, i),
        b't' => scan_literal(b, i, b"true"),
        b'f' => scan_literal(b, i, b"false"),
        b'n' => scan_literal(b, i, b"null"),
        _ => Err(Stop::Invalid(i)),
    }
}

fn ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

fn scan_object(b: &[u8], start: usize, depth: usize) -> Result<usize, Stop> {
    if depth > MAX_DEPTH {
        return Err(Stop::Invalid(start));
    }
    let mut i = ws(b, start + 1);
    match b.get(i) {
        None => return Err(Stop::Partial),
        Some(b'}') => return Ok(i + 1),
        Some(_) => {}
    }
    loop {
        match b.get(i) {
            None => return Err(Stop::Partial),
            Some(b'"') => i = ws(b, scan_string(b, i)?),
            Some(_) => return Err(Stop::Invalid(i)),
        }
        match b.get(i) {
            None => return Err(Stop::Partial),
            Some(b':') => i = ws(b, i + 1),
            Some(_) => return Err(Stop::Invalid(i)),
        }
        i = ws(b, scan_value(b, i, depth)?);
        match b.get(i) {
            None => return Err(Stop::Partial),
            Some(b',') => i = ws(b, i + 1),
            Some(b'}') => return Ok(i + 1),
            Some(_) => return Err(Stop::Invalid(i)),
        }
    }
}

fn scan_array(b: &[u8], start: usize, depth: usize) -> Result<usize, Stop> {
    if depth > MAX_DEPTH {
        return Err(Stop::Invalid(start));
    }
    let mut i = ws(b, start + 1);
    match b.get(i) {
        None => return Err(Stop::Partial),
        Some(b']') => return Ok(i + 1),
        Some(_) => {}
    }
    loop {
        i = ws(b, scan_value(b, i, depth)?);
        match b.get(i) {
            None => return Err(Stop::Partial),
            Some(b',') => i = ws(b, i + 1),
            Some(b']') => return Ok(i + 1),
            Some(_) => return Err(Stop::Invalid(i)),
        }
    }
}

/// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`; a number that reaches the end of the
/// text is `Partial`.
fn scan_number(b: &[u8], start: usize) -> Result<usize, Stop> {
    let mut i = start;
    if b[i] == b'-' {
        i += 1;
    }
    match b.get(i) {
        None => return Err(Stop::Partial),
        Some(b'0') => i += 1,
        Some(b'1'..=b'9') => i = digits(b, i),
        Some(_) => return Err(Stop::Invalid(i)),
    }
    if b.get(i) == Some(&b'.') {
        i += 1;
        match b.get(i) {
            None => return Err(Stop::Partial),
            Some(d) if d.is_ascii_digit() => i = digits(b, i),
            Some(_) => return Err(Stop::Invalid(i)),
        }
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        match b.get(i) {
            None => return Err(Stop::Partial),
            Some(d) if d.is_ascii_digit() => i = digits(b, i),
            Some(_) => return Err(Stop::Invalid(i)),
        }
    }
    if i == b.len() {
        Err(Stop::Partial)
    } else {
        Ok(i)
    }
}

fn digits(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(u8::is_ascii_digit) {
        i += 1;
    }
    i
}

fn scan_literal(b: &[u8], start: usize, word: &[u8]) -> Result<usize, Stop> {
    for (k, &w) in word.iter().enumerate() {
        match b.get(start + k) {
            None => return Err(Stop::Partial),
            Some(&c) if c == w => {}
            Some(_) => return Err(Stop::Invalid(start + k)),
        }
    }
    Ok(start + word.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complete_values_end_where_serde_says() {
        for text in [r#"{"a": [1, 2.5e-3, "x\"y\u00e9"], "b": {"c": null}} tail"#, "[] x", r#""s" "#, "true,"] {
            let Scan::Complete(end) = value(text, 0) else { panic!("{text}: not complete") };
            let prefix = &text[..end];
            assert!(serde_json::from_str::<serde_json::Value>(prefix).is_ok(), "{prefix}");
        }
    }

    #[test]
    fn every_prefix_of_a_value_is_partial() {
        let text = r#"{"name": "f", "arguments": {"x": -12.5E+3, "y": [true, false, null], "z": "\u00e9\n"}}"#;
        for cut in 0..text.len() {
            assert_eq!(value(&text[..cut], 0), Scan::Partial, "cut {cut}");
        }
        assert_eq!(value(text, 0), Scan::Complete(text.len()));
    }

    #[test]
    fn invalid_text_is_found_where_it_goes_wrong() {
        let cases = [
            (r#"{"a" 1}"#, 5),
            (r#"{"a": tru }"#, 9),
            (r#"{'a': 1}"#, 1),
            (r#"[1, 2,, 3]"#, 6),
            (r#"{"a": 01}"#, 7),
            (r#"{"a": "\x"}"#, 8),
            ("{\"a\": \"\n\"}", 7),
            (r#"{"a": 1,}"#, 8),
        ];
        for (text, at) in cases {
            assert_eq!(value(text, 0), Scan::Invalid(at), "{text}");
            assert!(serde_json::from_str::<serde_json::Value>(text).is_err());
        }
    }

    #[test]
    fn deep_nesting_is_refused() {
        let deep = "[".repeat(MAX_DEPTH + 1);
        assert_eq!(value(&deep, 0), Scan::Invalid(MAX_DEPTH));
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert_eq!(value(&ok, 0), Scan::Complete(ok.len()));
    }
}

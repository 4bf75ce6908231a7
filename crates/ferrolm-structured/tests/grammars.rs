//! Grammars against a fixture's real vocabulary: random walks under the masks always give text
//! the constraint accepts, the end allows only EOS ids, the cache hands out fresh starts, and
//! constraints llguidance cannot handle are refused with a message.

use std::path::Path;

use ferrolm_structured::{Constraint, GrammarCompiler, StructuredError, StructuredOutput};
use ferrolm_tokenizer::Tokenizer;
use serde_json::{json, Value};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures");
/// `</s>` in the fixtures' vocabulary, and a second id standing for a model's other EOS id.
const EOS: [u32; 2] = [1, 2];

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(&Path::new(FIXTURES).join("llama3_gqa")).expect("fixture tokenizer")
}

fn allowed(mask: &[u32]) -> Vec<u32> {
    (0..mask.len() as u32 * 32).filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1).collect()
}

/// Samples uniformly among the allowed tokens (a tiny xorshift stream per `seed`) until an EOS
/// id, and returns the text; panics past `max_tokens`.
fn random_walk(tok: &Tokenizer, mut c: Constraint, seed: u64, max_tokens: usize) -> String {
    let words = tok.vocab_size().div_ceil(32);
    let mut mask = vec![0u32; words];
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut ids = Vec::new();
    for _ in 0..max_tokens {
        c.fill_mask(&mut mask).expect("mask");
        let options = allowed(&mask);
        assert!(!options.is_empty(), "no token allowed after {:?}", tok.decode(&ids, false));
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        // Prefer ending once it is allowed half of the time, so that walks finish.
        let eos_allowed = options.iter().any(|t| EOS.contains(t));
        let token = if eos_allowed && state.is_multiple_of(2) {
            *options.iter().find(|t| EOS.contains(t)).expect("an EOS id")
        } else {
            options[(state >> 8) as usize % options.len()]
        };
        if EOS.contains(&token) {
            return tok.decode(&ids, false).expect("decode");
        }
        c.advance(token).expect("advance");
        ids.push(token);
    }
    panic!("no EOS within {max_tokens} tokens: {:?}", tok.decode(&ids, false));
}

#[test]
fn json_schema_walks_give_valid_documents() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(&tok, &EOS).expect("compiler");
    let schema = json!({
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}
        },
        "required": ["kind", "age", "tags"],
        "additionalProperties": false
    });
    let grammar = compiler.compile(&StructuredOutput::JsonSchema(schema)).expect("compile");
    for seed in 0..40 {
        let text = random_walk(&tok, grammar.start(), seed, 200);
        let doc: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {text:?}: {e}"));
        assert!(["cat", "dog"].contains(&doc["kind"].as_str().expect("kind")), "{text}");
        assert!(doc["age"].as_u64().is_some_and(|a| a <= 99), "{text}");
        let tags = doc["tags"].as_array().expect("tags");
        assert!(tags.len() <= 2 && tags.iter().all(|t| t.as_str().is_some_and(|s| s.chars().count() <= 3)), "{text}");
        assert_eq!(doc.as_object().map(|o| o.len()), Some(3), "no other keys: {text}");
        // The layout `json.dumps` writes: no whitespace but the one space after `,` and `:`.
        assert!(text.starts_with("{\"kind\": \"") && !text.contains(['\n', '\t', '\r']), "{text:?}");
    }
}

#[test]
fn regex_choice_and_lark_walks_match() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(&tok, &EOS).expect("compiler");
    let regex = compiler.compile(&StructuredOutput::Regex(r"[a-c]{2,4}-[0-9]{3}".into())).expect("regex");
    let choices = vec!["yes".to_string(), "no".into(), "maybe \"so\"".into()];
    let choice = compiler.compile(&StructuredOutput::Choice(choices.clone())).expect("choice");
    let lark = compiler.compile(&StructuredOutput::Grammar("start: \"(\" NUM (\"+\" NUM)* \")\"\nNUM: /[0-9]/".into()));
    let lark = lark.expect("lark");
    for seed in 0..30 {
        let text = random_walk(&tok, regex.start(), seed, 50);
        let (letters, digits) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
        assert!((2..=4).contains(&letters.len()) && letters.bytes().all(|b| (b'a'..=b'c').contains(&b)), "{text:?}");
        assert!(digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()), "{text:?}");
        let text = random_walk(&tok, choice.start(), seed, 50);
        assert!(choices.contains(&text), "{text:?}");
        let text = random_walk(&tok, lark.start(), seed, 80);
        let inner = text.strip_prefix('(').and_then(|t| t.strip_suffix(')')).unwrap_or_else(|| panic!("{text:?}"));
        assert!(inner.split('+').all(|n| n.len() == 1 && n.as_bytes()[0].is_ascii_digit()), "{text:?}");
    }
}

#[test]
fn a_complete_output_allows_every_eos_id_and_nothing_else() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(&tok, &EOS).expect("compiler");
    let grammar = compiler.compile(&StructuredOutput::Choice(vec!["ab".into()])).expect("choice");
    let mut c = grammar.start();
    for token in tok.encode("ab", false).expect("encode") {
        c.advance(token).expect("advance");
    }
    let mut mask = vec![0u32; tok.vocab_size().div_ceil(32)];
    c.fill_mask(&mut mask).expect("mask");
    assert_eq!(allowed(&mask), EOS.to_vec());
    // A wrong token is refused.
    let mut fresh = grammar.start();
    let z = tok.encode("z", false).expect("encode")[0];
    assert!(matches!(fresh.advance(z), Err(StructuredError::Matcher(_))));
}

#[test]
fn compiled_grammars_are_cached_and_start_fresh() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(&tok, &EOS).expect("compiler");
    let spec = StructuredOutput::Regex("x+y".into());
    let first = compiler.compile(&spec).expect("compile");
    // Advance one start; a later compile of the same spec (from the cache) is unaffected.
    let mut walked = first.start();
    walked.advance(tok.encode("x", false).expect("encode")[0]).expect("x");
    let again = compiler.compile(&spec).expect("cached");
    assert_eq!(compiler.cached(), 1);
    let mut mask = vec![0u32; tok.vocab_size().div_ceil(32)];
    again.start().fill_mask(&mut mask).expect("mask");
    let y = tok.encode("y", false).expect("encode")[0];
    assert!(!allowed(&mask).contains(&y), "a fresh start cannot begin with y");
    compiler.compile(&StructuredOutput::Regex("x+z".into())).expect("compile");
    assert_eq!(compiler.cached(), 2);
}

#[test]
fn unsupported_constraints_are_refused_with_a_message() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(&tok, &EOS).expect("compiler");
    let cases = [
        StructuredOutput::JsonSchema(json!({"type": "frobnicate"})),
        StructuredOutput::JsonSchema(json!({"$ref": "https://example.com/schema.json"})),
        StructuredOutput::JsonSchema(json!({"type": "array", "uniqueItems": true})),
        StructuredOutput::JsonSchema(json!({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}})),
        StructuredOutput::Regex("(unclosed".into()),
        StructuredOutput::Grammar("start: undefined_rule".into()),
    ];
    let huge = StructuredOutput::Choice((0..20_000).map(|i| format!("choice number {i}")).collect());
    for case in cases.into_iter().chain([huge]) {
        match compiler.compile(&case) {
            Err(StructuredError::Invalid(msg)) => assert!(!msg.is_empty() && !msg.contains('\n'), "{case:?}: {msg}"),
            other => panic!("{case:?}: {:?}", other.map(|_| "compiled")),
        }
    }
}

#[test]
fn types_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<GrammarCompiler>();
    send::<ferrolm_structured::Grammar>();
    send::<Constraint>();
}

/// What docs/STRUCTURED_OUTPUT.md promises compiles: recursive `$ref`s, formats, pattern
/// properties, annotations.
#[test]
fn documented_schema_features_compile() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(&tok, &EOS).expect("compiler");
    let schemas = [
        json!({"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
               "$ref": "#/$defs/node"}),
        json!({"type": "string", "format": "date-time"}),
        json!({"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "minProperties": 1, "maxProperties": 2}),
        json!({"title": "t", "description": "d", "type": "number", "exclusiveMinimum": 0, "multipleOf": 0.5}),
        json!({"oneOf": [{"type": "integer"}, {"type": "string", "pattern": "^[a-z]+$"}]}),
    ];
    for schema in schemas {
        compiler.compile(&StructuredOutput::JsonSchema(schema.clone())).unwrap_or_else(|e| panic!("{schema}: {e}"));
    }
}

//! Golden tests against the HF fixture directories in testdata/fixtures: tokenization equals
//! the ids HF produced, chat templates render as HF renders them, and loading failures name
//! the file that is wrong.

use std::fs;
use std::path::{Path, PathBuf};

use ferrolm_tokenizer::{ChatMessage, Tokenizer, TokenizerError};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures");
macro_rules! fixtures {
    ($($name:ident),*) => {
        const FIXTURE_NAMES: &[&str] = &[$(stringify!($name)),*];
    };
}
include!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures/names.rs"));

type BoxError = Box<dyn std::error::Error>;
type TestResult = Result<(), BoxError>;

fn fixture(name: &str) -> PathBuf {
    Path::new(FIXTURES).join(name)
}

/// `reference.json`'s `tokenize` list: (text, ids HF gave with no special tokens added).
fn reference_tokenization(name: &str) -> Result<Vec<(String, Vec<u32>)>, BoxError> {
    let text = fs::read_to_string(fixture(name).join("reference.json"))?;
    let reference: serde_json::Value = serde_json::from_str(&text)?;
    let cases = reference["tokenize"].as_array().ok_or("reference.json has no tokenize list")?;
    cases
        .iter()
        .map(|case| {
            let text = case["text"].as_str().ok_or("tokenize case without text")?.to_string();
            let ids = serde_json::from_value::<Vec<u32>>(case["ids"].clone())?;
            Ok((text, ids))
        })
        .collect()
}

/// A scratch model directory holding a copy of the llama fixture's tokenizer files.
fn scratch_copy() -> Result<tempfile::TempDir, BoxError> {
    let dir = tempfile::tempdir()?;
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        fs::copy(fixture("llama").join(file), dir.path().join(file))?;
    }
    Ok(dir)
}

#[test]
fn tokenization_matches_reference_for_every_fixture() -> TestResult {
    for &name in FIXTURE_NAMES {
        let tokenizer = Tokenizer::from_dir(&fixture(name))?;
        let cases = reference_tokenization(name)?;
        assert!(!cases.is_empty(), "{name}: no reference texts");
        for (text, want) in cases {
            assert_eq!(tokenizer.encode(&text, false)?, want, "{name}: {text:?}");
        }
    }
    Ok(())
}

/// The bound that lets the server refuse a huge prompt without tokenizing it never exceeds the
/// real count: on each fixture's reference texts, on text made only of the longest tokens, and on
/// long runs of spaces, digits and one multi-byte char.
#[test]
fn the_token_lower_bound_holds_for_every_fixture() -> TestResult {
    let demo = Path::new(FIXTURES).join("../../models/ferrolm-demo-py");
    for dir in FIXTURE_NAMES.iter().map(|n| fixture(n)).chain([demo]) {
        let tokenizer = Tokenizer::from_dir(&dir)?;
        let mut texts: Vec<String> = reference_tokenization_or_empty(&dir)?;
        texts.extend([" ".repeat(5000), "7".repeat(5000), "é".repeat(3000), "def f():\n    return 1\n".repeat(300)]);
        for text in &texts {
            let count = tokenizer.encode(text, false)?.len();
            let bound = tokenizer.min_tokens_for(text.len());
            assert!(
                bound <= count,
                "{}: bound {bound} > {count} tokens for {:?}",
                dir.display(),
                &text[..text.len().min(40)]
            );
        }
        assert!(tokenizer.min_tokens_for(1 << 20) >= (1 << 20) / 1024, "{}: a token longer than 1 KiB?", dir.display());
    }
    Ok(())
}

/// The texts of `dir/reference.json`'s `tokenize` list, if it has one.
/// Counting a long text in pieces answers "surely past" only when it is, with a bound that holds,
/// and stops early: a text far past the limit is refused from its first pieces.
#[test]
fn counting_in_pieces_bounds_the_true_count() -> TestResult {
    let demo = Path::new(FIXTURES).join("../../models/ferrolm-demo-py");
    for dir in [fixture("llama3_gqa"), fixture("llama"), demo] {
        let tokenizer = Tokenizer::from_dir(&dir)?;
        for text in ["def f(x):\n    return x + 1\n\n".repeat(8000), "word, ".repeat(40_000), "  \n\t ".repeat(30_000)]
        {
            let count = tokenizer.encode(&text, false)?.len();
            assert_eq!(tokenizer.surely_past(&text, count)?, None, "{}: not past its own count", dir.display());
            let at_least = tokenizer.surely_past(&text, count / 2)?.ok_or("half the count is surely past")?;
            assert!(at_least > count / 2 && at_least <= count, "{}: {at_least} of {count}", dir.display());
            let early = tokenizer.surely_past(&text, 10)?.ok_or("10 is surely past")?;
            assert!(early < count / 2, "{}: counted {early} of {count}, not stopping early", dir.display());
        }
        assert_eq!(tokenizer.surely_past(&"x".repeat(1000), 1)?, None, "one piece is not counted");
    }
    Ok(())
}

/// The texts of `dir/reference.json`'s `tokenize` list, if it has one.
fn reference_tokenization_or_empty(dir: &Path) -> Result<Vec<String>, BoxError> {
    let Ok(text) = fs::read_to_string(dir.join("reference.json")) else { return Ok(Vec::new()) };
    let reference: serde_json::Value = serde_json::from_str(&text)?;
    let cases = reference["tokenize"].as_array().cloned().unwrap_or_default();
    Ok(cases.iter().filter_map(|case| case["text"].as_str().map(str::to_string)).collect())
}

#[test]
fn decode_round_trips_reference_texts() -> TestResult {
    for &name in FIXTURE_NAMES {
        let tokenizer = Tokenizer::from_dir(&fixture(name))?;
        for (text, ids) in reference_tokenization(name)? {
            assert_eq!(tokenizer.decode(&ids, false)?, text, "{name}");
            assert_eq!(tokenizer.decode(&ids, true)?, text, "{name}");
        }
    }
    Ok(())
}

/// Each fixture's tokenizer spans its model's vocabulary: 320 tokens for the first fixtures,
/// 384 for the later ones (the MoE and Gemma 2/3 models), with the same special ids. An FP8
/// fixture (`{source}_fp8_{scheme}`) has its source's tokenizer.
#[test]
fn every_fixture_tokenizer_spans_its_model_vocabulary() -> TestResult {
    for &name in FIXTURE_NAMES {
        let tokenizer = Tokenizer::from_dir(&fixture(name))?;
        let config: serde_json::Value = serde_json::from_str(&fs::read_to_string(fixture(name).join("config.json"))?)?;
        let vocab = config["vocab_size"].as_u64().ok_or("config.json has no vocab_size")? as usize;
        assert_eq!(tokenizer.vocab_size(), vocab, "{name}");
        let source = name.split("_fp8_").next().unwrap_or(name);
        let later = source.ends_with("_moe") || ["gemma2_softcap", "gemma3_text"].contains(&source);
        let expected = if later { 384 } else { 320 };
        assert_eq!(vocab, expected, "{name}");
        assert_eq!((tokenizer.bos_token_id(), tokenizer.eos_token_id()), (Some(0), Some(1)), "{name}");
        assert_eq!(tokenizer.id_to_token(vocab as u32), None, "{name}");
    }
    Ok(())
}

#[test]
fn special_tokens_and_vocabulary() -> TestResult {
    let tokenizer = Tokenizer::from_dir(&fixture("llama"))?;
    assert_eq!(tokenizer.vocab_size(), 320);
    assert_eq!(tokenizer.bos_token_id(), Some(0));
    assert_eq!(tokenizer.eos_token_id(), Some(1));
    assert_eq!(tokenizer.token_to_id("<pad>"), Some(2));
    assert_eq!(tokenizer.id_to_token(1).as_deref(), Some("</s>"));
    assert_eq!(tokenizer.id_to_token(320), None);
    assert!(tokenizer.is_special(0) && tokenizer.is_special(1) && tokenizer.is_special(2));
    assert!(!tokenizer.is_special(3));
    assert_eq!(tokenizer.config().model_max_length, None);

    // Special tokens written in the text are recognised; decode can leave them out.
    let ids = tokenizer.encode("<s>hi</s>", false)?;
    assert_eq!(ids.first(), Some(&0));
    assert_eq!(ids.last(), Some(&1));
    assert_eq!(tokenizer.decode(&ids, false)?, "<s>hi</s>");
    assert_eq!(tokenizer.decode(&ids, true)?, "hi");
    Ok(())
}

#[test]
fn add_special_tokens_follows_tokenizer_config() -> TestResult {
    // The fixture's post-processor adds nothing and its config leaves add_bos_token unset.
    let tokenizer = Tokenizer::from_dir(&fixture("llama"))?;
    assert_eq!(tokenizer.encode("hi", true)?, tokenizer.encode("hi", false)?);

    let dir = scratch_copy()?;
    let config_path = dir.path().join("tokenizer_config.json");
    let mut config: serde_json::Value = serde_json::from_str(&fs::read_to_string(&config_path)?)?;
    config["add_bos_token"] = serde_json::Value::Bool(true);
    config["eos_token"] = serde_json::json!({"content": "</s>", "lstrip": false});
    fs::write(&config_path, serde_json::to_string(&config)?)?;
    let tokenizer = Tokenizer::from_dir(dir.path())?;
    let plain = tokenizer.encode("hi", false)?;
    let with_bos = tokenizer.encode("hi", true)?;
    assert_eq!(with_bos[0], 0);
    assert_eq!(&with_bos[1..], plain.as_slice());
    // A BOS the text already starts with is not doubled.
    assert_eq!(tokenizer.encode("<s>hi", true)?, with_bos);
    assert_eq!(tokenizer.eos_token_id(), Some(1));
    Ok(())
}

#[test]
fn decode_rejects_unknown_ids() -> TestResult {
    let tokenizer = Tokenizer::from_dir(&fixture("llama"))?;
    let err = tokenizer.decode(&[5, 320], false).err().ok_or("decode accepted id 320")?;
    assert!(matches!(err, TokenizerError::UnknownTokenId { id: 320, vocab_size: 320 }), "{err}");
    assert_eq!(err.to_string(), "token id 320 is out of vocabulary: the tokenizer has 320 tokens");
    Ok(())
}

/// The Gemma 2 and 3 fixtures share a byte-level BPE of 384 tokens: ids past the older
/// fixtures' 320 are tokens of their own (383 is `attn`), and 384 is out of vocabulary.
#[test]
fn the_384_token_vocabulary_of_the_newer_fixtures() -> TestResult {
    for name in ["gemma2_softcap", "gemma3_text"] {
        let tokenizer = Tokenizer::from_dir(&fixture(name))?;
        assert_eq!(tokenizer.vocab_size(), 384, "{name}");
        assert_eq!(tokenizer.id_to_token(383).as_deref(), Some("attn"), "{name}");
        assert_eq!(tokenizer.id_to_token(384), None, "{name}");
        assert_eq!(tokenizer.encode("attn", false)?, [383], "{name}");
        assert_eq!(tokenizer.decode(&[320, 383], false)?, "chattn", "{name}");
        let err = tokenizer.decode(&[383, 384], false).err().ok_or("decode accepted id 384")?;
        assert!(matches!(err, TokenizerError::UnknownTokenId { id: 384, vocab_size: 384 }), "{name}: {err}");
    }
    Ok(())
}

/// Added tokens past the base vocabulary count: the tokenizer's size is one past its highest
/// id (every id it can decode), not the base vocabulary's.
#[test]
fn vocab_size_covers_added_tokens_past_the_base_vocabulary() -> TestResult {
    let dir = scratch_copy()?;
    let path = dir.path().join("tokenizer.json");
    let mut json: serde_json::Value = serde_json::from_str(&fs::read_to_string(&path)?)?;
    let added = json["added_tokens"].as_array_mut().ok_or("tokenizer.json has no added_tokens")?;
    added.push(serde_json::json!({"id": 320, "content": "<extra>", "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": false}));
    fs::write(&path, serde_json::to_string(&json)?)?;
    let tokenizer = Tokenizer::from_dir(dir.path())?;
    assert_eq!(tokenizer.vocab_size(), 321);
    assert_eq!(tokenizer.decode(&[320], false)?, "<extra>");
    assert_eq!(tokenizer.encode("<extra>", false)?, [320]);
    let err = tokenizer.decode(&[321], false).err().ok_or("decode accepted id 321")?;
    assert!(matches!(err, TokenizerError::UnknownTokenId { id: 321, vocab_size: 321 }), "{err}");
    Ok(())
}

#[test]
fn fixture_chat_templates_render_as_hf() -> TestResult {
    let conversation = [ChatMessage::new("user", "Hello"), ChatMessage::new("assistant", "Hi there")];
    let without_prompt = "<s>user\nHello</s>\n<s>assistant\nHi there</s>\n";
    for &name in FIXTURE_NAMES {
        let tokenizer = Tokenizer::from_dir(&fixture(name))?;
        let template = tokenizer.chat_template().ok_or(format!("{name}: no chat template"))?;
        assert_eq!(template.render(&conversation, false, None)?, without_prompt, "{name}");
        assert_eq!(template.render(&conversation, true, None)?, format!("{without_prompt}<s>assistant\n"), "{name}");
        // The same conversation as JSON values renders the same.
        let as_json = serde_json::to_value(conversation.clone())?;
        let messages = as_json.as_array().ok_or("not an array")?;
        assert_eq!(template.render(messages, false, None)?, without_prompt, "{name}");
    }
    Ok(())
}

#[test]
fn chat_template_jinja_takes_precedence_over_config() -> TestResult {
    let dir = scratch_copy()?;
    let tokenizer = Tokenizer::from_dir(dir.path())?;
    let from_config = tokenizer.chat_template().ok_or("no template from tokenizer_config.json")?;
    assert!(from_config.source().contains("m['role']"));

    fs::write(dir.path().join("chat_template.jinja"), "{{ bos_token }}{{ messages|length }}{{ eos_token }}")?;
    let tokenizer = Tokenizer::from_dir(dir.path())?;
    let template = tokenizer.chat_template().ok_or("no template from chat_template.jinja")?;
    assert_eq!(template.render(&[ChatMessage::new("user", "x")], false, None)?, "<s>1</s>");
    Ok(())
}

#[test]
fn missing_directory_is_reported() {
    let path = Path::new(FIXTURES).join("no_such_model");
    let err = Tokenizer::from_dir(&path).err();
    assert!(matches!(err, Some(TokenizerError::DirNotFound(_))), "{err:?}");
    let msg = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("no_such_model") && msg.contains("does not exist"), "{msg}");
}

#[test]
fn missing_tokenizer_json_is_reported() -> TestResult {
    let dir = tempfile::tempdir()?;
    let err = Tokenizer::from_dir(dir.path()).err().ok_or("loaded a directory without tokenizer.json")?;
    assert!(matches!(err, TokenizerError::TokenizerJsonMissing(_)), "{err}");
    assert!(err.to_string().contains("tokenizer.json not found"), "{err}");
    Ok(())
}

#[test]
fn corrupt_tokenizer_json_is_reported() -> TestResult {
    let dir = scratch_copy()?;
    for corrupt in ["{ not json", r#"{"version": "1.0", "model": {"type": "Nope"}}"#] {
        fs::write(dir.path().join("tokenizer.json"), corrupt)?;
        let err = Tokenizer::from_dir(dir.path()).err().ok_or("loaded a corrupt tokenizer.json")?;
        let msg = err.to_string();
        assert!(matches!(err, TokenizerError::Parse { .. }), "{msg}");
        assert!(msg.starts_with("failed to parse") && msg.contains("tokenizer.json"), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
    }
    Ok(())
}

#[test]
fn corrupt_tokenizer_config_is_reported() -> TestResult {
    let dir = scratch_copy()?;
    fs::write(dir.path().join("tokenizer_config.json"), "[1, 2")?;
    let err = Tokenizer::from_dir(dir.path()).err().ok_or("loaded a corrupt tokenizer_config.json")?;
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
    Ok(())
}

#[test]
fn bad_template_syntax_is_reported_with_its_file() -> TestResult {
    let dir = scratch_copy()?;
    fs::write(dir.path().join("chat_template.jinja"), "{% for m in messages %}{{ m.content }")?;
    let err = Tokenizer::from_dir(dir.path()).err().ok_or("loaded a broken template")?;
    let msg = err.to_string();
    assert!(matches!(err, TokenizerError::ChatTemplateSyntax(_)), "{msg}");
    assert!(msg.starts_with("chat template syntax error:") && msg.contains("chat_template.jinja"), "{msg}");
    assert!(msg.contains("line 1"), "{msg}");
    Ok(())
}

/// A token's bytes are the text it stands for: the bytes of a text's tokens, concatenated, are
/// the text, for every fixture (byte-level and SentencePiece vocabularies) and the demo model.
#[test]
fn token_bytes_spell_the_encoded_text() -> TestResult {
    let demo = Path::new(FIXTURES).join("../../models/ferrolm-demo-py");
    for dir in FIXTURE_NAMES.iter().map(|n| fixture(n)).chain([demo]) {
        let tokenizer = Tokenizer::from_dir(&dir)?;
        let bytes = tokenizer.token_bytes()?;
        assert_eq!(bytes.len(), tokenizer.vocab_size(), "{}", dir.display());
        let mut texts = reference_tokenization_or_empty(&dir)?;
        texts.extend(["{\"name\": \"x\", \"n\": [1, 2.5e-3]}\n\tdef f():  é 🦀".to_string()]);
        for text in &texts {
            let ids = tokenizer.encode(text, false)?;
            let spelled: Vec<u8> = ids.iter().flat_map(|&id| bytes[id as usize].iter().copied()).collect();
            // SentencePiece normalizers may prepend a space marker to the first word.
            let spelled = String::from_utf8_lossy(&spelled);
            assert!(
                spelled == *text || spelled.strip_prefix(' ') == Some(text),
                "{}: {text:?} spelled {spelled:?}",
                dir.display()
            );
        }
    }
    Ok(())
}

//! Bad model directories give one clear error each, never a panic.

use std::fs;
use std::path::{Path, PathBuf};

use ferrolm_model::{Model, ModelError};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/fixtures")).join(name)
}

/// A writable copy of a fixture.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for entry in fs::read_dir(fixture(name)).expect("fixture") {
        let entry = entry.expect("entry");
        fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("copy");
    }
    dir
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&fs::read_to_string(&path).expect("read")).expect("json");
    edit(&mut v);
    fs::write(path, serde_json::to_string(&v).expect("ser")).expect("write");
}

fn load_err(dir: &Path) -> String {
    match Model::from_dir(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => {
            let msg = e.to_string();
            assert!(!msg.contains('\n'), "error should be one line: {msg}");
            msg
        }
    }
}

#[test]
fn both_layouts_load() -> Result<(), ModelError> {
    // Sharded + old keys, and single file + new keys.
    Model::from_dir(&fixture("llama"))?;
    Model::from_dir(&fixture("llama3_gqa"))?;
    Ok(())
}

#[test]
fn missing_directory() {
    let msg = load_err(Path::new("/nonexistent/model"));
    assert!(msg.contains("/nonexistent/model"), "{msg}");
}

#[test]
fn missing_config() {
    let dir = copy_fixture("qwen2_tied");
    fs::remove_file(dir.path().join("config.json")).expect("rm");
    assert!(load_err(dir.path()).contains("config.json"));
}

#[test]
fn invalid_config_json() {
    let dir = copy_fixture("qwen2_tied");
    fs::write(dir.path().join("config.json"), "{ not json").expect("write");
    assert!(load_err(dir.path()).contains("not valid JSON"));
}

#[test]
fn unknown_architecture() {
    let dir = copy_fixture("qwen2_tied");
    edit_config(dir.path(), |v| v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]));
    let msg = load_err(dir.path());
    assert!(msg.contains("GPT2LMHeadModel") && msg.contains("LlamaForCausalLM"), "{msg}");
}

#[test]
fn missing_weights() {
    let dir = copy_fixture("qwen2_tied");
    fs::remove_file(dir.path().join("model.safetensors")).expect("rm");
    assert!(load_err(dir.path()).contains("no weights"));
}

#[test]
fn missing_tensor_is_named() {
    // Untying the embeddings makes the loader look for a tensor the checkpoint lacks.
    let dir = copy_fixture("qwen2_tied");
    edit_config(dir.path(), |v| v["tie_word_embeddings"] = serde_json::json!(false));
    let msg = load_err(dir.path());
    assert!(msg.contains("`lm_head.weight`"), "{msg}");
}

#[test]
fn wrong_shape_is_named() {
    let dir = copy_fixture("qwen2_tied");
    edit_config(dir.path(), |v| v["intermediate_size"] = serde_json::json!(100));
    let msg = load_err(dir.path());
    assert!(msg.contains("model.layers.0.mlp.gate_proj.weight") && msg.contains("[100, 64]"), "{msg}");
}

#[test]
fn truncated_safetensors() {
    let dir = copy_fixture("qwen2_tied");
    let path = dir.path().join("model.safetensors");
    let bytes = fs::read(&path).expect("read");
    fs::write(&path, &bytes[..bytes.len() / 2]).expect("write");
    let msg = load_err(dir.path());
    assert!(msg.contains("corrupt or truncated") && msg.contains("model.safetensors"), "{msg}");
}

#[test]
fn garbage_safetensors() {
    let dir = copy_fixture("qwen2_tied");
    fs::write(dir.path().join("model.safetensors"), b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage").expect("write");
    assert!(load_err(dir.path()).contains("corrupt or truncated"));
    fs::write(dir.path().join("model.safetensors"), b"abc").expect("write");
    assert!(load_err(dir.path()).contains("corrupt or truncated"));
}

#[test]
fn missing_shard() {
    let dir = copy_fixture("llama");
    fs::remove_file(dir.path().join("model-00002-of-00003.safetensors")).expect("rm");
    assert!(load_err(dir.path()).contains("model-00002-of-00003.safetensors"));
}

#[test]
fn unsupported_quantization_is_named() {
    let dir = copy_fixture("llama3_gqa");
    edit_config(dir.path(), |c| c["quantization_config"] = serde_json::json!({"quant_method": "awq", "bits": 4}));
    let msg = load_err(dir.path());
    assert!(msg.contains("unsupported quantization") && msg.contains("`awq`"), "{msg}");

    let dir = copy_fixture("llama3_gqa_fp8_dynamic");
    edit_config(dir.path(), |c| c["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int".into());
    let msg = load_err(dir.path());
    assert!(msg.contains("8-bit `int`") && msg.contains("group_0"), "{msg}");
}

#[test]
fn fp8_weights_need_their_scheme_and_scales() {
    // FP8 tensors with no quantization_config to say how they are scaled.
    let dir = copy_fixture("llama3_gqa_fp8_dynamic");
    edit_config(dir.path(), |c| {
        c.as_object_mut().expect("object").remove("quantization_config");
    });
    let msg = load_err(dir.path());
    assert!(msg.contains("model.layers.0.self_attn.q_proj.weight") && msg.contains("quantization_config"), "{msg}");

    // Scales read by another scheme than the one they were stored with: per-channel scales
    // `[rows, 1]` where the config says one per tensor.
    let dir = copy_fixture("llama3_gqa_fp8_dynamic");
    edit_config(dir.path(), |c| {
        c["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor".into()
    });
    let msg = load_err(dir.path());
    assert!(msg.contains("model.layers.0.self_attn.q_proj.weight_scale") && msg.contains("[96, 1]"), "{msg}");

    // Block scales for another block size.
    let dir = copy_fixture("qwen3_moe_fp8_block");
    edit_config(dir.path(), |c| c["quantization_config"]["weight_block_size"] = serde_json::json!([32, 32]));
    let msg = load_err(dir.path());
    assert!(msg.contains("weight_scale_inv") && msg.contains("[2, 2]"), "{msg}");
}

#[test]
fn quantizing_a_quantized_checkpoint_again_is_refused() {
    let mut config = ferrolm_model::ModelConfig::from_dir(&fixture("llama3_gqa_fp8_dynamic")).expect("config");
    let msg = config.quantize_at_load().expect_err("compressed-tensors and --quantization fp8").to_string();
    assert!(msg.contains("compressed-tensors") && msg.contains("--quantization fp8"), "{msg}");
    let mut config = ferrolm_model::ModelConfig::from_dir(&fixture("qwen3_moe_fp8_block")).expect("config");
    config.quantize_at_load().expect("an fp8 checkpoint keeps its own scheme");
    let mut config = ferrolm_model::ModelConfig::from_dir(&fixture("llama3_gqa")).expect("config");
    config.quantize_at_load().expect("bf16");
    assert_eq!(config.quantization, Some(ferrolm_model::config::Quantization::FP8_AT_LOAD));
}

/// `fixture` with scalar f32 tensors `extra` added in a second shard (an index names both files).
fn with_extra_tensors(fixture: &str, extra: &[(String, f32)]) -> tempfile::TempDir {
    let dir = copy_fixture(fixture);
    let weights = fs::read(dir.path().join("model.safetensors")).expect("weights");
    let stored = safetensors::SafeTensors::deserialize(&weights).expect("safetensors");
    let mut map: serde_json::Map<String, Value> =
        stored.names().into_iter().map(|n| (n.to_owned(), "model.safetensors".into())).collect();
    let bytes: Vec<[u8; 4]> = extra.iter().map(|(_, x)| x.to_le_bytes()).collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = extra
        .iter()
        .zip(&bytes)
        .map(|((name, _), b)| {
            (name.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], b).expect("view"))
        })
        .collect();
    fs::write(dir.path().join("scales.safetensors"), safetensors::serialize(views, None).expect("serialize"))
        .expect("write");
    map.extend(extra.iter().map(|(name, _)| (name.clone(), "scales.safetensors".into())));
    let index = serde_json::json!({"weight_map": map});
    fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).expect("index");
    dir
}

#[test]
fn an_fp8_kv_cache_takes_the_checkpoints_scales() {
    use ferrolm_backend::cpu::KvStore;
    use ferrolm_backend::KvCacheDtype;
    let layer = |i: usize, name: &str| format!("model.layers.{i}.self_attn.{name}");
    // compressed-tensors' names in layer 0, an earlier checkpoint's in layer 1, none in layer 2.
    let extra = [
        (layer(0, "k_scale"), 0.5),
        (layer(0, "v_scale"), 0.25),
        (layer(1, "k_proj.output_scale"), 2.0),
        (layer(1, "v_proj.output_scale"), 4.0),
    ];
    let load = |dir: &Path, kv: KvCacheDtype| {
        let mut config = ferrolm_model::ModelConfig::from_dir(dir).expect("config");
        config.kv_cache_dtype = kv;
        let src = ferrolm_model::WeightSource::open_dir(dir).expect("weights");
        Model::load(&ferrolm_backend::cpu::Cpu::default(), config, &src)
    };
    let dir = with_extra_tensors("llama3_gqa_fp8_dynamic", &extra);
    let model = load(dir.path(), KvCacheDtype::Fp8).expect("model");
    let scale = |s: &KvStore| match s {
        KvStore::Fp8 { scale, .. } => *scale,
        KvStore::F32(_) => panic!("an f32 store"),
    };
    let kv = model.new_kv_cache(4, 16);
    let scales: Vec<(f32, f32)> = kv.layers.iter().map(|l| (scale(&l.k), scale(&l.v))).collect();
    assert_eq!(scales, [(0.5, 0.25), (2.0, 4.0), (1.0, 1.0)]);
    // With the cache in the compute dtype, the scales are not read.
    let auto = load(dir.path(), KvCacheDtype::Auto).expect("model");
    assert!(matches!(auto.new_kv_cache(4, 16).layers[0].k, KvStore::F32(_)));

    let dir = with_extra_tensors("llama3_gqa_fp8_dynamic", &[(layer(0, "k_scale"), -1.0)]);
    let msg = match load(dir.path(), KvCacheDtype::Fp8) {
        Ok(_) => panic!("a negative scale loads"),
        Err(e) => e.to_string(),
    };
    assert!(msg.contains("model.layers.0.self_attn.k_scale") && msg.contains("-1"), "{msg}");
}

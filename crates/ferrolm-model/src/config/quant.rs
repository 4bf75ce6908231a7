//! How a model's projections are quantized: a checkpoint's `quantization_config`, or
//! `--quantization fp8` (vLLM's flag) applied at load.
//!
//! Two checkpoint formats are read, as FP8 checkpoints are published:
//! - compressed-tensors `float-quantized` (`quant_method: "compressed-tensors"`): e4m3 weights
//!   with a `weight_scale` per tensor, per output channel or per block, and activations scaled
//!   per token (dynamic), per tensor (static: an `input_scale` per projection) or not at all;
//! - `quant_method: "fp8"`: e4m3 weights with a `weight_scale_inv` per block of
//!   `weight_block_size` (Qwen3 and DeepSeek's FP8 checkpoints), or a per-tensor `weight_scale`
//!   where no block size is given.
//!
//! Anything else (another method, integer or 4-bit weights, another float format) is refused at
//! load, naming it. Which projections a checkpoint quantized is read from the weights themselves:
//! a `weight` stored as F8_E4M3 is read with the scheme's scales, any other as it is stored (the
//! `ignore` / `modules_to_not_convert` lists name the same modules). The KV cache's scales
//! (`kv_cache_scheme`: `k_scale`, `v_scale`) are read with the layers, where the cache is FP8.

use serde_json::Value;

/// How each quantized projection's weights are scaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightScaling {
    /// One scale per matrix.
    Tensor,
    /// One scale per output row.
    Channel,
    /// One scale per block of `rows x cols`.
    Block { rows: usize, cols: usize },
}

/// How a quantized projection's input is scaled when the projection runs in FP8.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationScaling {
    /// Weight-only quantization: inputs stay in the compute dtype.
    None,
    /// Scales computed per token (or per group of a token) as each step runs.
    Dynamic,
    /// One calibrated `input_scale` per projection, stored in the checkpoint.
    Static,
}

/// An FP8 checkpoint's scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Checkpoint {
    /// `compressed-tensors` or `fp8`, for messages.
    pub method: &'static str,
    pub weights: WeightScaling,
    /// The suffix of each weight's scale tensor: `weight_scale`, or `weight_scale_inv` in the
    /// block-wise `fp8` format (a multiplier too, whatever its name says).
    pub scale_suffix: &'static str,
    pub activations: ActivationScaling,
}

/// How a model's projections are quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantization {
    /// The checkpoint's own FP8 weights.
    Checkpoint(Fp8Checkpoint),
    /// Each projection of the attention and the MLPs (experts included, routers, embeddings and
    /// the LM head not) quantized at load, scaled as given: per output row for
    /// `--quantization fp8` ([`Quantization::FP8_AT_LOAD`]), inputs scaled per token; in an FP8
    /// checkpoint's own blocks for `bench --dummy-weights` of its config (random weights are
    /// drawn in a float dtype), so that the benchmark runs the checkpoint's kernels.
    Fp8AtLoad(WeightScaling),
}

impl Quantization {
    /// `--quantization fp8`: per output row.
    pub const FP8_AT_LOAD: Quantization = Quantization::Fp8AtLoad(WeightScaling::Channel);

    /// The checkpoint's scheme, if it stores FP8 weights.
    pub fn checkpoint(&self) -> Option<&Fp8Checkpoint> {
        match self {
            Quantization::Checkpoint(c) => Some(c),
            Quantization::Fp8AtLoad(_) => None,
        }
    }

    /// How the quantized weights are scaled.
    pub fn weights(&self) -> WeightScaling {
        match self {
            Quantization::Checkpoint(c) => c.weights,
            Quantization::Fp8AtLoad(scaling) => *scaling,
        }
    }

    /// Whether each row of a quantized weight has one scale (a tensor's or a channel's), as the
    /// FP8 GEMMs over per-token-quantized inputs take them: the inputs whose codes the kernels
    /// that write them may keep (a GEMM over 128 x 128 blocks quantizes its own, per 128
    /// columns).
    pub fn scales_whole_rows(&self) -> bool {
        !matches!(self.weights(), WeightScaling::Block { .. })
    }
}

/// The `quantization_config` of a `config.json` (`None` when it has none); the error names what
/// is not supported.
pub fn parse(config: &Value) -> Result<Option<Quantization>, String> {
    let Some(q) = config.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(None);
    };
    let Some(method) = q.get("quant_method").and_then(Value::as_str) else {
        return Err("the quantization_config has no `quant_method`".into());
    };
    let scheme = match method {
        "compressed-tensors" => compressed_tensors(q)?,
        "fp8" => block_fp8(q)?,
        other => {
            return Err(format!(
                "method `{other}`: ferrolm reads FP8 checkpoints (compressed-tensors float-quantized, or \
                 quant_method `fp8`), and quantizes a bf16 one with --quantization fp8"
            ))
        }
    };
    Ok(Some(Quantization::Checkpoint(scheme)))
}

fn str_key<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// Two positive sizes (a `weight_block_size` or `block_structure`).
fn block(v: &Value, what: &str) -> Result<WeightScaling, String> {
    let sizes: Vec<usize> =
        v.as_array().map(|a| a.iter().filter_map(Value::as_u64).map(|n| n as usize).collect()).unwrap_or_default();
    match sizes[..] {
        [rows, cols] if rows > 0 && cols > 0 => Ok(WeightScaling::Block { rows, cols }),
        _ => Err(format!("`{what}` must be two positive sizes, not {v}")),
    }
}

/// Formats whose 8-bit float weights are stored as plain e4m3 codes: `float-quantized`, and
/// `naive-quantized` / `int-quantized` as earlier llm-compressor releases named it (with
/// `quantization_status: "frozen"`); the weights' own dtype says which tensors hold codes.
const CT_FP8_FORMATS: [&str; 3] = ["float-quantized", "naive-quantized", "int-quantized"];

fn compressed_tensors(q: &Value) -> Result<Fp8Checkpoint, String> {
    const NAME: &str = "compressed-tensors";
    if let Some(sparsity) = q.get("sparsity_config").and_then(Value::as_object).filter(|s| !s.is_empty()) {
        let format = sparsity.get("format").and_then(Value::as_str).unwrap_or("?");
        if format != "dense" {
            return Err(format!("{NAME} sparsity (`{format}`)"));
        }
    }
    let groups = q.get("config_groups").and_then(Value::as_object).filter(|g| !g.is_empty());
    let Some(groups) = groups else {
        return Err(format!("a {NAME} config without `config_groups`"));
    };
    let mut scheme: Option<Fp8Checkpoint> = None;
    for (name, group) in groups {
        let format = str_key(group, "format").or_else(|| str_key(q, "format")).unwrap_or("?");
        if !CT_FP8_FORMATS.contains(&format) {
            return Err(format!(
                "{NAME} format `{format}` (group `{name}`): only FP8 weights (`float-quantized`) are read"
            ));
        }
        let this = ct_group(name, group)?;
        // Groups may differ in their inputs' scaling; the weights' scales must read alike.
        match scheme {
            Some(s) if s.weights != this.weights => {
                return Err(format!(
                    "{NAME} groups whose weights are scaled differently ({:?} and {:?})",
                    s.weights, this.weights
                ))
            }
            Some(_) => {}
            None => scheme = Some(this),
        }
    }
    Ok(scheme.expect("there is a group"))
}

/// One `config_groups` entry of a float-quantized checkpoint.
fn ct_group(name: &str, group: &Value) -> Result<Fp8Checkpoint, String> {
    let w =
        group.get("weights").filter(|w| !w.is_null()).ok_or_else(|| format!("group `{name}` quantizes no weights"))?;
    let float8 = |v: &Value, what: &str| {
        let bits = v.get("num_bits").and_then(Value::as_u64);
        let kind = str_key(v, "type").unwrap_or("?");
        if bits != Some(8) || kind != "float" {
            let bits = bits.map_or("?".to_string(), |b| b.to_string());
            return Err(format!(
                "{what} of {bits}-bit `{kind}` (group `{name}`) are not supported: only 8-bit float (FP8)"
            ));
        }
        if v.get("symmetric").and_then(Value::as_bool) == Some(false) {
            return Err(format!("asymmetric {what} (group `{name}`)"));
        }
        Ok(())
    };
    float8(w, "weights")?;
    if w.get("dynamic").and_then(Value::as_bool) == Some(true) {
        return Err(format!("dynamically quantized weights (group `{name}`)"));
    }
    let weights = match str_key(w, "strategy").unwrap_or("tensor") {
        "tensor" => WeightScaling::Tensor,
        "channel" => WeightScaling::Channel,
        "block" => block(w.get("block_structure").unwrap_or(&Value::Null), "block_structure")?,
        other => return Err(format!("FP8 weights scaled by strategy `{other}` (group `{name}`)")),
    };
    let activations = match group.get("input_activations").filter(|a| !a.is_null()) {
        None => ActivationScaling::None,
        Some(a) => {
            float8(a, "input activations")?;
            let dynamic = a.get("dynamic").and_then(Value::as_bool).unwrap_or(false);
            match (dynamic, str_key(a, "strategy").unwrap_or("tensor")) {
                (true, "token" | "tensor" | "group") => ActivationScaling::Dynamic,
                (false, "tensor") => ActivationScaling::Static,
                (_, other) => {
                    let kind = if dynamic { "dynamic" } else { "static" };
                    return Err(format!(
                        "{kind} input scales by strategy `{other}` (group `{name}`) are not supported"
                    ));
                }
            }
        }
    };
    Ok(Fp8Checkpoint { method: "compressed-tensors", weights, scale_suffix: "weight_scale", activations })
}

fn block_fp8(q: &Value) -> Result<Fp8Checkpoint, String> {
    if let Some(fmt) = str_key(q, "fmt").filter(|f| *f != "e4m3") {
        return Err(format!("fp8 format `{fmt}`: only e4m3 is read"));
    }
    let activations = match str_key(q, "activation_scheme").unwrap_or("dynamic") {
        "dynamic" => ActivationScaling::Dynamic,
        "static" => ActivationScaling::Static,
        other => return Err(format!("fp8 activation_scheme `{other}`")),
    };
    let (weights, scale_suffix) = match q.get("weight_block_size").filter(|b| !b.is_null()) {
        Some(b) => (block(b, "weight_block_size")?, "weight_scale_inv"),
        None => (WeightScaling::Tensor, "weight_scale"),
    };
    Ok(Fp8Checkpoint { method: "fp8", weights, scale_suffix, activations })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn group(weights: Value, inputs: Value) -> Value {
        json!({"quantization_config": {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": null, "sparsity_config": {},
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}}
        }})
    }

    fn fp8(strategy: &str) -> Value {
        json!({"num_bits": 8, "type": "float", "symmetric": true, "dynamic": false, "strategy": strategy})
    }

    fn scheme(config: &Value) -> Fp8Checkpoint {
        *parse(config).unwrap().unwrap().checkpoint().unwrap()
    }

    #[test]
    fn reads_the_published_fp8_schemes() {
        assert_eq!(parse(&json!({"hidden_size": 8})).unwrap(), None);
        assert_eq!(parse(&json!({"quantization_config": null})).unwrap(), None);

        let dynamic = json!({"num_bits": 8, "type": "float", "symmetric": true, "dynamic": true, "strategy": "token"});
        let s = scheme(&group(fp8("channel"), dynamic));
        assert_eq!(
            (s.weights, s.activations, s.scale_suffix),
            (WeightScaling::Channel, ActivationScaling::Dynamic, "weight_scale")
        );

        let s = scheme(&group(fp8("tensor"), fp8("tensor")));
        assert_eq!((s.weights, s.activations), (WeightScaling::Tensor, ActivationScaling::Static));

        let mut blocked = fp8("block");
        blocked["block_structure"] = json!([128, 128]);
        let s = scheme(&group(blocked, Value::Null));
        assert_eq!(
            (s.weights, s.activations),
            (WeightScaling::Block { rows: 128, cols: 128 }, ActivationScaling::None)
        );

        let qwen = json!({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 64], "modules_to_not_convert": ["lm_head"]}});
        let s = scheme(&qwen);
        assert_eq!(s.weights, WeightScaling::Block { rows: 128, cols: 64 });
        assert_eq!((s.scale_suffix, s.method), ("weight_scale_inv", "fp8"));
        // Earlier llm-compressor releases: `naive-quantized`, `frozen`.
        let mut naive = group(fp8("tensor"), fp8("tensor"));
        naive["quantization_config"]["format"] = json!("naive-quantized");
        naive["quantization_config"]["quantization_status"] = json!("frozen");
        assert_eq!(scheme(&naive).weights, WeightScaling::Tensor);
        let per_tensor = json!({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}});
        let s = scheme(&per_tensor);
        assert_eq!(
            (s.weights, s.activations, s.scale_suffix),
            (WeightScaling::Tensor, ActivationScaling::Static, "weight_scale")
        );
    }

    #[test]
    fn row_scaled_schemes_are_those_the_fp8_gemms_take() {
        let parsed = |config: &Value| parse(config).unwrap().expect("a quantization");
        let dynamic = json!({"num_bits": 8, "type": "float", "symmetric": true, "dynamic": true, "strategy": "token"});
        assert!(parsed(&group(fp8("channel"), dynamic)).scales_whole_rows());
        assert!(parsed(&group(fp8("tensor"), fp8("tensor"))).scales_whole_rows());
        let qwen = json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}});
        assert!(!parsed(&qwen).scales_whole_rows());
        assert!(Quantization::FP8_AT_LOAD.scales_whole_rows());
        assert!(!Quantization::Fp8AtLoad(WeightScaling::Block { rows: 128, cols: 128 }).scales_whole_rows());
    }

    #[test]
    fn refuses_other_formats_naming_them() {
        let refused = |config: Value, needle: &str| {
            let err = parse(&config).unwrap_err();
            assert!(err.contains(needle), "{err:?} should name {needle:?}");
        };
        refused(json!({"quantization_config": {"quant_method": "awq", "bits": 4}}), "`awq`");
        refused(json!({"quantization_config": {"quant_method": "gptq"}}), "`gptq`");
        refused(json!({"quantization_config": {"bits": 4}}), "no `quant_method`");
        let int8 = json!({"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel"});
        refused(group(int8, Value::Null), "8-bit `int`");
        let int4 = json!({"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 128});
        refused(group(int4, Value::Null), "4-bit `int`");
        let mut packed = group(fp8("channel"), Value::Null);
        packed["quantization_config"]["format"] = json!("pack-quantized");
        refused(packed, "`pack-quantized`");
        refused(group(fp8("group"), Value::Null), "strategy `group`");
        refused(group(fp8("channel"), fp8("token")), "static input scales by strategy `token`");
        let mut sparse = group(fp8("channel"), Value::Null);
        sparse["quantization_config"]["sparsity_config"] = json!({"format": "sparse-24-bitmask"});
        refused(sparse, "sparse-24-bitmask");
        refused(json!({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}), "`e5m2`");
        refused(
            json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}),
            "two positive sizes",
        );
    }
}

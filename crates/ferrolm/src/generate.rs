//! `ferrolm generate`: runs one or more prompts through the engine as one continuous batch.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrolm_engine::{GenerateRequest, RequestStream};
use ferrolm_sampling::{GenerationDefaults, SamplingParams};
use serde_json::{json, Value};

use crate::loader::{self, EngineArgs};

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Prompt text; repeat for several prompts, run as one batch.
    #[arg(long)]
    pub prompt: Vec<String>,
    /// A prompt given as token ids: `--prompt-ids 1,2,3`.
    #[arg(long, conflicts_with = "prompt")]
    pub prompt_ids: Option<String>,
    /// JSON lines, each a string, `{"prompt": "..."}` or `{"prompt_ids": [..]}`.
    #[arg(long)]
    pub prompts_file: Option<PathBuf>,
    /// Render each prompt as a user message through the model's chat template.
    #[arg(long)]
    pub chat: bool,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// 0 is greedy; defaults to the model's generation_config.json, else 1.0.
    #[arg(long)]
    pub temperature: Option<f32>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub top_k: Option<i32>,
    #[arg(long)]
    pub min_p: Option<f32>,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop string; repeat for several.
    #[arg(long)]
    pub stop: Vec<String>,
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object per prompt (with `token_ids` and `text`) instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

fn parse_ids(text: &str) -> Result<Vec<u32>> {
    text.split(',')
        .map(|s| s.trim().parse::<u32>().with_context(|| format!("--prompt-ids: `{}` is not a token id", s.trim())))
        .collect()
}

fn read_prompts_file(path: &PathBuf) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let where_ = || format!("{} line {}", path.display(), i + 1);
        let value: Value = serde_json::from_str(line).with_context(|| format!("{}: invalid JSON", where_()))?;
        let prompt = match &value {
            Value::String(s) => Prompt::Text(s.clone()),
            Value::Object(o) => match (o.get("prompt"), o.get("prompt_ids")) {
                (Some(Value::String(s)), _) => Prompt::Text(s.clone()),
                (_, Some(Value::Array(ids))) => Prompt::Ids(
                    ids.iter()
                        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                        .collect::<Option<Vec<u32>>>()
                        .with_context(|| format!("{}: prompt_ids must be token ids", where_()))?,
                ),
                _ => bail!("{}: expected a \"prompt\" string or \"prompt_ids\" list", where_()),
            },
            _ => bail!("{}: expected a string or an object", where_()),
        };
        prompts.push(prompt);
    }
    Ok(prompts)
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let mut prompts: Vec<Prompt> = args.prompt.iter().cloned().map(Prompt::Text).collect();
    if let Some(ids) = &args.prompt_ids {
        prompts.push(Prompt::Ids(parse_ids(ids)?));
    }
    if let Some(path) = &args.prompts_file {
        prompts.extend(read_prompts_file(path)?);
    }
    if prompts.is_empty() {
        bail!("no prompt given: use --prompt TEXT, --prompt-ids 1,2,3 or --prompts-file FILE");
    }

    let loaded = loader::load(&args.engine)?;
    let user = GenerationDefaults {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: None,
        max_tokens: Some(args.max_tokens),
    };
    let params = SamplingParams {
        seed: args.seed,
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
        ..SamplingParams::default()
    }
    .with_defaults(&user.or(&loaded.defaults));

    let mut streams: Vec<(Vec<u32>, RequestStream)> = Vec::with_capacity(prompts.len());
    for prompt in &prompts {
        let ids = match prompt {
            Prompt::Ids(ids) => ids.clone(),
            Prompt::Text(text) if args.chat => {
                let template = loaded.tokenizer.chat_template().context("this model has no chat template")?;
                let rendered =
                    template.render(&[ferrolm_tokenizer::ChatMessage::new("user", text.as_str())], true, None)?;
                loaded.tokenizer.encode(&rendered, false)?
            }
            Prompt::Text(text) => loaded.tokenizer.encode(text, true)?,
        };
        let stream = loaded.engine.submit(GenerateRequest {
            prompt_token_ids: ids.clone(),
            params: params.clone(),
            grammar: None,
        })?;
        streams.push((ids, stream));
    }

    let stream_text = !args.json && streams.len() == 1;
    let stdout = std::io::stdout();
    for (i, (prompt_ids, mut stream)) in streams.into_iter().enumerate() {
        let mut token_ids: Vec<u32> = Vec::new();
        let mut text = String::new();
        let mut finish_reason = None;
        while let Some(out) = stream.blocking_recv() {
            token_ids.extend(&out.token_ids);
            text.push_str(&out.text);
            if stream_text {
                let mut lock = stdout.lock();
                lock.write_all(out.text.as_bytes())?;
                lock.flush()?;
            }
            finish_reason = out.finish_reason.or(finish_reason);
        }
        let finish = finish_reason.map(|f| match f {
            ferrolm_engine::FinishReason::Stop => "stop",
            ferrolm_engine::FinishReason::Length => "length",
            ferrolm_engine::FinishReason::Abort => "abort",
        });
        let mut lock = stdout.lock();
        if args.json {
            let obj = json!({
                "index": i,
                "prompt_token_ids": prompt_ids,
                "token_ids": token_ids,
                "text": text,
                "finish_reason": finish,
            });
            writeln!(lock, "{obj}")?;
        } else if stream_text {
            writeln!(lock)?;
        } else {
            writeln!(
                lock,
                "--- prompt {i} ({} tokens, finish: {}) ---\n{text}",
                token_ids.len(),
                finish.unwrap_or("?")
            )?;
        }
    }
    Ok(())
}

#!/usr/bin/env python3
"""Trains the small demo model that ships with ferrolm (models/ferrolm-demo-py).

A Llama-architecture model of about 7.3M parameters that continues Python code. Everything it
learns from is already on the machine it runs on, so it needs no download:
  - the Python source of the running interpreter's standard library (PSF licence), all `*.py`;
  - `*.py` files of installed distributions whose metadata declares a permissive licence (MIT, BSD,
    Apache, PSF, ISC; anything naming GPL, MPL or nothing at all is left out, and so are vendored
    copies of other projects), up to `--max-bytes` of text in all.
Files are read in a fixed order, exact duplicates dropped, and a fixed ~1% of them (by a hash of
their name) held out for validation. Documents are separated by `</s>`.

Steps: byte-level BPE tokenizer (HF tokenizers) -> `LlamaForCausalLM` trained in bf16 autocast for
a fixed wall-clock budget -> saved in Hugging Face layout with bf16 weights -> held-out loss of the
saved weights -> `reference.json`, golden outputs of HF transformers (float32, eager attention) on
the saved directory, in the shape of testdata/fixtures/*/reference.json.

Run on a GPU machine (the whole script is built to finish in under 8 minutes on one H200):
    python3 tools/train_demo_model.py --out models/ferrolm-demo-py
A smoke test on a CPU:
    python3 tools/train_demo_model.py --out /tmp/demo --tiny --device cpu --max-bytes 4e6 --train-seconds 20
"""

import argparse
import hashlib
import importlib.metadata as metadata
import json
import math
import multiprocessing
import os
import random
import re
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
REFERENCE_PROMPTS = [
    "def fibonacci(n):",
    "import os\n",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
]
SAMPLE_PROMPTS = REFERENCE_PROMPTS + [
    "def read_json(path):\n",
    "    def __repr__(self):\n",
]
TOKENIZE_TEXTS = [
    "def forward(self, hidden_states):",
    "if __name__ == \"__main__\":\n    main()\n",
    "        return {k: v for k, v in items.items() if v is not None}\n",
    "The quick brown fox jumps over the lazy dog.",
    "h\u00e9llo w\u00f6rld \u2713 \U0001f642",
]
REFERENCE_STEPS = 32

PERMISSIVE = re.compile(r"\b(mit|bsd|apache|psf|isc)\b|python software foundation|0bsd|zlib", re.I)
NOT_PERMISSIVE = re.compile(r"gpl|general public|\bmpl\b|mozilla|proprietary|commercial|unknown", re.I)
SKIP_PARTS = {"_vendor", "vendor", "vendored", "_vendored", "site-packages", "dist-packages", "__pycache__"}
MAX_FILE_BYTES = 512 * 1024
MAX_LINE_CHARS = 400

START = time.time()


def log(msg):
    print(f"[{time.time() - START:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def read_source(path):
    """The file's text, or None for files that are not clean UTF-8 source (binary, generated
    tables, minified or data-heavy code)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    text = text.replace("\r\n", "\n")
    if len(text) < 64 or "\x00" in text:
        return None
    if max(len(line) for line in text.split("\n")) > MAX_LINE_CHARS:
        return None
    return text


def stdlib_files():
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if not SKIP_PARTS.intersection(p.relative_to(root).parts))
    return [(f"stdlib/{p.relative_to(root).as_posix()}", p) for p in paths]


def licence_text(dist):
    meta = dist.metadata
    parts = [meta.get("License-Expression") or "", (meta.get("License") or "")[:300]]
    parts += [c for c in (meta.get_all("Classifier") or []) if c.startswith("License ::")]
    return " ".join(parts)


def permissive_dists():
    """Installed distributions whose declared licence is permissive, one per name, sorted."""
    seen, chosen = set(), []
    for dist in metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
        if not name or name in seen:
            continue
        seen.add(name)
        lic = licence_text(dist)
        if PERMISSIVE.search(lic) and not NOT_PERMISSIVE.search(lic):
            chosen.append((name, dist.version, dist))
        else:
            log(f"  skip {name} {dist.version}: licence {lic[:60]!r}")
    return sorted(chosen, key=lambda c: c[0])


def site_files(seed):
    files = []
    for name, version, dist in permissive_dists():
        for f in dist.files or []:
            if f.suffix != ".py" or SKIP_PARTS.intersection(f.parts) or ".." in f.parts:
                continue
            files.append((f"site/{name}/{f.as_posix()}", Path(dist.locate_file(f))))
    files.sort(key=lambda x: x[0])
    # NOTE: a seeded shuffle so that a byte cap takes a little of every package, not the first
    # packages of the alphabet.
    random.Random(seed).shuffle(files)
    return files


def is_heldout(name):
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) % 100 == 0


def collect(args):
    """Returns (train, heldout) lists of document texts."""
    candidates = stdlib_files()
    if args.site_packages:
        candidates += site_files(args.seed)
    train, heldout, hashes = [], [], set()
    total, per_source = 0, {}
    for name, path in candidates:
        if total >= args.max_bytes:
            break
        text = read_source(path)
        if text is None:
            continue
        digest = hashlib.sha1(text.encode()).digest()
        if digest in hashes:
            continue
        hashes.add(digest)
        (heldout if is_heldout(name) else train).append(text)
        total += len(text.encode())
        source = name.split("/")[0] if name.startswith("stdlib/") else "/".join(name.split("/")[:2])
        per_source[source] = per_source.get(source, 0) + len(text.encode())
    log(f"data: {len(train)} train files, {len(heldout)} held-out files, {total / 1e6:.1f} MB of text")
    top = sorted(per_source.items(), key=lambda kv: -kv[1])
    log("  by source (MB): " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in top[:40]))
    log(f"  {len(per_source)} sources in all")
    return train, heldout


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def train_tokenizer(docs, vocab_size, sample_bytes, seed):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    sample, size = [], 0
    for i in order:
        if size >= sample_bytes:
            break
        sample.append(docs[i])
        size += len(docs[i])
    tok.train_from_iterator(sample, trainer=trainer, length=len(sample))
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"{t} must have id {i}"
    log(f"tokenizer: vocab {tok.get_vocab_size()}, trained on {size / 1e6:.1f} MB")
    return tok


_DOCS = []  # the documents a forked encoding worker reads, by index
_WORKER_TOKENIZER = None


def _init_encoder(tokenizer_json):
    global _WORKER_TOKENIZER
    # One thread per worker process: the parallelism is the processes'.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOKENIZER = Tokenizer.from_str(tokenizer_json)


def _encode_range(bounds):
    parts = []
    for enc in _WORKER_TOKENIZER.encode_batch(_DOCS[bounds[0] : bounds[1]], add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.int32))
        parts.append(np.asarray([EOS_ID], dtype=np.int32))
    return np.concatenate(parts)


def encode_docs(tok, docs):
    """All documents as one stream, each followed by `</s>`: int32 `[num_tokens]`.

    NOTE: a pool of forked processes rather than `encode_batch`'s own threads, which were seen
    to use a single core; the fork happens before CUDA is touched."""
    global _DOCS
    _DOCS = docs
    ranges = [(i, min(i + 64, len(docs))) for i in range(0, len(docs), 64)]
    workers = max(1, min(len(ranges), os.cpu_count() or 1))
    with multiprocessing.get_context("fork").Pool(workers, _init_encoder, (tok.to_str(),)) as pool:
        parts = pool.map(_encode_range, ranges, chunksize=4)
    _DOCS = []
    return np.concatenate(parts)


# ---------------------------------------------------------------------------------------------
# Model and training
# ---------------------------------------------------------------------------------------------


def model_config(args, vocab_size):
    if args.tiny:
        shape = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    else:
        shape = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64)
    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=args.ctx,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **shape,
    )


def windows(stream, ctx):
    """Non-overlapping `[n, ctx + 1]` windows of a token stream (targets overlap by one)."""
    n = (len(stream) - 1) // ctx
    idx = torch.arange(n)[:, None] * ctx + torch.arange(ctx + 1)[None, :]
    return stream[idx]


@torch.no_grad()
def heldout_loss(model, stream, ctx, batch, device, max_windows=None, autocast=True):
    """Mean loss per token over the held-out stream."""
    model.eval()
    w = windows(stream, ctx)
    if max_windows is not None:
        w = w[:max_windows]
    total, count = 0.0, 0
    for i in range(0, len(w), batch):
        chunk = w[i : i + batch].to(device).long()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += chunk[:, 1:].numel()
    model.train()
    return total / count


def train(args, model, train_stream, heldout_stream, device):
    torch.manual_seed(args.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    vocab = model.config.vocab_size

    def loss_fn(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.float().view(-1, vocab), y.reshape(-1))

    step_fn = loss_fn
    if args.compile:
        step_fn = torch.compile(loss_fn)

    data = train_stream.to(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    offsets = torch.arange(args.ctx + 1, device=device)

    def batch():
        starts = torch.randint(0, len(data) - args.ctx - 1, (args.batch,), device=device, generator=gen)
        chunk = data[starts[:, None] + offsets[None, :]].long()
        return chunk[:, :-1], chunk[:, 1:]

    t0 = time.time()
    # Leave time for the held-out loss, saving and the reference outputs.
    end = min(t0 + args.train_seconds, START + args.total_seconds - args.reserve_seconds)
    log(f"training until {end - START:.0f}s: batch {args.batch} x {args.ctx} tokens, peak lr {args.lr}")
    step, tokens, last_log, last_eval = 0, 0, t0, t0
    loop_start, loop_span = None, None
    while True:
        now = time.time()
        if now >= end:
            break
        if loop_start is None:
            frac = 0.0
        else:
            frac = min(1.0, (now - loop_start) / loop_span)
        warm = min(1.0, (step + 1) / args.warmup_steps)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch()
        try:
            loss = step_fn(x, y)
            loss.backward()
        except Exception as e:  # noqa: BLE001 - torch.compile failures surface here, on step 0
            if step != 0 or step_fn is loss_fn:
                raise
            log(f"torch.compile failed ({type(e).__name__}: {str(e)[:200]}); training eagerly")
            opt.zero_grad(set_to_none=True)
            step_fn = loss_fn
            loss = step_fn(x, y)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.numel()
        if step == 1:
            # The first step holds the compile; the cosine schedule runs over the rest.
            first_loss = loss.item()
            loop_start = time.time()
            loop_span = max(1.0, end - loop_start)
            log(f"step 1 (compile and warm-up) done, loss {first_loss:.3f}")
        now = time.time()
        if now - last_log >= args.log_every:
            log(f"step {step}: loss {loss.item():.3f}, lr {lr:.2e}, {tokens / 1e6:.0f}M tokens, "
                f"{tokens / (now - t0) / 1e6:.2f}M tokens/s")
            last_log = now
        if now - last_eval >= args.eval_every:
            val = heldout_loss(model, heldout_stream, args.ctx, args.batch, device, max_windows=128)
            log(f"step {step}: held-out loss (128 windows) {val:.3f}")
            last_eval = time.time()
    train_time = time.time() - t0
    log(f"trained {step} steps, {tokens / 1e6:.0f}M tokens in {train_time:.0f}s "
        f"({tokens / len(data):.1f} passes over the training data)")
    return {"steps": step, "tokens": tokens, "seconds": train_time}


# ---------------------------------------------------------------------------------------------
# Saving and reference outputs
# ---------------------------------------------------------------------------------------------


def save(args, model, tok, out):
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "backend": "tokenizers",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": args.ctx,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    # Sampling by default: greedy decoding of a model this small falls into loops sooner.
    generation_config = {
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "do_sample": True,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_new_tokens": 128,
        "transformers_version": transformers.__version__,
    }
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    size = (out / "model.safetensors").stat().st_size
    log(f"saved to {out}: model.safetensors {size} bytes ({size / 2**20:.2f} MiB)")


def load_f32(out, device):
    return transformers.LlamaForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).to(device).eval()


@torch.no_grad()
def reference(out, tok):
    """Golden outputs of HF transformers on the saved directory, float32 on the CPU."""
    model = load_f32(out, torch.device("cpu"))
    cases = []
    for prompt in REFERENCE_PROMPTS:
        prompt_ids = tok.encode(prompt, add_special_tokens=False).ids
        lp = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0].double(), dim=-1)
        prompt_logprobs = [None] + [lp[i - 1, prompt_ids[i]].item() for i in range(1, len(prompt_ids))]
        ids, steps = list(prompt_ids), []
        for _ in range(REFERENCE_STEPS):
            logits = model(torch.tensor([ids])).logits[0, -1]
            lp = torch.log_softmax(logits.double(), dim=-1)
            top = torch.topk(lp, 5)
            top5 = [[int(i), float(v)] for v, i in zip(top.values, top.indices)]
            steps.append({"top5": top5, "margin": top5[0][1] - top5[1][1]})
            ids.append(top5[0][0])
        greedy = ids[len(prompt_ids) :]
        # Cross-check with HF's own greedy search, up to its first end-of-sequence token.
        hf = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=REFERENCE_STEPS,
                            eos_token_id=EOS_ID, pad_token_id=PAD_ID)[0, len(prompt_ids) :].tolist()
        if hf != greedy[: len(hf)]:
            log(f"WARNING: generate() differs from the step-by-step greedy run for {prompt!r}")
        cases.append({
            "prompt": prompt,
            "prompt_ids": prompt_ids,
            "prompt_logprobs": prompt_logprobs,
            "greedy_ids": greedy,
            "greedy_text": tok.decode(greedy, skip_special_tokens=False),
            "steps": steps,
        })
    return {
        "arch": "LlamaForCausalLM",
        "hf_transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32 (bf16 weights upcast), eager attention, CPU",
        "tokenize": [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in TOKENIZE_TEXTS],
        "cases": cases,
        "layout": "prompt_ids are the prompt's tokens with no special tokens (no BOS); "
                  f"greedy_ids are {REFERENCE_STEPS} greedy tokens, steps[j] the top-5 [id, logprob] "
                  "at step j and the margin between the best two",
    }


@torch.no_grad()
def samples(model, tok, device, seed):
    for do_sample in (False, True):
        title = "sampled, temperature 0.7, top_p 0.95" if do_sample else "greedy"
        print(f"\n===== samples ({title}) =====", flush=True)
        torch.manual_seed(seed)
        for prompt in SAMPLE_PROMPTS:
            ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids], device=device)
            kw = dict(do_sample=True, temperature=0.7, top_p=0.95, top_k=0) if do_sample else dict(do_sample=False)
            outp = model.generate(ids, max_new_tokens=96, eos_token_id=EOS_ID, pad_token_id=PAD_ID, **kw)
            text = tok.decode(outp[0].tolist(), skip_special_tokens=False)
            print(f"----- {prompt!r}\n{text}\n", flush=True)


def check_hf_tokenizer(out, tok):
    """The saved tokenizer files load in HF and encode as the raw tokenizer does (no BOS)."""
    hf = transformers.AutoTokenizer.from_pretrained(out)
    for text in REFERENCE_PROMPTS + TOKENIZE_TEXTS:
        got = hf(text)["input_ids"]
        want = tok.encode(text, add_special_tokens=False).ids
        if got != want:
            log(f"WARNING: AutoTokenizer gives {got[:8]}... for {text!r}, tokenizer.json gives {want[:8]}...")
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    log(f"chat template renders {chat!r}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", help="default: cuda when present, else cpu")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-bytes", type=float, default=250e6, help="cap on training text, bytes")
    p.add_argument("--no-site-packages", dest="site_packages", action="store_false")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--tokenizer-bytes", type=float, default=24e6, help="text the tokenizer is trained on")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--train-seconds", type=float, default=330)
    p.add_argument("--total-seconds", type=float, default=450, help="whole-script budget")
    p.add_argument("--reserve-seconds", type=float, default=45, help="kept after training for eval and saving")
    p.add_argument("--log-every", type=float, default=15)
    p.add_argument("--eval-every", type=float, default=60)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--temperature", type=float, default=0.7, help="default in generation_config.json")
    p.add_argument("--top-p", type=float, default=0.95, help="default in generation_config.json")
    p.add_argument("--tiny", action="store_true", help="a tiny model, for a quick check of the script")
    args = p.parse_args()

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    transformers.utils.logging.disable_progress_bar()
    log(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")

    # Data and tokens first: the encoding workers are forked, so CUDA must not be touched yet.
    train_docs, heldout_docs = collect(args)
    tok = train_tokenizer(train_docs, args.vocab_size, args.tokenizer_bytes, args.seed)
    train_stream = torch.from_numpy(encode_docs(tok, train_docs))
    heldout_stream = torch.from_numpy(encode_docs(tok, heldout_docs))
    heldout_bytes = sum(len(d.encode()) + 1 for d in heldout_docs)
    log(f"tokens: {len(train_stream) / 1e6:.1f}M train, {len(heldout_stream) / 1e6:.2f}M held out "
        f"({heldout_bytes / len(heldout_stream):.2f} bytes/token held out)")
    del train_docs

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    log(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")

    config = model_config(args, tok.get_vocab_size())
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params} parameters ({n_params * 2 / 2**20:.2f} MiB in bf16), "
        f"hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"{config.num_attention_heads}/{config.num_key_value_heads} heads of {config.head_dim}, "
        f"intermediate {config.intermediate_size}, vocab {config.vocab_size}, context {config.max_position_embeddings}")

    stats = train(args, model, train_stream, heldout_stream, device)
    save(args, model, tok, args.out)
    del model

    shipped = load_f32(args.out, device)
    loss = heldout_loss(shipped, heldout_stream, args.ctx, 64, device, autocast=False)
    bits_per_byte = loss * len(heldout_stream) / heldout_bytes / math.log(2)
    log(f"HELD-OUT LOSS (saved bf16 weights, float32): {loss:.4f} per token, "
        f"perplexity {math.exp(loss):.2f}, {bits_per_byte:.3f} bits per byte, "
        f"{len(heldout_stream)} tokens of {len(heldout_docs)} held-out files")
    log(f"training: {stats['steps']} steps, {stats['tokens'] / 1e6:.0f}M tokens, {stats['seconds']:.0f}s")

    ref = reference(args.out, tok)
    (args.out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    log("wrote reference.json")
    for case in ref["cases"]:
        margins = [s["margin"] for s in case["steps"]]
        log(f"  {case['prompt']!r}: {len(case['prompt_ids'])} prompt tokens, smallest margin {min(margins):.2e}")
    check_hf_tokenizer(args.out, tok)
    samples(shipped, tok, device, args.seed)
    log(f"files: {sorted(f.name for f in args.out.iterdir())}")
    log("done")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The `ferrolm bench throughput` and `ferrolm bench latency` workloads run through Hugging Face
transformers, printing the same table and writing the same JSON keys, so that one run on a GPU
machine compares ferrolm with its peer on the same model shape.

The model is built with random weights from a config.json (the files in bench-configs/), so no
download is needed:

    python3 tools/peer_hf.py latency --model-config bench-configs/llama-3.1-8b.json \\
        --input-len 128 --output-len 128 --num-iters 10 --json hf-latency.json
    python3 tools/peer_hf.py throughput --model-config bench-configs/llama-3.1-8b.json \\
        --num-prompts 256 --input-len 512 --output-len 256 --json hf-throughput.json

- latency: `generate()` with a static KV cache, one request at a time; a streamer timestamps every
  token (TTFT, ITL, TPOT). The machine's memory read rate is measured in the same run (a
  reduction over a buffer far larger than the caches) and gives the batch-1 decode limit.
- throughput: `generate_batch()` (continuous batching, paged attention) when this transformers
  has it, else `generate()` over left-padded batches of --batch-size prompts.

The workload has the same shape as ferrolm's (counts, lengths, --random-range-ratio bounds,
special ids kept out of prompts) but not the same token ids: ferrolm draws them from ChaCha8.
With random weights EOS can be sampled early: `min_new_tokens` prevents it in `generate()`; in
`generate_batch()` (one config for all requests, and no per-request output length) the tokens
actually produced are counted, and --random-range-ratio varies the prompt lengths only.
"""

import argparse
import json
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---------------------------------------------------------------------------------------------
# Workload (same shape as ferrolm's crates/ferrolm/src/bench/workload.rs)


def sample_lengths(rng, n, length, ratio):
    """n lengths uniform over the integers in [floor(len*(1-R)), floor(len*(1+R))], at least 1."""
    lo = max(1, math.floor(length * (1 - ratio)))
    hi = max(lo, math.floor(length * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def special_ids(config):
    ids = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return sorted(i for i in ids if 0 <= i < config.vocab_size)


def sample_prompt(rng, length, vocab_size, excluded):
    """Token ids uniform over the vocabulary minus `excluded` (a sorted list)."""
    allowed = vocab_size - len(excluded)
    out = []
    for _ in range(length):
        token = rng.randrange(allowed)
        for e in excluded:  # rank among allowed ids -> id
            if e <= token:
                token += 1
            else:
                break
        out.append(token)
    return out


# ---------------------------------------------------------------------------------------------
# Metrics (same definitions and keys as crates/ferrolm/src/bench/metrics.rs)


def percentile(sorted_values, p):
    if not sorted_values:
        return 0.0
    if len(sorted_values) == 1:
        return sorted_values[0]
    rank = min(max(p / 100.0, 0.0), 1.0) * (len(sorted_values) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def summarize(values):
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(values)
    return {
        "mean": statistics.fmean(values),
        "median": percentile(s, 50),
        "std": statistics.pstdev(values),
        "p90": percentile(s, 90),
        "p99": percentile(s, 99),
    }


def latency_summaries(timings):
    """timings: dicts with ttft, itl (list), latency (seconds) and output_len."""
    ms = 1000.0
    ttft = [t["ttft"] * ms for t in timings]
    tpot = [(t["latency"] - t["ttft"]) / (t["output_len"] - 1) * ms for t in timings if t["output_len"] > 1]
    itl = [gap * ms for t in timings for gap in t["itl"]]
    e2el = [t["latency"] * ms for t in timings]
    return {"ttft": summarize(ttft), "tpot": summarize(tpot), "itl": summarize(itl), "e2el": summarize(e2el)}


def insert_summaries(results, summaries):
    for name, s in summaries.items():
        for stat in ("mean", "median", "std", "p90", "p99"):
            results[f"{stat}_{name}_ms"] = s[stat]


# ---------------------------------------------------------------------------------------------
# Report (same table layout and header keys as crates/ferrolm/src/bench/report.rs)

LABEL_WIDTH, VALUE_WIDTH = 44, 14


class Table:
    def __init__(self, title):
        self.lines = []
        self.rule(title, "=")

    def rule(self, title, fill):
        width = LABEL_WIDTH + VALUE_WIDTH + 1
        title = f" {title} " if title else ""
        left = max(0, width - len(title)) // 2
        self.lines.append(fill * left + title + fill * max(0, width - len(title) - left))

    def text(self, label, value):
        self.lines.append(f"{label + ':':<{LABEL_WIDTH}} {str(value):>{VALUE_WIDTH}}")
        return self

    def num(self, label, value):
        return self.text(label, f"{value:.2f}")

    def latency(self, title, short, s):
        self.rule(title, "-")
        self.num(f"Mean {short} (ms)", s["mean"])
        self.num(f"Median {short} (ms)", s["median"])
        self.num(f"P90 {short} (ms)", s["p90"])
        return self.num(f"P99 {short} (ms)", s["p99"])

    def latencies(self, s):
        self.latency("Time to First Token", "TTFT", s["ttft"])
        self.latency("Time per Output Token (excl. 1st token)", "TPOT", s["tpot"])
        self.latency("Inter-token Latency", "ITL", s["itl"])
        return self.latency("End-to-end Latency", "E2EL", s["e2el"])

    def print(self):
        self.rule("", "=")
        print("\n".join(self.lines), flush=True)


def machine(device):
    cpu_model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory_bytes = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    memory_bytes = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    info = {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model,
        "num_cpus": os.cpu_count(),
        "memory_bytes": memory_bytes,
        "memory_gib": memory_bytes / 2**30 if memory_bytes else None,
        "os": platform.system().lower(),
        "arch": platform.machine(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_bytes"] = props.total_memory
        info["gpu_count"] = torch.cuda.device_count()
    return info


def git_revision():
    if os.environ.get("FERROLM_GIT_REVISION"):
        return os.environ["FERROLM_GIT_REVISION"]
    for cwd in (os.getcwd(), os.path.dirname(os.path.abspath(__file__))):
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True)
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            continue
    return "unknown"


def header(bench, args, device):
    return {
        "bench": bench,
        "peer": "hf-transformers",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "git_revision": git_revision(),
        "command": sys.argv,
        "flags": vars(args),
        "machine": machine(device),
        "device": device.type,
    }


def write_json(path, results):
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print(f"results written to {path}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Model


def load_config(path):
    with open(path) as f:
        raw = json.load(f)
    model_type = raw.pop("model_type", None)
    if model_type is None:
        sys.exit(f"{path}: no model_type")
    return AutoConfig.for_model(model_type, **raw)


def build_model(args, device):
    config = load_config(args.model_config)
    dtype_name = args.dtype or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16"
    if isinstance(dtype_name, torch.dtype):
        dtype_name = {v: k for k, v in DTYPES.items()}[dtype_name]
    dtype = DTYPES[str(dtype_name)]
    torch.manual_seed(args.weight_seed)
    # transformers 5 names the argument `dtype`, 4.x `torch_dtype`.
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    start = time.perf_counter()
    with device:
        model = AutoModelForCausalLM.from_config(config, **{dtype_kw: dtype})
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize()
    load_seconds = time.perf_counter() - start
    return model, config, dtype_name, load_seconds


def weight_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def weight_bytes_per_token(model, config):
    """Bytes one decode step reads: every weight, but only one row of an untied embedding."""
    total = weight_bytes(model)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    if tied:
        return total
    return total - embed.numel() * embed.element_size() + embed.shape[1] * embed.element_size()


def head_dim(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_context_token(config, dtype):
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim(config) * torch.tensor([], dtype=dtype).element_size()


def describe(model, config, dtype_name, source):
    n = sum(p.numel() for p in model.parameters())
    return {
        "source": f"{source} (random weights)",
        "architecture": (config.architectures or [type(model).__name__])[0],
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "head_dim": head_dim(config),
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "num_parameters": n,
        "weight_bytes": weight_bytes(model),
        "dtype": dtype_name,
    }


def model_label(config, model):
    n = sum(p.numel() for p in model.parameters())
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    return f"{(config.architectures or ['?'])[0]} {size}"


def generation_config(config, output_len, temperature, force_length, cache_implementation=None):
    """Greedy (or plain temperature sampling, no top-k/top-p, as ferrolm's benchmark does)."""
    eos = getattr(config, "eos_token_id", None)
    pad = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else (
        eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else 0
    )
    kwargs = dict(max_new_tokens=output_len, pad_token_id=pad, eos_token_id=eos, top_k=None, top_p=1.0)
    if force_length:
        kwargs["min_new_tokens"] = output_len  # EOS cannot end a request early
    if cache_implementation:
        kwargs["cache_implementation"] = cache_implementation
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature)
    else:
        kwargs.update(do_sample=False, temperature=None)
    return GenerationConfig(**kwargs)


# ---------------------------------------------------------------------------------------------
# Memory bandwidth


def measure_bandwidth(device, buffer_mb, repetitions):
    """Best-of-N read rate of a buffer far larger than the caches: a decode step only reads, so
    its ceiling is what the memory streams to a kernel that only reads (`ferrolm bench` prices
    its limits the same way). On CUDA the read is torch's sum over f32 words, five reads queued
    behind an untimed one per timing (a lone read between two events also times its launch); a
    reduction may stream a little below ferrolm's own read kernel, which would put this limit
    below ferrolm's and the fraction reached above it."""
    n = buffer_mb << 20
    if device.type == "cuda":
        src = torch.rand(n // 4, dtype=torch.float32, device=device) + 1.0  # never time on zeros
        queued = 5
        best = math.inf
        for _ in range(max(1, repetitions)):
            src.sum()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(queued):
                src.sum()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / 1000.0 / queued)
        del src
        torch.cuda.empty_cache()
        return n / best
    buf = torch.randint(1, 255, (n // 8,), dtype=torch.int64)
    best = math.inf
    for _ in range(max(1, repetitions)):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return n / best


# ---------------------------------------------------------------------------------------------
# Latency


class TokenTimes(BaseStreamer):
    """Timestamps each batch of new tokens that generate() streams. generate() puts the prompt
    first, then one token per step (already copied to the host, so the device has finished it)."""

    def __init__(self):
        self.times = []
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_latency(args):
    device = torch.device(args.device)
    print(f"measuring memory bandwidth ({args.bandwidth_buffer_mb} MiB buffer)...", file=sys.stderr)
    bandwidth = measure_bandwidth(device, args.bandwidth_buffer_mb, args.bandwidth_repetitions)
    model, config, dtype_name, load_seconds = build_model(args, device)
    rng = random.Random(args.seed)
    excluded = special_ids(config)
    gen = generation_config(
        config, args.output_len, args.temperature, force_length=True, cache_implementation="static"
    )
    timings = []
    total = args.num_iters_warmup + args.num_iters
    for i in range(total):
        prompt = sample_prompt(rng, args.input_len, config.vocab_size, excluded)
        input_ids = torch.tensor([prompt], device=device)
        streamer = TokenTimes()
        if device.type == "cuda":
            torch.cuda.synchronize()
        sent = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=gen,
                streamer=streamer,
            )
        if not streamer.times:
            sys.exit(f"iteration {i}: no token was streamed")
        t = streamer.times
        timing = {
            "ttft": t[0] - sent,
            "itl": [b - a for a, b in zip(t, t[1:])],
            "latency": t[-1] - sent,
            "output_len": len(t),
        }
        if i >= args.num_iters_warmup:
            timings.append(timing)
        print(f"latency {i + 1}/{total}", file=sys.stderr, end="\r")
    print(file=sys.stderr)

    summaries = latency_summaries(timings)
    decode_tokens = sum(t["output_len"] - 1 for t in timings)
    decode_seconds = sum(t["latency"] - t["ttft"] for t in timings)
    decode_rate = decode_tokens / decode_seconds if decode_seconds > 0 else 0.0
    mean_context = args.input_len + args.output_len / 2.0
    kv_per_token = kv_bytes_per_context_token(config, DTYPES[dtype_name])
    per_token = weight_bytes_per_token(model, config) + kv_per_token * mean_context
    limit = bandwidth / per_token

    table = Table("Latency Benchmark Result (HF transformers)")
    table.text("Model", model_label(config, model)).text("Device", device.type)
    table.num("Mean E2E latency (ms)", summaries["e2el"]["mean"]).num("Decode throughput (tok/s)", decode_rate)
    table.latency("Time to First Token", "TTFT", summaries["ttft"])
    table.latency("Time per Output Token (excl. 1st token)", "TPOT", summaries["tpot"])
    table.latency("Inter-token Latency", "ITL", summaries["itl"])
    table.rule("Batch-1 Decode Bandwidth Limit", "-")
    table.num("Memory bandwidth (GB/s)", bandwidth / 1e9)
    table.num("Bytes read per decode token (MB)", per_token / 1e6)
    table.num("Decode limit (tok/s)", limit).num("Decode rate reached (tok/s)", decode_rate)
    table.text("Fraction of limit", f"{decode_rate / limit * 100:.1f}%")
    table.print()

    if args.json:
        r = header("latency", args, device)
        r.update(
            dtype=dtype_name,
            model=describe(model, config, dtype_name, args.model_config),
            load_seconds=load_seconds,
            input_len=args.input_len,
            output_len=args.output_len,
            num_iters=args.num_iters,
            num_iters_warmup=args.num_iters_warmup,
        )
        insert_summaries(r, summaries)
        r.update(
            output_throughput=decode_rate,
            avg_latency=summaries["e2el"]["mean"] / 1000.0,
            latencies=[t["latency"] for t in timings],
            memory_bandwidth_gbps=bandwidth / 1e9,
            bandwidth_buffer_bytes=args.bandwidth_buffer_mb << 20,
            bandwidth_repetitions=args.bandwidth_repetitions,
            weight_bytes_per_token=weight_bytes_per_token(model, config),
            kv_bytes_per_context_token=kv_bytes_per_context_token(config, DTYPES[dtype_name]),
            mean_decode_context=mean_context,
            bytes_per_decode_token=per_token,
            decode_limit_tokens_per_s=limit,
            fraction_of_limit=decode_rate / limit,
        )
        write_json(args.json, r)


# ---------------------------------------------------------------------------------------------
# Throughput


def run_generate_batch(model, prompts, gen):
    """Continuous batching; returns the number of tokens each request produced."""
    outputs = model.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
    return [len(out.generated_tokens) for out in outputs.values()]


def run_padded_batches(model, prompts, gen, batch_size, pad_id, device):
    """Plain generate() over left-padded batches; every request runs to max_new_tokens."""
    counts = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, generation_config=gen)
        counts.extend([out.shape[1] - width] * len(batch))
    return counts


def run_throughput(args):
    device = torch.device(args.device)
    model, config, dtype_name, load_seconds = build_model(args, device)
    rng = random.Random(args.seed)
    excluded = special_ids(config)
    input_lens = sample_lengths(rng, args.num_prompts, args.input_len, args.random_range_ratio)
    prompts = [sample_prompt(rng, n, config.vocab_size, excluded) for n in input_lens]

    use_cb = hasattr(model, "generate_batch") and not args.no_continuous_batching
    cb_gen = generation_config(config, args.output_len, args.temperature, force_length=False)
    gen = generation_config(config, args.output_len, args.temperature, force_length=True)
    pad_id = gen.pad_token_id if gen.pad_token_id is not None else 0

    def run(batch):
        if use_cb:
            return run_generate_batch(model, batch, cb_gen)
        return run_padded_batches(model, batch, gen, args.batch_size, pad_id, device)

    # Warm-up (CUDA graphs, compilation, allocator) on a few prompts, untimed; it also finds out
    # whether this transformers' continuous batching runs on this model.
    warmup = prompts[: min(4, len(prompts))]
    try:
        run(warmup)
    except Exception as err:  # noqa: BLE001 - any failure of the optional path falls back
        if not use_cb:
            raise
        print(f"generate_batch failed ({err!r}); falling back to batched generate()", file=sys.stderr)
        use_cb = False
        run(warmup)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    counts = run(prompts)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

    n = len(prompts)
    total_in, total_out = sum(input_lens), sum(counts)
    method = "generate_batch (continuous batching)" if use_cb else f"generate (batches of {args.batch_size})"
    table = Table("Offline Throughput Benchmark Result (HF transformers)")
    table.text("Model", model_label(config, model)).text("Device", device.type)
    table.text("Successful requests", n).num("Benchmark duration (s)", elapsed)
    table.text("Total input tokens", total_in).text("Total generated tokens", total_out)
    table.num("Request throughput (req/s)", n / elapsed)
    table.num("Output token throughput (tok/s)", total_out / elapsed)
    table.num("Total token throughput (tok/s)", (total_in + total_out) / elapsed)
    table.print()
    print(f"method: {method}", file=sys.stderr)

    if args.json:
        r = header("throughput", args, device)
        r.update(
            method=method,
            dtype=dtype_name,
            model=describe(model, config, dtype_name, args.model_config),
            load_seconds=load_seconds,
            num_prompts=n,
            completed=n,
            failed=0,
            input_len=args.input_len,
            output_len=args.output_len,
            random_range_ratio=args.random_range_ratio,
            elapsed_time=elapsed,
            total_input_tokens=total_in,
            total_output_tokens=total_out,
            request_throughput=n / elapsed,
            output_throughput=total_out / elapsed,
            total_token_throughput=(total_in + total_out) / elapsed,
            num_requests=n,
            total_num_tokens=total_in + total_out,
            requests_per_second=n / elapsed,
            tokens_per_second=(total_in + total_out) / elapsed,
        )
        write_json(args.json, r)


# ---------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)

    def common(p):
        p.add_argument("--model-config", required=True, help="a Hugging Face config.json (random weights)")
        p.add_argument("--dtype", choices=sorted(DTYPES), help="default: the config's")
        p.add_argument("--device", default="cuda")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--weight-seed", type=int, default=0)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--json", help="write every figure to this file")

    t = sub.add_parser("throughput", help="offline throughput, all requests at once")
    common(t)
    t.add_argument("--num-prompts", type=int, default=100)
    t.add_argument("--input-len", type=int, default=128)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--random-range-ratio", type=float, default=0.0)
    t.add_argument("--batch-size", type=int, default=64, help="batch of plain generate() without generate_batch")
    t.add_argument(
        "--no-continuous-batching", action="store_true", help="use batched generate() even if generate_batch exists"
    )

    lat = sub.add_parser("latency", help="one request at a time, static KV cache")
    common(lat)
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters", type=int, default=10)
    lat.add_argument("--num-iters-warmup", type=int, default=1, help="the first also pays for torch.compile")
    lat.add_argument("--bandwidth-buffer-mb", type=int, default=1024)
    lat.add_argument("--bandwidth-repetitions", type=int, default=5)

    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device: pass --device cpu for a (slow) check run")
    if args.bench == "throughput":
        if not 0 <= args.random_range_ratio < 1:
            sys.exit("--random-range-ratio must be in [0, 1)")
        run_throughput(args)
    else:
        run_latency(args)


if __name__ == "__main__":
    main()

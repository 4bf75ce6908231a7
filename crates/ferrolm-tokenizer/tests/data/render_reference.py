"""Renders a chat template the way HF transformers' apply_chat_template does (Jinja2
sandbox, trim_blocks, lstrip_blocks, loopcontrols, json.dumps as tojson, raise_exception),
for the four combinations of add_generation_prompt and tools, one JSON string per line.

    python3 render_reference.py qwen_like.jinja ctx.json > qwen_like.expected.jsonl

qwen_like.expected.jsonl was produced this way with Jinja2 3.1.6.
"""
import json
import sys

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise Exception(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
ctx = json.load(open(sys.argv[2]))
template = env.from_string(open(sys.argv[1]).read())
for add_generation_prompt in (False, True):
    for tools in (None, ctx["tools"]):
        out = template.render(
            messages=ctx["messages"],
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            bos_token="<s>",
            eos_token="</s>",
            **ctx["extra"],
        )
        sys.stdout.write(json.dumps(out) + "\n")

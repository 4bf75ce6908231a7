"""Renders tool-calling conversations with HF transformers' `apply_chat_template`, for
`tests/tool_templates.rs` to compare ferrolm's rendering against.

Usage: python3 make_expected.py > expected.json
(needs `pip install transformers jinja2`; no torch). The tokenizer is the llama3_gqa fixture's
(`testdata/fixtures/llama3_gqa`, bos `<s>`, eos `</s>`), with each template swapped in.

The conversations are written as an OpenAI client sends them: `function.arguments` is JSON
text. Before rendering they are converted as vLLM converts them (each `arguments` string is
parsed into an object, since templates such as Llama 3.1's apply `tojson` to it); the JSON
output keeps the OpenAI form, which ferrolm must convert the same way.
"""

import copy
import json
import pathlib
import shutil
import sys
import tempfile

from transformers import AutoTokenizer

HERE = pathlib.Path(__file__).resolve().parent
FIXTURE = HERE.parents[3] / "testdata" / "fixtures" / "llama3_gqa"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit"},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "description": "IANA zone"}},
            "required": ["zone"],
        },
    },
}


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


ID_A = "call_q3Xk9PzL0aBcDeFgHiJkLmNo"
ID_B = "call_7YtRe2WqAsDfGhJkLzXcVbNm"

CASES = [
    {
        "name": "llama3.1_json",
        "template": "tool_chat_template_llama3.1_json.jinja",
        "tools": [WEATHER, TIME],
        "kwargs": {"date_string": "26 Jul 2024"},
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": None,
             "tool_calls": [call(ID_A, "get_weather", {"city": "Zürich", "unit": "celsius", "days": 1.5})]},
            {"role": "tool", "tool_call_id": ID_A, "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
        ],
    },
    {
        "name": "hermes",
        "template": "tool_chat_template_hermes.jinja",
        "tools": [WEATHER, TIME],
        "kwargs": {},
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris and the time in Tokyo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                call(ID_A, "get_weather", {"city": "Paris"}),
                call(ID_B, "get_time", {"zone": "Asia/Tokyo"}),
            ]},
            {"role": "tool", "tool_call_id": ID_A, "name": "get_weather", "content": "18 C, rain"},
            {"role": "tool", "tool_call_id": ID_B, "name": "get_time", "content": "21:04"},
        ],
    },
    {
        "name": "mistral_parallel",
        "template": "tool_chat_template_mistral_parallel.jinja",
        "tools": [WEATHER, TIME],
        "kwargs": {},
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Weather in Paris and the time in Tokyo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                call(ID_A, "get_weather", {"city": "Paris", "unit": "celsius"}),
                call(ID_B, "get_time", {"zone": "Asia/Tokyo"}),
            ]},
            {"role": "tool", "tool_call_id": ID_A, "content": "{\"temperature\": 18}"},
            {"role": "tool", "tool_call_id": ID_B, "content": "\"21:04\""},
        ],
    },
    {
        "name": "qwen3_thinking_2507",
        "template": "qwen3_thinking_2507.jinja",
        "tools": [WEATHER],
        "kwargs": {},
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                call(ID_A, "get_weather", {"city": "Paris", "unit": "celsius"}),
            ]},
            {"role": "tool", "tool_call_id": ID_A, "content": "18 C, rain"},
            {"role": "assistant", "content": "<think>\nRain, 18.\n</think>\n\nIt is 18 C and raining."},
            {"role": "user", "content": "And tomorrow?"},
        ],
    },
]


def as_vllm_renders(messages):
    """vLLM parses each tool call's `arguments` JSON into an object before rendering."""
    out = copy.deepcopy(messages)
    for message in out:
        for tool_call in message.get("tool_calls") or []:
            tool_call["function"]["arguments"] = json.loads(tool_call["function"]["arguments"])
    return out


def main():
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["tokenizer.json", "tokenizer_config.json"]:
            shutil.copy(FIXTURE / name, tmp)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        for case in CASES:
            tokenizer.chat_template = (HERE / case["template"]).read_text()
            text = tokenizer.apply_chat_template(
                as_vllm_renders(case["messages"]),
                tools=case["tools"],
                tokenize=False,
                add_generation_prompt=True,
                **case["kwargs"],
            )
            results.append({**case, "expected": text})
    json.dump(results, sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

"""200 random JSON schemas (schema_gen.py, seeded) against the server, 16 requests at a time.

Each schema goes out one of three ways, in turn: `response_format` json_schema on
/v1/chat/completions, `structured_outputs: {"json": schema}` on /v1/chat/completions, and
`structured_outputs: {"json": schema}` on /v1/completions; even ones greedy, odd ones sampled at
temperature 1 with the schema's index as seed. Every output must be JSON that `jsonschema`
(formats checked) finds valid, and every response must end with finish_reason "stop".
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor

import openai

import schema_gen
from common import MAX_TOKENS, MODEL, ServerTest, content, messages, raw_create, schema_errors, show

CONCURRENCY = 16
WAYS = ("chat response_format", "chat structured_outputs", "completions structured_outputs")


def request_for(i: int, schema: dict) -> tuple[str, dict]:
    way = WAYS[i % len(WAYS)]
    sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}
    request = {"model": MODEL, "max_tokens": MAX_TOKENS, **sampling}
    if way == "completions structured_outputs":
        request["prompt"] = "A JSON document:\n"
    else:
        request["messages"] = messages("Fill in the JSON document.")
    if way == "chat response_format":
        request["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": f"schema_{i}", "schema": schema, "strict": True}}
    else:
        request["extra_body"] = {"structured_outputs": {"json": schema}}
    return way, request


def run_one(c: openai.OpenAI, i: int, schema: dict) -> tuple[str, str | None]:
    """(way, None) when schema i passes, else (way, what went wrong with request and response)."""
    way, request = request_for(i, schema)
    route = "completions" if way.startswith("completions") else "chat"
    try:
        completion, raw = raw_create(c, route, request)
    except openai.APIError as e:
        return way, f"schema {i} ({way}): {type(e).__name__}: {e}" + show(request, getattr(e, "body", None))
    choice = completion.choices[0]
    problems = schema_errors(schema, content(route, choice))
    if choice.finish_reason != "stop":
        problems.insert(0, f"finish_reason {choice.finish_reason!r}")
    if problems:
        return way, f"schema {i} ({way}): {'; '.join(problems)}" + show(request, raw)
    return way, None


class RandomSchemaTest(ServerTest):
    def test_random_schemas(self) -> None:
        schemas = schema_gen.schemas()
        start = time.monotonic()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(lambda a: run_one(self.client, *a), enumerate(schemas)))
        elapsed = time.monotonic() - start
        failures = [f for _, f in results if f is not None]
        by_way = collections.Counter(way for way, f in results if f is None)
        print(f"\nrandom schemas: {len(schemas) - len(failures)}/{len(schemas)} valid in {elapsed:.1f} s "
              f"({', '.join(f'{w}: {by_way[w]}' for w in WAYS)})", flush=True)
        if failures:
            self.fail(f"{len(failures)} of {len(schemas)} schemas failed:\n" + "\n".join(failures))

"""What the test modules share: a client for the server that run.py started, the fixture's
context, and failure messages that carry the request and the raw response.

run.py sets FERROLM_BASE_URL, FERROLM_MODEL_NAME and FERROLM_MAX_MODEL_LEN before the tests load.
"""

from __future__ import annotations

import json
import os
import unittest

import jsonschema
import openai
from openai import OpenAI

BASE_URL = os.environ.get("FERROLM_BASE_URL", "http://127.0.0.1:8000")
MODEL = os.environ.get("FERROLM_MODEL_NAME", "fixture")
# The fixture's max_position_embeddings: prompt and output together must fit in it.
MAX_MODEL_LEN = int(os.environ.get("FERROLM_MAX_MODEL_LEN", "512"))
# Room for an answer after a short chat prompt (the chat template and a one-line message take
# well under 100 tokens of the fixture's byte-level tokenizer).
MAX_TOKENS = MAX_MODEL_LEN - 100

SYSTEM = "You answer in JSON."
QUESTION = "Describe one order: its id, where it ships, what it holds."


def client() -> OpenAI:
    # No retries: a 5xx or a dropped connection is a failure to see, not to hide.
    return OpenAI(base_url=BASE_URL + "/v1", api_key="unused", max_retries=0, timeout=600)


def chat_api(c: OpenAI):
    """The chat resource that has `parse` and `stream`: `client.chat.completions` in newer
    clients, `client.beta.chat.completions` in older ones."""
    if hasattr(c.chat.completions, "parse"):
        return c.chat.completions
    return c.beta.chat.completions


def messages(question: str = QUESTION) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def validator(schema: dict) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def schema_errors(schema: dict, text: str) -> list[str]:
    """Why `text` is not a JSON document valid for `schema` (empty when it is)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        return [f"not JSON: {e}"]
    return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in validator(schema).iter_errors(value)]


def show(request: dict, response) -> str:
    """A request and the server's answer, for a failure message."""
    if isinstance(response, (dict, list)):
        response = json.dumps(response)
    request = {k: (v.__name__ if isinstance(v, type) else v) for k, v in request.items()}
    return f"\n  request:  {json.dumps(request, default=str)}\n  response: {response}"


def raw_create(c: OpenAI, route: str, request: dict):
    """Posts `request` to /v1/chat/completions (`route == "chat"`) or /v1/completions through the
    client, and returns (the parsed response, the response body as text)."""
    api = c.chat.completions if route == "chat" else c.completions
    raw = api.with_raw_response.create(**request)
    return raw.parse(), raw.http_response.text


def content(route: str, choice) -> str:
    return choice.message.content if route == "chat" else choice.text


class ServerTest(unittest.TestCase):
    maxDiff = None

    @classmethod
    def setUpClass(cls) -> None:
        cls.client = client()

    def assertStatus400(self, call, request: dict, names: list[str]) -> openai.BadRequestError:
        """`call(**request)` must raise a 400 whose message names at least one of `names`."""
        try:
            response = call(**request)
        except openai.BadRequestError as e:
            message = str(e.message)
            self.assertEqual(e.status_code, 400, show(request, e.body))
            self.assertTrue(any(n in message for n in names),
                            f"the message names none of {names}: {message!r}" + show(request, e.body))
            return e
        except openai.APIStatusError as e:
            self.fail(f"status {e.status_code}, not 400" + show(request, e.body))
        self.fail("accepted, not a 400" + show(request, response.model_dump_json()))

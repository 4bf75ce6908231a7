"""`response_format` through the client's own helpers: `parse` with a Pydantic model (greedy,
sampled, streamed), `json_object`, and json_schema with `n` and with `stop`.

The fixture has random weights: whatever valid JSON it writes, the constraint wrote;
`test_unconstrained_output_is_not_valid` shows that the same prompt without one gives no valid
document.
"""

from __future__ import annotations

import enum
import json
import re

import jiter
import pydantic
from openai import LengthFinishReasonError
from openai.lib._parsing._completions import type_to_response_format_param
from pydantic import BaseModel, Field

from common import MAX_TOKENS, MODEL, ServerTest, chat_api, messages, raw_create, schema_errors, show


class Priority(str, enum.Enum):
    low = "low"
    normal = "normal"
    high = "high"


class Address(BaseModel):
    city: str = Field(max_length=8)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Item(BaseModel):
    name: str = Field(max_length=6)
    quantity: int = Field(ge=1, le=99)
    priority: Priority


class Order(BaseModel):
    """Nested objects, an enum, an array of objects, optional fields, and Address used twice
    (so the schema holds it once in `$defs` and points at it with `$ref`)."""

    id: int = Field(ge=0, le=9999)
    ship_to: Address
    bill_to: Address | None
    items: list[Item] = Field(min_length=1, max_length=3)
    note: str | None = Field(max_length=10)
    express: bool


# The schema exactly as the client sends it for `response_format=Order` (its strict form: every
# field required, Optional ones nullable, additionalProperties false).
ORDER_SCHEMA = type_to_response_format_param(Order)["json_schema"]["schema"]


class ParseTest(ServerTest):
    def request(self, **overrides) -> dict:
        return {"model": MODEL, "messages": messages(), "response_format": Order, "max_tokens": MAX_TOKENS,
                "temperature": 0, **overrides}

    def test_schema_has_defs_and_refs(self) -> None:
        # The premise of the `$ref` case: the client sends Address once, referenced twice.
        self.assertIn("Address", ORDER_SCHEMA["$defs"])
        self.assertIn("#/$defs/Address", json.dumps(ORDER_SCHEMA["properties"]))
        self.assertEqual(json.dumps(ORDER_SCHEMA).count('"#/$defs/Address"'), 2)

    def test_unconstrained_output_is_not_valid(self) -> None:
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 1}):
            request = {k: v for k, v in self.request(**sampling).items() if k != "response_format"}
            with self.subTest(**sampling):
                completion, raw = raw_create(self.client, "chat", request)
                text = completion.choices[0].message.content
                self.assertTrue(schema_errors(ORDER_SCHEMA, text),
                                "without response_format the fixture already writes a valid Order, so the other "
                                "tests prove nothing about the constraint" + show(request, raw))

    def check_parsed(self, request: dict):
        raw = chat_api(self.client).with_raw_response.parse(**request)
        try:
            completion = raw.parse()
        except (pydantic.ValidationError, LengthFinishReasonError) as e:
            self.fail(f"{type(e).__name__}: {e}" + show(request, raw.http_response.text))
        for choice in completion.choices:
            why = show(request, raw.http_response.text)
            self.assertEqual(choice.finish_reason, "stop", why)
            self.assertIsInstance(choice.message.parsed, Order, why)
            self.assertEqual(schema_errors(ORDER_SCHEMA, choice.message.content), [], why)
            self.assertEqual(Order.model_validate_json(choice.message.content), choice.message.parsed, why)
        return completion

    def test_parse_greedy(self) -> None:
        self.check_parsed(self.request())

    def test_parse_sampled(self) -> None:
        for seed in (1, 2, 3):
            with self.subTest(seed=seed):
                self.check_parsed(self.request(temperature=1.0, seed=seed))

    def check_streamed(self, request: dict) -> None:
        deltas, chunks = [], []
        try:
            with chat_api(self.client).stream(**request) as stream:
                for event in stream:
                    if event.type == "chunk":
                        chunks.append(event.chunk.model_dump(exclude_none=True))
                    elif event.type == "content.delta":
                        deltas.append(event.delta)
                final = stream.get_final_completion()
        except (pydantic.ValidationError, LengthFinishReasonError) as e:
            self.fail(f"{type(e).__name__}: {e}" + show(request, chunks))
        text = "".join(deltas)
        why = show(request, chunks)
        self.assertGreater(len(chunks), 1, "a stream of one chunk" + why)
        self.assertEqual(schema_errors(ORDER_SCHEMA, text), [], why)
        self.assertEqual(Order.model_validate_json(text), final.choices[0].message.parsed, why)
        self.assertEqual(final.choices[0].finish_reason, "stop", why)

    def test_stream_greedy(self) -> None:
        self.check_streamed(self.request())

    def test_stream_sampled(self) -> None:
        self.check_streamed(self.request(temperature=1.0, seed=11))

    def test_stream_matches_non_streamed(self) -> None:
        # The same greedy request, streamed or not, is the same document.
        request = self.request()
        whole = self.check_parsed(request).choices[0].message.content
        deltas = []
        with chat_api(self.client).stream(**request) as stream:
            for event in stream:
                if event.type == "content.delta":
                    deltas.append(event.delta)
        self.assertEqual("".join(deltas), whole, show(request, whole))

    def test_n_choices_each_valid(self) -> None:
        completion = self.check_parsed(self.request(n=2, temperature=1.0, seed=5))
        self.assertEqual([c.index for c in completion.choices], [0, 1])


class JsonObjectTest(ServerTest):
    def request(self, **sampling) -> dict:
        return {"model": MODEL, "messages": messages(), "response_format": {"type": "json_object"},
                "max_tokens": MAX_TOKENS, **sampling}

    def test_json_object_greedy(self) -> None:
        request = self.request(temperature=0)
        completion, raw = raw_create(self.client, "chat", request)
        choice = completion.choices[0]
        self.assertEqual(choice.finish_reason, "stop", show(request, raw))
        try:
            value = json.loads(choice.message.content)
        except json.JSONDecodeError as e:
            self.fail(f"not JSON: {e}" + show(request, raw))
        self.assertIsInstance(value, dict, show(request, raw))

    def test_json_object_sampled(self) -> None:
        # json_object bounds nothing (a key may be any string), so a random-weight model that
        # samples may write one key until max_tokens. A finished output must be an object; a
        # cut one must still be the start of one (jiter reads JSON prefixes, as the client's
        # streaming helpers do).
        for seed in (3, 4, 5, 6):
            request = self.request(temperature=1.0, seed=seed)
            with self.subTest(seed=seed):
                completion, raw = raw_create(self.client, "chat", request)
                choice = completion.choices[0]
                text = choice.message.content
                self.assertIn(choice.finish_reason, ("stop", "length"), show(request, raw))
                try:
                    if choice.finish_reason == "stop":
                        value = json.loads(text)
                    else:
                        self.assertEqual(completion.usage.completion_tokens, MAX_TOKENS, show(request, raw))
                        value = jiter.from_json(text.encode(), partial_mode="trailing-strings")
                except ValueError as e:
                    self.fail(f"not JSON (finish_reason {choice.finish_reason}): {e}" + show(request, raw))
                self.assertIsInstance(value, dict, show(request, raw))


class StopTest(ServerTest):
    SCHEMA = {
        "type": "object",
        "properties": {"tag": {"const": "END"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["tag", "n"],
        "additionalProperties": False,
    }

    def test_stop_string_ends_a_schema_output(self) -> None:
        # The schema forces `{"tag":"END"...` (properties keep their order): the stop string
        # must cut it right before END, with finish_reason "stop".
        request = {"model": MODEL, "messages": messages(), "max_tokens": MAX_TOKENS, "temperature": 0,
                   "stop": ["END"],
                   "response_format": {"type": "json_schema",
                                       "json_schema": {"name": "tagged", "schema": self.SCHEMA, "strict": True}}}
        completion, raw = raw_create(self.client, "chat", request)
        choice = completion.choices[0]
        self.assertEqual(choice.finish_reason, "stop", show(request, raw))
        self.assertRegex(choice.message.content, re.compile(r'^\{\s*"tag"\s*:\s*"\Z'), show(request, raw))

    def test_without_stop_the_same_request_is_complete(self) -> None:
        request = {"model": MODEL, "messages": messages(), "max_tokens": MAX_TOKENS, "temperature": 0,
                   "response_format": {"type": "json_schema",
                                       "json_schema": {"name": "tagged", "schema": self.SCHEMA, "strict": True}}}
        completion, raw = raw_create(self.client, "chat", request)
        self.assertEqual(completion.choices[0].finish_reason, "stop", show(request, raw))
        self.assertEqual(schema_errors(self.SCHEMA, completion.choices[0].message.content), [], show(request, raw))

"""Tool calls: with `tool_choice: "required"` or a named function the reply is a valid call,
returned as `message.tool_calls` with finish_reason "tool_calls"."""

from __future__ import annotations

import enum
import json

import openai
import pydantic
from openai import LengthFinishReasonError
from pydantic import BaseModel, Field

from common import MAX_TOKENS, MODEL, ServerTest, chat_api, raw_create, schema_errors, show


class Unit(str, enum.Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class GetWeather(BaseModel):
    city: str = Field(max_length=10)
    unit: Unit
    days: int = Field(ge=1, le=7)


class BookTable(BaseModel):
    restaurant: str = Field(max_length=10)
    guests: int = Field(ge=1, le=12)
    time: str = Field(pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$")
    outdoor: bool


TOOLS = [openai.pydantic_function_tool(GetWeather, name="get_weather", description="The forecast for a city."),
         openai.pydantic_function_tool(BookTable, name="book_table", description="Book a table.")]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Book a table for two at Luigi's at 19:30, and tell me the weather in Rome."}]
SAMPLINGS = ({"temperature": 0}, {"temperature": 1.0, "seed": 23})


class ToolCallTest(ServerTest):
    def check_calls(self, request: dict, completion, raw: str, names: set[str]) -> None:
        choice = completion.choices[0]
        why = show(request, raw)
        self.assertEqual(choice.finish_reason, "tool_calls", why)
        calls = choice.message.tool_calls
        self.assertTrue(calls, "no tool_calls" + why)
        for call in calls:
            self.assertEqual(call.type, "function", why)
            self.assertTrue(call.id, "a tool call without an id" + why)
            self.assertIn(call.function.name, names, why)
            self.assertEqual(schema_errors(PARAMETERS[call.function.name], call.function.arguments), [], why)
        self.assertEqual(len({call.id for call in calls}), len(calls), "tool call ids repeat" + why)

    def test_required(self) -> None:
        for sampling in SAMPLINGS:
            with self.subTest(**sampling):
                request = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                           "max_tokens": MAX_TOKENS, **sampling}
                completion, raw = raw_create(self.client, "chat", request)
                self.check_calls(request, completion, raw, set(PARAMETERS))

    def test_named(self) -> None:
        for name in PARAMETERS:
            for sampling in SAMPLINGS:
                with self.subTest(name=name, **sampling):
                    request = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS,
                               "tool_choice": {"type": "function", "function": {"name": name}}, **sampling}
                    completion, raw = raw_create(self.client, "chat", request)
                    self.check_calls(request, completion, raw, {name})
                    self.assertEqual(len(completion.choices[0].message.tool_calls), 1, show(request, raw))

    def test_named_parsed_by_the_client(self) -> None:
        # The client's `parse` turns each call's arguments into the tool's Pydantic model.
        request = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS, "temperature": 0,
                   "tool_choice": {"type": "function", "function": {"name": "book_table"}}}
        raw = chat_api(self.client).with_raw_response.parse(**request)
        try:
            completion = raw.parse()
        except (pydantic.ValidationError, LengthFinishReasonError, json.JSONDecodeError) as e:
            self.fail(f"{type(e).__name__}: {e}" + show(request, raw.http_response.text))
        calls = completion.choices[0].message.tool_calls or []
        self.assertTrue(calls, "no tool_calls" + show(request, raw.http_response.text))
        for call in calls:
            self.assertIsInstance(call.function.parsed_arguments, BookTable, show(request, raw.http_response.text))

    def test_required_streamed_adds_up_to_the_whole_reply(self) -> None:
        request = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                   "max_tokens": MAX_TOKENS, "temperature": 0}
        completion, raw = raw_create(self.client, "chat", request)
        self.check_calls(request, completion, raw, set(PARAMETERS))
        whole = [(c.function.name, c.function.arguments) for c in completion.choices[0].message.tool_calls]
        calls: dict[int, dict] = {}
        finish, chunks = None, []
        for chunk in self.client.chat.completions.create(**request, stream=True):
            chunks.append(chunk.model_dump(exclude_none=True))
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                    if delta.function and delta.function.name:
                        call["name"] += delta.function.name
                    if delta.function and delta.function.arguments:
                        call["arguments"] += delta.function.arguments
        streamed = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
        self.assertEqual(streamed, whole, show(request, chunks))
        self.assertEqual(finish, "tool_calls", show(request, chunks))

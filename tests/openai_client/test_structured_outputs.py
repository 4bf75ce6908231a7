"""vLLM's `structured_outputs` request field through `extra_body` (regex, choice, a Lark grammar)
on /v1/chat/completions and /v1/completions, and the 400s for constraints that cannot compile."""

from __future__ import annotations

import re

from common import MAX_TOKENS, MODEL, ServerTest, content, messages, raw_create, show

ROUTES = ("chat", "completions")
SAMPLINGS = ({"temperature": 0}, {"temperature": 1.0, "seed": 17})

REGEXES = [
    r"[a-z]{3}-[0-9]{2,4}",
    r"(yes|no), because [a-z]{1,8}\.",
    r"\((-?[0-9]{1,3}), (-?[0-9]{1,3})\)",
]

CHOICES = ["alpha", "beta", "gamma delta", "épsilon"]

# A small Lark grammar (llguidance's dialect: `{m,n}` repeats) and the regular expression that
# accepts the same sentences.
GRAMMAR = r"""
start: sentence
sentence: verb " " thing (" and " thing){0,2} "."
verb: "take" | "drop" | "open"
thing: COLOR " " NOUN
COLOR: "red" | "green" | "blue"
NOUN: /[a-z]{2,5}/
"""
GRAMMAR_LANGUAGE = re.compile(r"(take|drop|open) (red|green|blue) [a-z]{2,5}( and (red|green|blue) [a-z]{2,5}){0,2}\.")


class StructuredOutputsTest(ServerTest):
    def generate(self, route: str, constraint: dict, sampling: dict) -> tuple[str, dict, str]:
        """(output, request, raw response) of one request under `constraint`; the response must
        end with finish_reason "stop"."""
        request = {"model": MODEL, "max_tokens": MAX_TOKENS, **sampling,
                   "extra_body": {"structured_outputs": constraint}}
        if route == "chat":
            request["messages"] = messages("Answer in one line.")
        else:
            request["prompt"] = "Answer in one line:"
        completion, raw = raw_create(self.client, route, request)
        self.assertEqual(completion.choices[0].finish_reason, "stop", show(request, raw))
        return content(route, completion.choices[0]), request, raw

    def test_regex(self) -> None:
        for route in ROUTES:
            for sampling in SAMPLINGS:
                for pattern in REGEXES:
                    with self.subTest(route=route, regex=pattern, **sampling):
                        text, request, raw = self.generate(route, {"regex": pattern}, sampling)
                        self.assertIsNotNone(re.fullmatch(pattern, text), show(request, raw))

    def test_choice(self) -> None:
        for route in ROUTES:
            for sampling in SAMPLINGS + ({"temperature": 1.0, "seed": 99},):
                with self.subTest(route=route, **sampling):
                    text, request, raw = self.generate(route, {"choice": CHOICES}, sampling)
                    self.assertIn(text, CHOICES, show(request, raw))

    def test_grammar(self) -> None:
        for route in ROUTES:
            for sampling in SAMPLINGS:
                with self.subTest(route=route, **sampling):
                    text, request, raw = self.generate(route, {"grammar": GRAMMAR}, sampling)
                    self.assertIsNotNone(GRAMMAR_LANGUAGE.fullmatch(text), show(request, raw))


class UnsupportedConstraintTest(ServerTest):
    """A constraint that cannot be compiled is the client's fault: a 400 that says what is wrong
    and names the field, before any generation."""

    BAD_TYPE = {"type": "object", "properties": {"a": {"type": "foo"}}, "required": ["a"]}
    REMOTE_REF = {"type": "object", "properties": {"a": {"$ref": "https://example.com/schemas/a.json"}}}

    def chat(self, **extra) -> dict:
        return {"model": MODEL, "messages": messages(), "max_tokens": 16, **extra}

    def json_schema(self, schema: dict) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema, "strict": True}}

    def check(self, route: str, request: dict, field: str, names: list[str]) -> None:
        api = self.client.chat.completions if route == "chat" else self.client.completions
        error = self.assertStatus400(api.create, request, names)
        param = (error.body or {}).get("param") if isinstance(error.body, dict) else None
        self.assertTrue(param == field or field in str(error.message),
                        f"the error names neither param {field!r} in `param` nor in its message" + show(request, error.body))

    def test_unknown_type(self) -> None:
        self.check("chat", self.chat(response_format=self.json_schema(self.BAD_TYPE)), "response_format", ["foo"])

    def test_remote_ref(self) -> None:
        self.check("chat", self.chat(response_format=self.json_schema(self.REMOTE_REF)), "response_format",
                   ["https://example.com/schemas/a.json"])

    def test_structured_outputs_json_unknown_type(self) -> None:
        for route, request in (("chat", self.chat()), ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 16})):
            with self.subTest(route=route):
                request["extra_body"] = {"structured_outputs": {"json": self.BAD_TYPE}}
                self.check(route, request, "structured_outputs", ["foo"])

    def test_bad_regex(self) -> None:
        request = self.chat(extra_body={"structured_outputs": {"regex": "[a-z"}})
        self.check("chat", request, "structured_outputs", ["regex", "[a-z"])

    def test_bad_grammar(self) -> None:
        request = self.chat(extra_body={"structured_outputs": {"grammar": "start: ( \"a\""}})
        # The message says it is the grammar, or quotes the line that does not parse.
        self.check("chat", request, "structured_outputs", ["grammar", 'start: ( "a"'])

    def test_two_constraints_at_once(self) -> None:
        request = self.chat(extra_body={"structured_outputs": {"regex": "[a-z]{2}", "choice": ["a", "b"]}})
        self.check("chat", request, "structured_outputs", ["regex", "choice"])

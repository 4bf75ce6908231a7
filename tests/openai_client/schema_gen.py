#!/usr/bin/env python3
"""Random JSON schemas for the structured-output tests, and a check of the generator itself.

`schemas(count, seed)` returns the same list for the same arguments on every machine and Python
version: every draw goes through `random.Random.random()`, the one output of the module that
Python promises not to change (its `randrange`, `choice` and `shuffle` have changed before).

What the schemas use is what llguidance compiles (docs/json_schema.md of llguidance): objects
with required and optional properties, nested objects, arrays with minItems/maxItems, enum,
const, strings with minLength/maxLength, an anchored pattern or a format, integers and numbers
with bounds (inclusive or exclusive), booleans, null, anyOf, and `$ref` into `$defs`.

Invariants, so that a small random-weight model with a 512-token context finishes every one:
- every object says `additionalProperties: false` (otherwise any key of any type may follow);
- every string has a maxLength, a pattern of bounded length or a format of bounded length;
- every array has maxItems <= 3, every integer and number both bounds, nesting depth <= 3;
- `max_bytes(schema)`, the longest compact serialization of a valid instance (a character of a
  free string counted as 4 bytes, a number's fraction as FRACTION_DIGITS digits), stays under
  BYTE_BUDGET. A token is at least one byte, so this bounds the tokens of a compact answer; the
  difference up to the tests' max_tokens is left for whitespace between tokens.
Left out on purpose: the formats whose length has no bound (email, hostname, duration, and the
fractional seconds of date-time and time), and `date`, whose llguidance pattern admits 02-29 in
every year, which a date checker refuses outside leap years.

Run it to check the generator: `python3 schema_gen.py` validates every schema against the
draft 2020-12 meta-schema, resolves every `$ref`, and validates one instance built from each
schema against it (so each schema is satisfiable). `--dump` prints the schemas.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

SEED = 20261206
COUNT = 200
BYTE_BUDGET = 240
FRACTION_DIGITS = 6
MAX_DEPTH = 3

# Anchored patterns in the syntax that Python's `re` and Rust's `regex` read alike, each with
# its longest match and one example.
PATTERNS = [
    ("^[a-z]{1,6}$", 6, "abc"),
    ("^[A-Z]{2}-[0-9]{2,4}$", 7, "AB-123"),
    ("^(cat|dog|emu)s?$", 4, "dogs"),
    ("^[0-9a-f]{4}$", 4, "0a9f"),
    ("^v[0-9]\\.[0-9]{1,2}$", 5, "v1.10"),
]

# Formats of bounded length that llguidance's patterns and jsonschema's checkers agree on.
FORMATS = [("uuid", 36, "123e4567-e89b-12d3-a456-426614174000"), ("ipv4", 15, "10.0.0.1"), ("ipv6", 39, "::1")]

WORDS = ["red", "green", "blue", "north", "south", "alpha", "beta", "on", "off", "low", "high", "mid"]
KEYS = ["id", "name", "kind", "size", "tags", "items", "meta", "count", "flag", "score", "when", "where",
        "color", "level", "owner", "note", "value", "unit", "x", "y"]
DEF_NAMES = ["Point", "Label", "Entry", "Range", "Mode"]


class Draw:
    """Draws built on `random()` alone (see the module docstring)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi]."""
        return lo + min(int(self.rng.random() * (hi - lo + 1)), hi - lo)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def pick(self, items: list):
        return items[self.int(0, len(items) - 1)]

    def sample(self, items: list, k: int) -> list:
        pool = list(items)
        out = []
        for _ in range(k):
            out.append(pool.pop(self.int(0, len(pool) - 1)))
        return out


# ---------------------------------------------------------------------------------------------
# Generation


class Generator:
    def __init__(self, draw: Draw) -> None:
        self.d = draw
        self.defs: dict[str, dict] = {}

    def root(self) -> dict:
        self.defs = {}
        for name in self.d.sample(DEF_NAMES, self.d.int(0, 2)):
            self.defs[name] = self.value(depth=2) if self.d.chance(0.5) else self.obj(depth=2)
        schema = self.obj(depth=0, min_props=1)
        if self.defs:
            schema["$defs"] = self.defs
        return schema

    def obj(self, depth: int, min_props: int = 0) -> dict:
        keys = self.d.sample(KEYS, self.d.int(max(min_props, 1 if depth == 0 else 0), 4 if depth == 0 else 3))
        props = {k: self.value(depth + 1) for k in keys}
        required = [k for k in keys if self.d.chance(0.6)]
        schema = {"type": "object", "properties": props, "additionalProperties": False}
        if required:
            schema["required"] = required
        return schema

    def value(self, depth: int) -> dict:
        kinds = ["string", "pattern", "format", "enum", "const", "integer", "number", "boolean", "null"]
        if depth < MAX_DEPTH:
            kinds += ["array", "object", "anyOf"]
        if self.defs and depth >= 1:
            kinds += ["ref"]
        kind = self.d.pick(kinds)
        return getattr(self, "gen_" + kind.lower())(depth)

    def gen_string(self, depth: int) -> dict:
        hi = self.d.int(1, 8)
        schema = {"type": "string", "maxLength": hi}
        if self.d.chance(0.4):
            schema["minLength"] = self.d.int(0, hi)
        return schema

    def gen_pattern(self, depth: int) -> dict:
        return {"type": "string", "pattern": self.d.pick(PATTERNS)[0]}

    def gen_format(self, depth: int) -> dict:
        return {"type": "string", "format": self.d.pick(FORMATS)[0]}

    def gen_enum(self, depth: int) -> dict:
        if self.d.chance(0.6):
            return {"type": "string", "enum": self.d.sample(WORDS, self.d.int(1, 4))}
        mixed = [self.d.pick(WORDS), self.d.int(-99, 99), self.d.chance(0.5), None]
        return {"enum": self.d.sample(mixed, self.d.int(2, 4))}

    def gen_const(self, depth: int) -> dict:
        return {"const": self.d.pick([self.d.pick(WORDS), self.d.int(-50, 50), self.d.chance(0.5)])}

    def gen_integer(self, depth: int) -> dict:
        lo = self.d.int(-500, 500)
        hi = lo + self.d.int(2, 600)
        schema: dict = {"type": "integer"}
        schema["exclusiveMinimum" if self.d.chance(0.25) else "minimum"] = lo
        schema["exclusiveMaximum" if self.d.chance(0.25) else "maximum"] = hi
        return schema

    def gen_number(self, depth: int) -> dict:
        lo = self.d.int(-2000, 2000) / 4
        hi = lo + self.d.int(1, 1000) / 4
        schema: dict = {"type": "number"}
        schema["exclusiveMinimum" if self.d.chance(0.25) else "minimum"] = lo
        schema["exclusiveMaximum" if self.d.chance(0.25) else "maximum"] = hi
        return schema

    def gen_boolean(self, depth: int) -> dict:
        return {"type": "boolean"}

    def gen_null(self, depth: int) -> dict:
        return {"type": "null"}

    def gen_array(self, depth: int) -> dict:
        lo = self.d.int(0, 2)
        items = self.obj(depth + 1) if self.d.chance(0.3) else self.value(depth + 1)
        return {"type": "array", "items": items, "minItems": lo, "maxItems": self.d.int(max(lo, 1), 3)}

    def gen_object(self, depth: int) -> dict:
        return self.obj(depth)

    def gen_anyof(self, depth: int) -> dict:
        return {"anyOf": [self.value(depth + 1) for _ in range(self.d.int(2, 3))]}

    def gen_ref(self, depth: int) -> dict:
        return {"$ref": "#/$defs/" + self.d.pick(sorted(self.defs))}


def schemas(count: int = COUNT, seed: int = SEED) -> list[dict]:
    """`count` schemas, each under BYTE_BUDGET; the same list for the same seed."""
    gen = Generator(Draw(seed))
    out = []
    while len(out) < count:
        schema = gen.root()
        if max_bytes(schema) <= BYTE_BUDGET:
            out.append(schema)
    return out


# ---------------------------------------------------------------------------------------------
# Bounds and examples


def resolve(schema: dict, root: dict) -> dict:
    """`schema` with its `$ref`s followed (a definition may itself point at an earlier one)."""
    prefix = "#/$defs/"
    for _ in range(len(root.get("$defs", {})) + 1):
        ref = schema.get("$ref")
        if ref is None:
            return schema
        if not ref.startswith(prefix) or ref[len(prefix):] not in root.get("$defs", {}):
            raise ValueError(f"unresolvable $ref {ref!r}")
        schema = root["$defs"][ref[len(prefix):]]
    raise ValueError("a cycle of $refs")


def number_bytes(lo: float, hi: float) -> int:
    # Sign, integer digits, and a fraction; llguidance's range patterns have no exponent.
    return 1 + len(str(int(max(abs(lo), abs(hi))))) + 1 + FRACTION_DIGITS


def max_bytes(schema: dict, root: dict | None = None) -> int:
    """The longest compact serialization of an instance of `schema` (see the module docstring)."""
    root = root or schema
    s = resolve(schema, root)
    if "const" in s:
        return len(json.dumps(s["const"]))
    if "enum" in s:
        return max(len(json.dumps(v)) for v in s["enum"])
    if "anyOf" in s:
        return max(max_bytes(alt, root) for alt in s["anyOf"])
    kind = s["type"]
    if kind == "object":
        props = s["properties"]
        return 2 + sum(len(k) + 3 + max_bytes(v, root) + 1 for k, v in props.items())
    if kind == "array":
        return 2 + s["maxItems"] * (max_bytes(s["items"], root) + 1)
    if kind == "string":
        if "pattern" in s:
            return 2 + next(n for p, n, _ in PATTERNS if p == s["pattern"])
        if "format" in s:
            return 2 + next(n for f, n, _ in FORMATS if f == s["format"])
        return 2 + 4 * s["maxLength"]
    if kind in ("integer", "number"):
        lo = s.get("minimum", s.get("exclusiveMinimum"))
        hi = s.get("maximum", s.get("exclusiveMaximum"))
        return number_bytes(lo, hi) if kind == "number" else 1 + len(str(max(abs(lo), abs(hi))))
    return {"boolean": 5, "null": 4}[kind]


def example(schema: dict, root: dict | None = None):
    """One instance of `schema`, built by hand: proof that the schema is satisfiable."""
    root = root or schema
    s = resolve(schema, root)
    if "const" in s:
        return s["const"]
    if "enum" in s:
        return s["enum"][0]
    if "anyOf" in s:
        return example(s["anyOf"][0], root)
    kind = s["type"]
    if kind == "object":
        return {k: example(v, root) for k, v in s["properties"].items() if k in s.get("required", [])}
    if kind == "array":
        return [example(s["items"], root) for _ in range(s["minItems"])]
    if kind == "string":
        if "pattern" in s:
            return next(e for p, _, e in PATTERNS if p == s["pattern"])
        if "format" in s:
            return next(e for f, _, e in FORMATS if f == s["format"])
        return "a" * s.get("minLength", 0)
    if kind in ("integer", "number"):
        if "minimum" in s:
            return s["minimum"]
        return s["exclusiveMinimum"] + (1 if kind == "integer" else 0.125)
    return {"boolean": True, "null": None}[kind]


def refs(schema) -> list[str]:
    if isinstance(schema, dict):
        found = [schema["$ref"]] if "$ref" in schema else []
        return found + [r for v in schema.values() for r in refs(v)]
    if isinstance(schema, list):
        return [r for v in schema for r in refs(v)]
    return []


def check(all_schemas: list[dict]) -> list[str]:
    """The problems of the generated schemas (none when the generator is sound)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    problems = []
    for i, schema in enumerate(all_schemas):
        try:
            Draft202012Validator.check_schema(schema)
            for ref in refs(schema):
                resolve({"$ref": ref}, schema)
            validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
            errors = [e.message for e in validator.iter_errors(example(schema))]
            if errors:
                problems.append(f"schema {i}: its example is invalid: {errors}")
            if max_bytes(schema) > BYTE_BUDGET:
                problems.append(f"schema {i}: {max_bytes(schema)} bytes, over {BYTE_BUDGET}")
        except (SchemaError, ValueError, KeyError) as e:
            problems.append(f"schema {i}: {e}")
    return problems


def features(all_schemas: list[dict]) -> dict[str, int]:
    """How many schemas use each keyword (to see that every feature is drawn)."""
    text = [json.dumps(s) for s in all_schemas]
    keys = ["\"required\"", "\"minItems\"", "\"maxItems\"", "\"enum\"", "\"const\"", "\"maxLength\"",
            "\"pattern\"", "\"format\"", "\"exclusiveMinimum\"", "\"integer\"", "\"number\"",
            "\"boolean\"", "\"anyOf\"", "\"$ref\"", "\"array\"", "\"null\""]
    return {k.strip('"'): sum(k in t for t in text) for k in keys}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=COUNT)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--dump", action="store_true", help="print the schemas, one per line")
    args = p.parse_args(argv)
    generated = schemas(args.count, args.seed)
    if args.dump:
        for s in generated:
            print(json.dumps(s))
        return 0
    problems = check(generated)
    for line in problems:
        print(line)
    sizes = sorted(max_bytes(s) for s in generated)
    print(f"{len(generated)} schemas, {len(problems)} problems; longest instance {sizes[-1]} bytes, "
          f"median {sizes[len(sizes) // 2]}; features: {features(generated)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

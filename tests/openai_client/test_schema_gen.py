"""The random-schema generator itself: sound schemas, the same ones for the same seed."""

from __future__ import annotations

import unittest

import schema_gen


class SchemaGenTest(unittest.TestCase):
    def test_schemas_are_valid_satisfiable_and_short(self) -> None:
        # Meta-schema, $refs, an example instance of each, and the byte budget.
        self.assertEqual(schema_gen.check(schema_gen.schemas()), [])

    def test_same_seed_same_schemas(self) -> None:
        self.assertEqual(schema_gen.schemas(), schema_gen.schemas())
        self.assertNotEqual(schema_gen.schemas(seed=1), schema_gen.schemas(seed=2))

    def test_every_feature_is_drawn(self) -> None:
        counts = schema_gen.features(schema_gen.schemas())
        self.assertEqual([k for k, n in counts.items() if n < 10], [], counts)

    def test_a_bad_example_is_caught(self) -> None:
        # check() must be able to fail: an unsatisfiable schema is reported.
        bad = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
               "required": ["a"], "additionalProperties": False}
        self.assertTrue(schema_gen.check([bad]))

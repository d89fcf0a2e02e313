"""What a constraint allows, compiled by llguidance: a JSON Schema, a Lark grammar, any JSON object.

JSON Schema (llguidance's docs/json_schema.md): objects (properties in the schema's order,
required, additionalProperties, patternProperties), arrays (items, prefixItems, minItems,
maxItems), strings (minLength, maxLength, pattern without look-around, format), numbers
(minimum, maximum, exclusive bounds, multipleOf), enum, const, anyOf, allOf, oneOf where
provably anyOf, $ref within the schema. A schema it cannot honour is refused, never loosened.

Lark (llguidance's docs/syntax.md): `start: ...` is the text; lowercase names are rules,
UPPERCASE names and "strings" and /regexes/ are terminals (one lexeme each); `%json {schema}`
inlines a schema; `<|im_end|>` names a special token.

JSON whitespace: llguidance allows any run of whitespace between tokens by default, and a small
model writing greedily can fall into writing it forever; as llama.cpp's schema grammars do,
whitespace is one space, or one or two newlines and an indent of up to 20 spaces or tabs (a
schema's own "x-guidance" options win).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import llguidance

from common.generate import ParameterError

JSON_WHITESPACE = {"whitespace_pattern": r"(?: |\n{1,2}[ \t]{0,20})"}
ANY_OBJECT = {"type": "object"}


class ConstraintError(ParameterError):
    """A schema or grammar llguidance refuses, or a token it does not allow where one was forced:
    the message names what, and why, on one line. `what` names the input at fault."""

    def __init__(self, message: str, what: str | None = None):
        super().__init__(message)
        self.what = what


def one_line(message: str) -> str:
    """llguidance's message on one line: its echo of the grammar's source line and the carets
    under it dropped (the position stays in the text), the rest joined."""
    lines = [ln.strip() for ln in message.splitlines()]
    kept = [ln for ln in lines if ln and not re.fullmatch(r"\d+ \|.*|[\^~ ]+", ln)]
    return " ".join(kept).rstrip(":")


def with_json_options(schema):
    """The schema with llguidance's JSON options (JSON_WHITESPACE) where it sets none itself."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        return schema                     # llguidance names what is wrong
    return {**schema, "x-guidance": {**JSON_WHITESPACE, **schema.get("x-guidance", {})}}


@dataclass(frozen=True)
class Grammar:
    """llguidance's grammar text (its JSON form) and `what` it was given as, for messages
    ("--json-schema", "response_format.json_schema.schema", ...). Build with the classmethods;
    `checked` compiles it against a vocabulary before any token is generated."""
    text: str
    what: str
    kind: str                             # "json_schema" | "lark"

    @classmethod
    def json_schema(cls, schema, what: str = "the JSON schema") -> Grammar:
        """schema: a dict (or its JSON text); True is any JSON value."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"{what}: not valid JSON: {e}", what) from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"{what}: a JSON schema is an object (or true/false), not "
                                  f"{type(schema).__name__}", what)
        return cls(llguidance.LLMatcher.grammar_from_json_schema(with_json_options(schema)), what, "json_schema")

    @classmethod
    def json_object(cls, what: str = "JSON mode") -> Grammar:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls.json_schema(ANY_OBJECT, what)

    @classmethod
    def lark(cls, text: str, what: str = "the grammar") -> Grammar:
        if not isinstance(text, str):
            raise ConstraintError(f"{what}: a grammar is text, not {type(text).__name__}", what)
        return cls(llguidance.LLMatcher.grammar_from_lark(text), what, "lark")

    def checked(self, ll: llguidance.LLTokenizer) -> Grammar:
        """Itself, once llguidance compiles it for this vocabulary; else ConstraintError."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(self.text, ll)
        if is_error:
            error = messages[0]
            hint = ""
            if self.kind == "lark" and "::=" in self.text:
                hint = (" (this looks like llama.cpp's GBNF; write llguidance's Lark: `start: ...`, `name: ...`, "
                        "character classes as /[a-z]/; llguidance.gbnf_to_lark converts most GBNF)")
            raise ConstraintError(f"{self.what}: llguidance refuses it: {one_line(error)}{hint}", self.what)
        return self

"""What a request asks its output to match, before compilation: the frontends reduce the APIs'
fields to one ConstraintSpec (loom_router.structured.fields) and send it to the engine core, which
compiles it (loom_router.structured.grammar). No llguidance here: frontends never compile."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from loom_router.contract import Constraint
from loom_router.types import ValidationError

# Options of a `choice`: compiling them costs their number squared (10k: 0.2 s, 100k: 13 s and a panic).
MAX_CHOICES = 10_000
# JSON as json.dumps writes it: free whitespace lets a small model loop on blank lines until
# max_tokens; a schema's own "x-guidance" options still override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# Where a schema nests other schemas (JSON Schema 2020-12 and draft 7 names).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # not allOf: a branch closed alone would refuse its siblings' keys
_SCHEMA_ONES = ("items", "additionalItems", "not", "if", "then", "else", "contains", "additionalProperties",
                "unevaluatedProperties", "propertyNames")


def strict_schema(schema: Any) -> Any:
    """`schema` with its objects closed: an object schema that lists `properties` and says
    nothing of other keys gets `additionalProperties: false`, so only its listed keys are admitted
    (OpenAI's strict mode; JSON Schema's own default admits any other key). An object that lists
    no properties stays free-form, and `allOf` branches are left as they are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(sub) for sub in out[key]]
    for key in _SCHEMA_ONES:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    open_keys = ("additionalProperties", "unevaluatedProperties", "patternProperties")
    if "properties" in out and not any(key in out for key in open_keys):
        out["additionalProperties"] = False
    return out


def nested_schema(schema: Any, prefix: str, defs: dict[str, Any]) -> Any:
    """`schema` as a part of another: its definitions ($defs, draft 7's definitions) move into
    `defs` (the outer schema's $defs) as prefix + name, and itself too (prefix + "root") when a
    reference points into it; its local `$ref`s are rewritten to point there (a pointer is
    relative to the document's root: nested as is, `#/$defs/x` would point into the outer one)."""
    if not isinstance(schema, dict):
        return schema
    targets: set[str] = set()  # the definitions the rewritten references name

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: rewrite(value) for key, value in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = _pointer_into_defs(ref[1:], prefix)
            targets.add(out["$ref"].split("/")[2])
        return out

    for name, sub in {**schema.get("definitions", {}), **schema.get("$defs", {})}.items():
        defs[prefix + name] = rewrite(sub)
    own = rewrite({key: value for key, value in schema.items() if key not in ("$defs", "definitions")})
    if prefix + "root" not in targets:
        return own
    defs[prefix + "root"] = own
    return {"$ref": f"#/$defs/{prefix}root"}


def _pointer_into_defs(pointer: str, prefix: str) -> str:
    """A pointer into the nested schema, as a pointer into the outer one's $defs."""
    for container in ("/$defs/", "/definitions/"):
        if pointer.startswith(container):
            return f"#/$defs/{prefix}{pointer[len(container):]}"
    return f"#/$defs/{prefix}root{pointer}"


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # source: the schema as JSON text
    REGEX = "regex"
    CHOICE = "choice"  # source: a JSON list of strings; the output is exactly one of them
    LARK = "lark"  # a Lark or GBNF grammar (llguidance converts GBNF)


@dataclass(slots=True, frozen=True)
class ConstraintSpec:
    """What a request asks the output to match, before compilation."""

    kind: ConstraintKind
    source: str

    @classmethod
    def json_schema(cls, schema: object) -> ConstraintSpec:
        """A schema as a dict (or True for any JSON object), its keys in the client's order: the
        output's properties follow the order of the schema's `properties`."""
        if schema is True or schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise ValidationError(f"a JSON schema must be an object. Given: {type(schema).__name__}")
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema))

    @classmethod
    def choice(cls, options: list[str]) -> ConstraintSpec:
        if not options or not all(isinstance(o, str) for o in options):
            raise ValidationError("`choice` must be a non-empty list of strings")
        if len(options) > MAX_CHOICES:
            raise ValidationError(f"`choice` takes at most {MAX_CHOICES} options. Given: {len(options)}")
        return cls(ConstraintKind.CHOICE, json.dumps(options))

    def to_contract(self) -> Constraint:
        return Constraint(self.kind.value, self.source)

    @classmethod
    def from_contract(cls, constraint: Constraint) -> ConstraintSpec:
        """Raises ValidationError for a kind this router does not know."""
        try:
            return cls(ConstraintKind(constraint.kind), constraint.source)
        except ValueError:
            raise ValidationError(f"unknown constraint kind {constraint.kind!r}") from None

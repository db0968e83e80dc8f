"""Constraint fields of the APIs, and their reduction to one `ConstraintSpec`.

- OpenAI: `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}
  (with `strict: true` only the keys a schema lists; without, JSON Schema's rules: other keys too);
  TGI's on chat: {"type": "json", "value": schema} or {"type": "regex", "value": regex}.
- vLLM extras: `structured_outputs` {json | regex | choice | grammar | json_object}, and the
  older top-level `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
- TGI: `parameters.grammar` {"type": "json" | "json_object" | "regex", "value": ...}.

Compilation (and its 422) happens in the engine core (`loom_router.structured.grammar`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loom_router.structured.spec import MAX_CHOICES, ConstraintKind, ConstraintSpec, strict_schema
from loom_router.types import ValidationError

Choices = Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class JsonSchemaFormat(_Model):
    """OpenAI's `response_format.json_schema`."""

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # true: objects admit only their listed keys (strict_schema)


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema", "json", "regex"]  # json, regex: TGI's
    json_schema: JsonSchemaFormat | None = None
    value: dict[str, Any] | str | None = None  # TGI's: the schema (or its JSON text), or the regex


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs` (StructuredOutputsParams)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ConstraintFields(_Model):
    """The constraint fields shared by /v1/completions and /v1/chat/completions."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None

    def constraint_spec(self) -> ConstraintSpec | None:
        """The one constraint the request asks for, or None. Raises ValidationError for two."""
        specs = [spec for spec in (_response_format_spec(self.response_format),
                                   _structured_outputs_spec(self.structured_outputs),
                                   _guided_spec(self)) if spec is not None]
        if len(specs) > 1:
            raise ValidationError("set only one of `response_format`, `structured_outputs` and `guided_*`")
        return specs[0] if specs else None


def _response_format_spec(fmt: ResponseFormat | None) -> ConstraintSpec | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type in ("json", "regex"):
        return tgi_constraint_spec(TGIGrammar(type=fmt.type, value=fmt.value))
    if fmt.type == "json_object":
        return ConstraintSpec.json_schema(True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise ValidationError("`response_format.json_schema.schema` is required for type json_schema")
    schema = fmt.json_schema.json_schema
    return ConstraintSpec.json_schema(strict_schema(schema) if fmt.json_schema.strict else schema)


def _structured_outputs_spec(so: StructuredOutputs | None) -> ConstraintSpec | None:
    if so is None:
        return None
    specs = _specs(so.json_, so.regex, so.choice, so.grammar)
    if so.json_object:
        specs.append(ConstraintSpec.json_schema(True))
    if len(specs) > 1:
        raise ValidationError("`structured_outputs` takes one of json, regex, choice, grammar, json_object")
    return specs[0] if specs else None


def _guided_spec(fields: ConstraintFields) -> ConstraintSpec | None:
    specs = _specs(fields.guided_json, fields.guided_regex, fields.guided_choice, fields.guided_grammar)
    if len(specs) > 1:
        raise ValidationError("set only one of `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`")
    return specs[0] if specs else None


def _specs(json_schema: dict[str, Any] | str | None, regex: str | None, choice: list[str] | None,
           grammar: str | None) -> list[ConstraintSpec]:
    specs = []
    if json_schema is not None:
        specs.append(ConstraintSpec.json_schema(_schema_object(json_schema)))
    if regex is not None:
        specs.append(ConstraintSpec(ConstraintKind.REGEX, regex))
    if choice is not None:
        specs.append(ConstraintSpec.choice(choice))
    if grammar is not None:
        specs.append(ConstraintSpec(ConstraintKind.LARK, grammar))
    return specs


def _schema_object(schema: dict[str, Any] | str) -> Any:
    """vLLM accepts a schema as an object or as JSON text."""
    if isinstance(schema, dict):
        return schema
    try:
        return json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValidationError(f"the JSON schema is not valid JSON: {e}") from None


class TGIGrammar(_Model):
    """TGI's `parameters.grammar`: a JSON schema (an object, or its JSON text) or a regex."""

    type: Literal["json", "json_object", "regex"]
    value: dict[str, Any] | str | None = None


def tgi_constraint_spec(parsed: TGIGrammar | None) -> ConstraintSpec | None:
    """TGI `grammar` -> ConstraintSpec. Raises ValidationError for a malformed one."""
    if parsed is None:
        return None
    if parsed.type == "regex":
        if not isinstance(parsed.value, str):
            raise ValidationError("`grammar.value` must be a regex string for type regex")
        return ConstraintSpec(ConstraintKind.REGEX, parsed.value)
    if parsed.type == "json_object" or parsed.value is None:
        return ConstraintSpec.json_schema(True)
    return ConstraintSpec.json_schema(_schema_object(parsed.value))


"""Structured output as the OpenAI API and vLLM take it: `response_format` (OpenAI: text, json_object, json_schema)
and vLLM's `structured_outputs` extension ({json, regex, choice, grammar, json_object}), turned into the engine's
OutputConstraint. The grammar of `structured_outputs.grammar` is llguidance's Lark dialect (what vLLM's "guidance"
backend takes). Options the engine cannot honour are refused naming the field, never ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from appliance.core.constraint import OutputConstraint


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Body):
    """OpenAI's response_format.json_schema: the schema and its name (the openai client's `parse` sends both)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` (vllm.sampling_params.StructuredOutputsParams): one kind of constraint."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False      # JSON is generated without optional whitespace anyway
    disable_fallback: bool = False            # one grammar library, no fallback to disable
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class ConstraintFieldError(ValueError):
    """A structured-output field the server refuses: `field` names it (the HTTP front end answers 400)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


def response_format_constraint(fmt: ResponseFormat) -> OutputConstraint | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return OutputConstraint.json_object(field="response_format")
    if fmt.json_schema is None:
        raise ConstraintFieldError("response_format.json_schema", 'type "json_schema" needs a "json_schema" object')
    if fmt.json_schema.schema_ is None:
        raise ConstraintFieldError("response_format.json_schema.schema", "a JSON schema object is required")
    return OutputConstraint.json_schema(fmt.json_schema.schema_, field="response_format.json_schema.schema")


def structured_outputs_constraint(so: StructuredOutputs) -> OutputConstraint:
    for name in ("whitespace_pattern", "structural_tag"):
        if getattr(so, name) is not None:
            raise ConstraintFieldError(f"structured_outputs.{name}", "is not supported")
    if so.disable_additional_properties:
        raise ConstraintFieldError("structured_outputs.disable_additional_properties",
                                   'is not supported; send "additionalProperties": false in the schema')
    kinds = {"json": so.json_ is not None, "regex": so.regex is not None, "choice": so.choice is not None,
             "grammar": so.grammar is not None, "json_object": bool(so.json_object)}
    given = [k for k, v in kinds.items() if v]
    if len(given) != 1:
        raise ConstraintFieldError("structured_outputs", f"exactly one of {', '.join(kinds)} must be set; "
                                                         f"got {', '.join(given) or 'none'}")
    if so.json_ is not None:
        return OutputConstraint.json_schema(so.json_, field="structured_outputs.json")
    if so.regex is not None:
        return OutputConstraint.regex(so.regex, field="structured_outputs.regex")
    if so.choice is not None:
        return OutputConstraint.choice(so.choice, field="structured_outputs.choice")
    if so.grammar is not None:
        return OutputConstraint.grammar(so.grammar, field="structured_outputs.grammar")
    return OutputConstraint.json_object(field="structured_outputs.json_object")


def request_constraint(response_format: ResponseFormat | None,
                       structured_outputs: StructuredOutputs | None) -> OutputConstraint | None:
    """The one constraint of a request, from either field (both at once is refused, naming structured_outputs)."""
    from_format = None if response_format is None else response_format_constraint(response_format)
    if structured_outputs is None:
        return from_format
    if from_format is not None:
        raise ConstraintFieldError("structured_outputs", "send either response_format or structured_outputs, "
                                                         "not both")
    return structured_outputs_constraint(structured_outputs)

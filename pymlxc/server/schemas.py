"""The request bodies of the OpenAI API, as pydantic models.

Unknown fields are ignored (as OpenAI's API does); known fields are checked strictly (a string
where a number belongs is an error, not a conversion; null in an optional field is its default, as
OpenAI reads it), and the app turns any failure into a 400 in OpenAI's error shape, naming the
field. OpenAI's fields that would change the answer in a way this server cannot (`n` or `best_of`
over 1, `suffix`, the deprecated `functions`) are refused, not ignored.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticUndefined


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """OpenAI's optional fields are nullable: `"temperature": null` (which many clients send for
        "not set") means the default, as leaving the field out does. A required field stays required."""
        if not isinstance(data, dict):
            return data
        defaulted = {info.alias or name for name, info in cls.model_fields.items()
                     if not info.is_required() and (info.default_factory is not None
                                                    or info.default not in (None, PydanticUndefined))}
        return {key: value for key, value in data.items() if not (value is None and key in defaulted)}


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = "output"
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Function(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: Function


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


# Stop strings a request may give. Each is looked for in the text after every token, on the event loop
# that serves every client: 80,000 of them (a 1 MB body) blocked it for 35 ms a token. OpenAI allows 4.
MAX_STOP_STRINGS = 64


class Sampling(_Body):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, not {len(stop)}")
        return stop

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    # OpenAI's, which this server cannot honour: refused rather than ignored (the answer would be
    # another than the one asked for). best_of 1, as n 1, is what every answer is.
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix (text the completion must lead into) is not supported")
        return suffix


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Body):
    name: str
    arguments: str


class MessageToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Checked even when left out: only an assistant's turn may go without (one that calls tools has none).
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _needs_content(cls, content: str | list[ContentPart] | None, info: ValidationInfo) -> Any:
        role = info.data.get("role")  # absent when the role itself failed
        if content is None and role not in (None, "assistant"):
            raise ValueError(f"a {role} message needs content")
        return content

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates read it (text content, tool calls with parsed arguments)."""
        import json

        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                try:
                    arguments: Any = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    arguments = call.function.arguments
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            out["tool_calls"] = calls
        return out


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # OpenAI's deprecated function calling: left unread, the model would answer without ever
    # seeing the functions. Refused, naming what replaces it.
    functions: None = None
    function_call: None = None

    @field_validator("functions", "function_call", mode="before")
    @classmethod
    def _deprecated(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None:
            instead = "tools" if info.field_name == "functions" else "tool_choice"
            raise ValueError(f"{info.field_name} (deprecated by OpenAI) is not supported: use {instead}")
        return None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        # OpenAI refuses it too: without `logprobs` the answer would carry none, silently.
        if top and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs needs logprobs: true")
        return top


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    names: set[str] = set()
    for model in models:
        for name, info in model.model_fields.items():
            names.update(n for n in (name, info.alias) if n)
    return frozenset(names)


# Every key a request body may hold, at any depth: an error's location keeps these (and list indices)
# and leaves out the union members pydantic adds to it.
FIELD_NAMES = _field_names(StreamOptions, JsonSchemaFormat, ResponseFormat, Function, Tool, NamedFunction,
                           NamedToolChoice, CompletionRequest, ContentPart, ToolCallFunction, MessageToolCall,
                           ChatMessage, ChatRequest)

"""Pydantic models of the OpenAI API as srt_lite serves it (plus SGLang's extra fields).

Requests ignore unknown fields (clients such as LangChain send vendor extras); every known
field is type-checked, and a failure becomes an HTTP 400 in the OpenAI error format.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from srt_lite.managers.validation import RequestError


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`. `schema` is stored as `schema_` because pydantic's
    BaseModel already has a `schema` attribute."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`. "structural_tag" is SGLang's: `structures` + `triggers` (its first
    form) or `format` (xgrammar's current one), passed on as the whole object."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """A `tools` entry. `type` is any string here so that tools.py can answer a non-function
    tool with a message naming `tools[i].type`; `function` is checked there too."""

    model_config = ConfigDict(extra="ignore")
    type: str
    function: FunctionDefinition | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


class _SamplingFields(BaseModel):
    """Fields shared by chat and completions requests. None means "not set": the model's
    generation_config, then the OpenAI default, applies."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # SGLang / vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: str | None = None
    # SGLang's grammar extras (at most one per request; see structured.py)
    json_schema: str | None = None  # the schema as JSON text
    regex: str | None = None
    ebnf: str | None = None
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences are allowed")
        return v


def join_text_parts(content: Any, where: str, part_types: tuple[str, ...] = ("text",)) -> str:
    """A string, or the text of a list of parts/blocks of `part_types` joined; anything else
    is a RequestError naming `where`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in part_types or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{where}[{j}]: only text parts are supported here, got {kind!r}")
        parts.append(part["text"])
    return "".join(parts)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def text(self) -> str:
        """String content, or the text parts of a content list joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be from the assistant")
        return self


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("prompt must not be an empty list")
        return v


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None
    reasoning_tokens: int | None = None


def now() -> int:
    return int(time.time())

"""The OpenAI HTTP bodies tandem serves (pydantic): requests, responses, stream chunks, errors, parsing."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**63 - 1


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StrictRequest(BaseModel):
    """Request bodies: JSON types as written (no "1" for 1), finite numbers, unknown fields ignored."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(StrictRequest):
    include_usage: bool = False


class JsonSchemaFormat(StrictRequest):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


# OpenAI request fields this server does not implement: a 400 naming them, never silently ignored.
UNSUPPORTED_OPENAI_FIELDS = frozenset({
    "functions", "function_call", "audio", "modalities", "prediction", "web_search_options", "reasoning_effort",
    "service_tier", "store", "metadata", "verbosity",
})


class SamplingFields(StrictRequest):
    """Fields shared by /v1/completions and /v1/chat/completions. Unknown fields are kept (extra="allow") only
    to be named: an OpenAI field the server does not implement is a 400, anything else a warning in the log."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow", populate_by_name=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, description="new tokens at most; default: up to the context")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=-MAX_SEED, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions (vLLM's names).
    repetition_penalty: float | None = None
    min_p: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Structured output: OpenAI's response_format, and vLLM's guided_* extensions.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extension: each prompt token's logprob and the top k (scoring)
    prompt_logprobs: int | None = Field(default=None, description=f"top logprobs per prompt token, "
                                                                  f"0..{MAX_TOP_LOGPROBS}")

    @model_validator(mode="after")
    def _check_unsupported(self) -> "SamplingFields":
        for name in sorted(set(self.model_extra or ()) & UNSUPPORTED_OPENAI_FIELDS):
            raise ValueError(f"{name} is not supported by this server")
        guided = [name for name in ("response_format", "guided_json", "guided_regex", "guided_choice",
                                    "guided_grammar") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            guided.remove("response_format")
        if len(guided) > 1:
            raise ValueError(f"{guided[1]}: give at most one of {', '.join(guided)}")
        for key in self.logit_bias or {}:
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, description=f"top logprobs per token, 0..{MAX_TOP_LOGPROBS}")
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream: send the scoring request without streaming")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not supported with stream")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (or be omitted)")
        return self


class TextContentPart(StrictRequest):
    type: Literal["text"]
    text: str


class FunctionCallIn(StrictRequest):
    name: str
    arguments: str


class ToolCallIn(StrictRequest):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionDef(StrictRequest):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(StrictRequest):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoiceFunction(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: NamedToolChoiceFunction


class ChatMessage(StrictRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not supported with stream")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not "
                                 f"among tools {names}")
        return self

    def tool_mode(self) -> str:
        """'none' (no tools), 'auto', 'required' or 'named'."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"


# ---- responses -------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token of a prompt token's entry in vLLM's prompt_logprobs format."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token; None where unknown (a prompt token outside the top k)
    decoded_token: str


# Per prompt token: None for the first, then {token id (a JSON string key): PromptLogprob}.
PromptLogprobsBody = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # tandem extension, sent when the model has no tokenizer
    prompt_logprobs: PromptLogprobsBody | None = None  # vLLM extension, with prompt_logprobs in the request


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    metrics: dict[str, float] | None = None  # tandem extension: queue_time_s when the engine reports it


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    metrics: dict[str, float] | None = None  # tandem extension: queue_time_s when the engine reports it
    prompt_logprobs: PromptLogprobsBody | None = None  # vLLM extension, with prompt_logprobs in the request


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    metrics: dict[str, float] | None = None  # tandem extension: queue_time_s when the engine reports it


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    metrics: dict[str, float] | None = None  # tandem extension: queue_time_s when the engine reports it


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter's folder
    parent: str | None = None  # a LoRA adapter's base model


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace the adapter served under lora_name (vLLM's field)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code)).model_dump()


class ApiError(Exception):
    """An OpenAI-style error response: status, message, the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: int | str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code if code is not None else status


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """Validates a JSON body; the first problem becomes a 400 naming the field. Unknown fields are logged."""
    try:
        body = model.model_validate_json(raw)
        if body.model_extra:
            logger.warning("ignoring unknown request fields: %s", ", ".join(sorted(body.model_extra)))
        return body
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "json_invalid":
            raise ApiError(400, f"the body is not valid JSON: {message}") from None
        param = loc_to_param(err["loc"]) or _field_named(model, message)
        where = f"{param}: " if param and not message.startswith(param) else ""
        raise ApiError(400, f"{where}{message}", param=param) from None


def loc_to_param(loc: tuple) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'; pydantic's union-member tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict", "none"):
            if part[0].isupper():  # a model name tagging a union member
                continue
            out += f".{part}" if out else part
    return out or None


def _field_named(model: type[BaseModel], message: str) -> str | None:
    word = message.split(" ", 1)[0]
    return word if word in model.model_fields else None

"""OpenAI-compatible request and response bodies (pydantic), with vLLM's extra fields.

Requests accept unknown fields (OpenAI clients send some this server does not use) but
reject known features that are not supported when they are asked for, naming the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: The range of every integer field but ``seed``: a larger value could never be right, and
#: would overflow the engine's types (the sampling checks then give the precise limits).
MAX_INT = 2**31 - 1
Int32 = Annotated[int, Field(ge=-MAX_INT - 1, le=MAX_INT)]
#: A seed is a 64-bit integer.
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


def random_id(prefix: str) -> str:
    """A unique id such as ``cmpl-1f0c...`` (32 hex digits)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- errors -----------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ---- requests ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(BaseModel):
    """The sampling fields completions and chat share (OpenAI's, plus vLLM's extras).

    Integers are bounded (:data:`Int32`, :data:`Seed`) and floats must be finite, so no
    value can overflow or poison the engine; the sampling checks give the exact ranges.
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None  # vLLM extension
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int32] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int32 = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    min_p: float | None = None  # vLLM extension
    min_tokens: Int32 | None = None  # vLLM extension
    #: vLLM extension: each prompt token's logprob and this many most likely tokens there.
    prompt_logprobs: Int32 | None = None
    user: str | None = None  # accepted and ignored
    #: Token id (as a string, OpenAI's shape) -> a bias in [-100, 100] added to its logit.
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    #: vLLM's extra-body constraint: exactly one of json, json_object, regex, choice,
    #: grammar (and optionally backend).
    structured_outputs: dict[str, Any] | None = None
    allowed_token_ids: list[Int32] | None = None  # vLLM extension
    bad_words: list[str] | None = None  # vLLM extension
    # Known OpenAI features this server does not implement: rejected unless left unset.
    best_of: Int32 | None = None
    echo: bool | None = None
    suffix: str | None = None
    tools: list[Any] | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[Int32] | list[str] | list[list[Int32]]
    #: Log-probabilities of each token and of this many most likely alternatives.
    logprobs: Int32 | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice={"type": "function", "function": {"name": ...}}``: call this one."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: Int32 | None = None
    #: Return each content token's log-probability ...
    logprobs: bool = False
    #: ... and this many most likely alternatives at each position (needs ``logprobs``).
    top_logprobs: Int32 | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: vLLM's two request shapes in one, told apart by which of
    ``prompt`` (a text, tokenized as ``/v1/completions`` tokenizes it) and ``messages`` (a
    conversation, through the chat template as ``/v1/chat/completions`` applies it) is
    given; exactly one must be."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    #: Add the tokenizer's special tokens (a BOS); default: true for a prompt (as
    #: completions do), false for messages (the template writes its own).
    add_special_tokens: bool | None = None
    #: Messages only: end with the opening of the assistant's reply; default: true, unless
    #: ``continue_final_message``.
    add_generation_prompt: bool | None = None
    #: Messages only: leave the last message open, for the model to go on with it.
    continue_final_message: bool = False
    #: Messages only: the tools, shown to the template as a chat request with a forced
    #: ``tool_choice`` shows them.
    tools: list[ChatTool] | None = None
    #: Also return each token's string (the tokenizer's own pieces, vLLM's ``token_strs``).
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[Int32]


# ---- responses --------------------------------------------------------------------------


class TokenizeResponse(BaseModel):
    count: int
    #: The context length: whether the tokens fit is the caller's question.
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class Timings(BaseModel):
    """One request's timings, llama.cpp server's ``timings`` object plus ``queue_ms``.

    As in llama.cpp, ``prompt_n`` counts the prompt tokens computed and ``cache_n`` those
    the prefix cache served (together: ``usage.prompt_tokens``); ``prompt_ms`` runs from
    the request's first scheduling to its first token, ``predicted_ms`` from the first
    token to the last, and ``predicted_n`` counts every generated token (the first one's
    time is in ``prompt_ms``). A rate or per-token time whose divisor is 0 is ``null`` (as
    llama.cpp's JSON shows its infinities). ``queue_ms``: from arrival (after tokenizing)
    to the first scheduling. Times are in milliseconds, as the API process saw the tokens
    arrive.
    """

    cache_n: int
    prompt_n: int
    prompt_ms: float | None
    prompt_per_token_ms: float | None
    prompt_per_second: float | None
    predicted_n: int
    predicted_ms: float | None
    predicted_per_token_ms: float | None
    predicted_per_second: float | None
    queue_ms: float | None


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogProbs(BaseModel):
    """The legacy completions API's logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    #: Character offset of each token in the completion's text.
    text_offset: list[int] = Field(default_factory=list)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    """The chat API's logprobs: one entry per content token."""

    content: list[ChatTokenLogprob] | None = None


#: vLLM's ``prompt_logprobs`` shape: per prompt token (``None`` for the first), token id ->
#: ``{"logprob", "rank", "decoded_token"}``.
PromptLogprobsJson = list[dict[str, dict[str, Any]] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extension
    prompt_logprobs: PromptLogprobsJson | None = None  # vLLM extension


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class FunctionCall(BaseModel):
    name: str
    #: The arguments as JSON text (OpenAI's shape: a string, not an object).
    arguments: str


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    #: vLLM's field: the reasoning a ``--reasoning-parser`` split off (``None``: none).
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsJson | None = None  # vLLM extension


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "vlite"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

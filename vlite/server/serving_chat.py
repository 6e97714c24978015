"""``POST /v1/chat/completions``: reply to a conversation, streamed or not."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vlite.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from vlite.core.sampling_params import MAX_LOGPROBS, SamplingParams
from vlite.core.structured_output_params import StructuredOutputsParams
from vlite.engine.input_processor import Prompt
from vlite.server.chat_prompt import chat_prompt
from vlite.server.errors import OpenAIError
from vlite.server.logprobs import chat_logprobs, prompt_logprobs_json
from vlite.server.output_constraints import ToolPlan, tool_plan
from vlite.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
)
from vlite.server.reasoning import ReasoningSplit, new_split, reasoning_parser_class
from vlite.server.serving import UNSUPPORTED_FIELDS, Choice, OpenAIServing
from vlite.server.settings import ServerSettings
from vlite.server.tool_calls import NO_PARSER, ToolCallStream, new_stream, tool_parser_class


class ChatServing(OpenAIServing):
    """Serves the chat completions API with the model's chat template.

    With ``tools`` and a forced ``tool_choice`` the output is constrained to the call(s)
    and the reply carries ``message.tool_calls`` (see
    :mod:`vlite.server.output_constraints`); streamed, a named function's arguments arrive
    as they are generated, ``"required"``'s calls once the list is complete. With
    ``tool_choice="auto"`` the server's tool-call parser (``settings.tool_call_parser``;
    ``none``: no parser) reads the calls from free text, streamed or not
    (:mod:`vlite.server.tool_calls`).

    With a reasoning parser (``settings.reasoning_parser``) a reply's reasoning is split
    off first (:mod:`vlite.server.reasoning`): it goes out as ``reasoning_content``, and
    only the answer after it is content and read for tool calls. A forced tool call's
    output is all call (its grammar leaves no room to reason), so it is not split.

    Raises:
        ConfigError: at construction, ``settings.tool_call_parser`` or
            ``settings.reasoning_parser`` names no registered parser of its kind.
    """

    id_prefix = "chatcmpl"
    unsupported_fields = {k: v for k, v in UNSUPPORTED_FIELDS.items() if k != "tools"}

    def __init__(
        self, engine: Any, served_model_name: str, settings: ServerSettings | None = None
    ) -> None:
        super().__init__(engine, served_model_name, settings)
        name = self.settings.tool_call_parser
        self.tool_parser_cls = tool_parser_class(name) if name not in (None, NO_PARSER) else None
        name = self.settings.reasoning_parser
        self.reasoning_parser_cls = reasoning_parser_class(name) if name else None
        #: Whether output constraints start after the reasoning (a reasoning parser, and
        #: no ``--structured-outputs-in-reasoning``).
        self.constrains_answer_only = (
            self.reasoning_parser_cls is not None
            and not self.settings.structured_outputs_in_reasoning
        )

    def tool_plan(self, request: ChatCompletionRequest) -> ToolPlan:
        """The request's :class:`ToolPlan` (``"auto"`` where this server has a parser)."""
        return tool_plan(request, has_parser=self.tool_parser_cls is not None)

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        prompt, params = await self.prepare(request)
        return await self.serve(request, raw_request, prompt, params)

    async def prepare(self, request: ChatCompletionRequest) -> tuple[Prompt, SamplingParams]:
        """The checked request's prompt and sampling parameters; shared with the endpoints
        that translate their requests into a chat request (``/v1/messages``)."""
        self.check_request(request)
        num_top = _num_top_logprobs(request)
        plan = self.tool_plan(request)
        prompt = await chat_prompt(self, request.messages, plan.tools)
        num_prompt_tokens = len(prompt["prompt_token_ids"])
        max_tokens = request.max_completion_tokens or request.max_tokens
        self.check_length(num_prompt_tokens, max_tokens, "messages")
        if max_tokens is None:
            max_tokens = self.default_max_tokens(num_prompt_tokens)
        params = self.sampling_params(
            request, max_tokens, logprobs=num_top, constraint=plan.constraint
        )
        if params.structured_outputs is not None and self.constrains_answer_only:
            params.structured_outputs = self._after_reasoning(params.structured_outputs)
        return prompt, params

    def _after_reasoning(self, constraint: StructuredOutputsParams) -> StructuredOutputsParams:
        """``constraint`` on the answer only: after the reasoning parser's markers."""
        parser_cls = self.reasoning_parser_cls
        if parser_cls.markers is None:
            raise OpenAIError(
                f"the reasoning parser {self.settings.reasoning_parser!r} declares no markers, "
                "so response_format, structured_outputs and forced tool calls cannot start "
                "after its reasoning (start the server with --structured-outputs-in-reasoning "
                "to constrain the whole reply)",
                param="response_format",
            )
        return dataclasses.replace(constraint, after_reasoning=parser_cls.markers)

    def response(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        choices: list[Choice],
        total: UsageInfo,
        last: RequestOutput,
    ) -> ChatCompletionResponse:
        num_top = _num_top_logprobs(request)
        plan = self.tool_plan(request)
        return ChatCompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=[self._chat_choice(choice, plan, num_top) for choice in choices],
            usage=total,
            prompt_logprobs=prompt_logprobs_json(last.prompt_logprobs),
        )

    def opening_events(
        self, request_id: str, n: int, first: RequestOutput
    ) -> Iterator[dict[str, Any]]:
        """The assistant role of each choice."""
        for index in range(n):
            yield self._chunk(request_id, index, DeltaMessage(role="assistant", content=""))

    def delta_events(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        completion: CompletionOutput,
        state: dict[int, Any],
    ) -> Iterator[dict[str, Any]]:
        """The reasoning and content deltas (the step's logprobs on the first), and the
        choice's finish reason; with a forced tool call, tool-call deltas instead of content,
        and with ``tool_choice="auto"`` what the tool-call parser reads of the answer."""
        plan = state.get("plan") or state.setdefault("plan", self.tool_plan(request))
        index = completion.index
        reasoning, answer = self._split_step(completion, plan, state)
        if plan.calls_tools:
            if reasoning:
                yield self._chunk(request_id, index, DeltaMessage(reasoning_content=reasoning))
            yield from self._tool_call_events(request_id, plan, completion, answer, state)
            return
        deltas = [DeltaMessage(reasoning_content=reasoning)] if reasoning else []
        if plan.parses_calls:
            stream = self._call_stream(plan, index, state)
            deltas += stream.feed(answer)
            if completion.finished:
                deltas += stream.finish()
        elif answer:
            deltas.append(DeltaMessage(content=answer))
        logprobs = _logprobs(
            _num_top_logprobs(request), completion.token_ids, completion.logprobs or []
        )
        if not deltas and logprobs is not None and completion.token_ids:
            deltas = [DeltaMessage() if plan.parses_calls else DeltaMessage(content="")]
        for position, delta in enumerate(deltas):
            step_logprobs = logprobs if position == 0 else None
            yield self._chunk(request_id, index, delta, logprobs=step_logprobs)
        if completion.finished:
            reason = completion.finish_reason
            if plan.parses_calls and self._call_stream(plan, index, state).num_calls:
                reason = "tool_calls" if reason == "stop" else reason
            yield self._chunk(request_id, index, DeltaMessage(), reason)

    def _split_step(
        self, completion: CompletionOutput, plan: ToolPlan, state: dict
    ) -> tuple[str, str]:
        """The ``(reasoning, answer)`` this step settles of its choice's reply (all answer
        without a reasoning parser, or when a forced call constrains the whole reply)."""
        key = ("reasoning", completion.index)
        split = state.get(key) or state.setdefault(key, self._new_split(plan))
        reasoning, answer = split.feed(completion.text)
        if completion.finished:
            more_reasoning, more_answer = split.finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        return reasoning, answer

    def _call_stream(self, plan: ToolPlan, index: int, state: dict) -> ToolCallStream:
        """Choice ``index``'s tool-call parser, made on its first use."""
        key = ("parser", index)
        return state.get(key) or state.setdefault(
            key, new_stream(self.tool_parser_cls, plan.tools or [])
        )

    def _new_split(self, plan: ToolPlan) -> ReasoningSplit:
        """A choice's split: the reasoning parser's, except that a reply a forced call
        constrains from its start (``--structured-outputs-in-reasoning``) is all answer."""
        if plan.calls_tools and not self.constrains_answer_only:
            return new_split(None)
        return new_split(self.reasoning_parser_cls)

    def _tool_call_events(
        self,
        request_id: str,
        plan: ToolPlan,
        completion: CompletionOutput,
        answer: str,
        state: dict,
    ) -> Iterator[dict[str, Any]]:
        """A named function: its name once (when its answer begins), then argument deltas
        as they come. Required calls: the answer is kept until the list is complete, then
        one delta per call. An answer that does not parse (cut by ``max_tokens``) ends as
        plain content."""
        index = completion.index
        texts = state.setdefault(("text", index), [])
        texts.append(answer)
        if plan.mode == "named" and answer:
            if ("opened", index) not in state:
                state["opened", index] = True
                call = ToolCall(function=FunctionCall(name=plan.function_name, arguments=""))
                yield self._chunk(request_id, index, _call_delta(0, call))
            arguments = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=answer))
            yield self._chunk(request_id, index, DeltaMessage(tool_calls=[arguments]))
        if not completion.finished:
            return
        calls = plan.tool_calls("".join(texts))
        if plan.mode == "required":
            if calls is None:
                yield self._chunk(request_id, index, DeltaMessage(content="".join(texts)))
            for position, call in enumerate(calls or []):
                yield self._chunk(request_id, index, _call_delta(position, call))
        reason = _finish_reason(completion.finish_reason, calls)
        yield self._chunk(request_id, index, DeltaMessage(), reason)

    def _chat_choice(self, choice: Choice, plan: ToolPlan, num_top: int | None) -> ChatChoice:
        """A whole reply: its reasoning split off, then the answer's calls read (a forced
        call's constrained answer, or ``tool_choice="auto"``'s parser, through the same
        paths as a stream). Content is ``None`` (vLLM's) when the reply is reasoning only,
        or calls only."""
        reasoning, answer = self._new_split(plan).whole(choice.text)
        content, calls = answer, None
        if plan.calls_tools:  # a forced call: the answer's calls, or it as content
            calls = plan.tool_calls(answer)
            content = None if calls is not None else answer
        elif plan.parses_calls:
            reply = new_stream(self.tool_parser_cls, plan.tools or []).whole(answer)
            content, calls = reply.content, reply.tool_calls
        message = ChatResponseMessage(
            content=content if content or not reasoning else None,
            reasoning_content=reasoning or None,
            tool_calls=calls,
        )
        return ChatChoice(
            index=choice.index,
            message=message,
            logprobs=_logprobs(num_top, choice.token_ids, choice.logprobs),
            finish_reason=_finish_reason(choice.finish_reason, calls),
            stop_reason=choice.stop_reason,
        )

    def usage_event(self, request_id: str, total: UsageInfo) -> dict[str, Any]:
        chunk = ChatCompletionChunk(
            id=request_id, model=self.served_model_name, choices=[], usage=total
        )
        return chunk.model_dump(exclude_none=True)

    def _chunk(
        self,
        request_id: str,
        index: int,
        delta: DeltaMessage,
        finish_reason: str | None = None,
        logprobs: ChatLogProbs | None = None,
    ) -> dict[str, Any]:
        choice = ChatStreamChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason
        )
        chunk = ChatCompletionChunk(id=request_id, model=self.served_model_name, choices=[choice])
        payload = chunk.model_dump(exclude={"usage"})
        # OpenAI sends only the delta's present keys, but null finish_reason and logprobs.
        payload["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        return payload


def _finish_reason(reason: str | None, calls: list[ToolCall] | None) -> str | None:
    """OpenAI's ``"tool_calls"`` for a reply that is tool calls."""
    return "tool_calls" if calls is not None and reason == "stop" else reason


def _call_delta(position: int, call: ToolCall) -> DeltaMessage:
    """The delta that opens tool call ``position`` (its id, name and arguments so far)."""
    delta = DeltaToolCall(
        index=position,
        id=call.id,
        type="function",
        function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
    )
    return DeltaMessage(tool_calls=[delta])


def _num_top_logprobs(request: ChatCompletionRequest) -> int | None:
    """The engine's ``logprobs`` for a chat request: ``None`` unless ``logprobs`` is true."""
    top = request.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise OpenAIError(
            f"top_logprobs={top!r} is invalid: must be an integer in [0, {MAX_LOGPROBS}]",
            param="top_logprobs",
        )
    if not request.logprobs:
        if top:
            raise OpenAIError(f"top_logprobs={top!r} needs logprobs=true", param="top_logprobs")
        return None
    return top or 0


def _logprobs(
    num_top: int | None, token_ids: list[int], logprobs: list[PositionLogprobs]
) -> ChatLogProbs | None:
    if num_top is None:
        return None
    return chat_logprobs(token_ids, logprobs, num_top)

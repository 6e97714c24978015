"""vlite's per-token ``Logprob`` dicts in the two OpenAI shapes (completions and chat)."""

from __future__ import annotations

from typing import Any

from vlite.core.outputs import Logprob, PositionLogprobs
from vlite.server.protocol import (
    ChatLogProbs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogProbs,
)

#: JSON has no -inf: a token the model rules out entirely reports this (as vLLM does).
MIN_LOGPROB = -9999.0


def _value(logprob: Logprob) -> float:
    return max(logprob.logprob, MIN_LOGPROB)


def _top(position: PositionLogprobs, num_top: int) -> list[Logprob]:
    """The ``num_top`` most likely entries of a position, most likely first."""
    ranked = sorted(position.values(), key=lambda entry: entry.rank or 0)
    return [entry for entry in ranked if entry.rank is not None and entry.rank <= num_top][:num_top]


def completion_logprobs(
    token_ids: list[int], logprobs: list[PositionLogprobs], num_top: int, text_offset: int = 0
) -> CompletionLogProbs:
    """The completions shape for these tokens.

    Args:
        token_ids: the sampled tokens.
        logprobs: one position per token (the sampled token is a key of each).
        num_top: alternatives per position (the request's ``logprobs``).
        text_offset: offset of the first token in the completion's text (streams
            continue from where the previous chunk ended).
    """
    result = CompletionLogProbs()
    for token_id, position in zip(token_ids, logprobs):
        sampled = position[token_id]
        token = sampled.decoded_token or ""
        top = {entry.decoded_token or "": _value(entry) for entry in _top(position, num_top)}
        result.tokens.append(token)
        result.token_logprobs.append(_value(sampled))
        result.top_logprobs.append({token: _value(sampled), **top})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def prompt_logprobs_shape(
    token_ids: list[int],
    logprobs: list[PositionLogprobs | None],
    num_top: int,
    tokenizer: Any,
) -> CompletionLogProbs:
    """The completions shape for an echoed prompt: its first token has no logprob
    (``None`` in ``token_logprobs`` and ``top_logprobs``), the others as sampled tokens."""
    first = tokenizer.decode([token_ids[0]])
    rest = completion_logprobs(token_ids[1:], logprobs[1:], num_top, text_offset=len(first))
    return CompletionLogProbs(
        tokens=[first, *rest.tokens],
        token_logprobs=[None, *rest.token_logprobs],
        top_logprobs=[None, *rest.top_logprobs],
        text_offset=[0, *rest.text_offset],
    )


def joined_logprobs(first: CompletionLogProbs, second: CompletionLogProbs) -> CompletionLogProbs:
    """``first``'s tokens, then ``second``'s (whose offsets already count ``first``'s text)."""
    return CompletionLogProbs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


def prompt_logprobs_json(logprobs: list[PositionLogprobs | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs`` field: each position's dict with string token-id keys."""
    if logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            str(token_id): {
                "logprob": _value(entry),
                "rank": entry.rank,
                "decoded_token": entry.decoded_token,
            }
            for token_id, entry in position.items()
        }
        for position in logprobs
    ]


def _chat_entry(logprob: Logprob) -> ChatTopLogprob:
    token = logprob.decoded_token or ""
    return ChatTopLogprob(token=token, logprob=_value(logprob), bytes=list(token.encode()))


def chat_logprobs(
    token_ids: list[int], logprobs: list[PositionLogprobs], num_top: int
) -> ChatLogProbs:
    """The chat shape for these tokens (``num_top``: the request's ``top_logprobs``)."""
    content = []
    for token_id, position in zip(token_ids, logprobs):
        sampled = _chat_entry(position[token_id])
        top = [_chat_entry(entry) for entry in _top(position, num_top)]
        content.append(ChatTokenLogprob(**sampled.model_dump(), top_logprobs=top))
    return ChatLogProbs(content=content)

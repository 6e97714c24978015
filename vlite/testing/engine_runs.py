"""Small end-to-end runs for the conformance suites: cached tiny models, prompts, timeouts,
and transformers' greedy continuations (the oracle vlite's tokens are held to)."""

from __future__ import annotations

import atexit
import random
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from vlite.core.sampling_params import SamplingParams

T = TypeVar("T")

_MODEL_CACHE: dict[tuple, Path] = {}
_MODEL_CACHE_LOCK = threading.Lock()
_cache_root: Path | None = None


def _root() -> Path:
    global _cache_root
    if _cache_root is None:
        _cache_root = Path(tempfile.mkdtemp(prefix="vlite-tiny-models-"))
        atexit.register(shutil.rmtree, _cache_root, ignore_errors=True)
    return _cache_root


def cached_tiny_model(architecture: str = "LlamaForCausalLM", **settings: Any) -> Path:
    """A :func:`~vlite.testing.tiny_models.make_tiny_model` folder, made once per process.

    The folders are deterministic for given arguments, so suites (and repeated in-process
    pytest runs) share them; they live in a temporary directory removed at exit.
    """
    from vlite.testing.tiny_models import make_tiny_model

    key = (architecture, tuple(sorted(settings.items())))
    with _MODEL_CACHE_LOCK:
        folder = _MODEL_CACHE.get(key)
        if folder is None:
            folder = _root() / f"model-{len(_MODEL_CACHE)}"
            make_tiny_model(folder, architecture, **settings)
            _MODEL_CACHE[key] = folder
    return folder


@dataclass(frozen=True)
class PromptCase:
    """One prompt of an end-to-end run and how to sample it."""

    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0


def mixed_prompts(
    *,
    num_prompts: int,
    max_prompt_len: int,
    shared_prefix_len: int,
    max_tokens: tuple[int, int] = (4, 12),
    vocab_size: int = 300,
    seeded_sampling: bool = False,
    seed: int = 0,
) -> list[PromptCase]:
    """Prompts of mixed lengths, every third one sharing a prefix, greedy unless asked.

    With ``seeded_sampling`` every other prompt samples (temperature, top-p, top-k) with its
    own seed, so its tokens are reproducible too. Token ids avoid the special ids below 4.
    """
    rng = random.Random(seed)
    prefix = [rng.randrange(4, vocab_size) for _ in range(shared_prefix_len)]
    cases = []
    for index in range(num_prompts):
        length = rng.randint(1, max_prompt_len)
        tokens = [rng.randrange(4, vocab_size) for _ in range(length)]
        if index % 3 == 2 and shared_prefix_len:
            tokens = (prefix + tokens)[:max_prompt_len]
        num_new = rng.randint(*max_tokens)
        if seeded_sampling and index % 2:
            params = SamplingParams(
                max_tokens=num_new,
                temperature=0.8,
                top_p=0.9,
                top_k=50,
                seed=1000 + index,
                ignore_eos=True,
            )
        else:
            params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
        cases.append(PromptCase(tokens, params, priority=rng.randint(0, 2)))
    return cases


def generate_tokens(llm: Any, cases: Sequence[PromptCase]) -> list[list[int]]:
    """Token ids ``llm.generate`` produces for ``cases``, in order."""
    outputs = llm.generate(
        [{"prompt_token_ids": case.prompt_token_ids} for case in cases],
        [case.params for case in cases],
        priority=[case.priority for case in cases],
        use_tqdm=False,
    )
    return [list(output.outputs[0].token_ids) for output in outputs]


@dataclass(frozen=True)
class Continuation:
    """A greedy continuation: its token ids and each one's log-probability under the
    model's logits at its position (natural log, float32 ``log_softmax``)."""

    token_ids: list[int]
    logprobs: list[float]


def transformers_greedy(
    folder: Path | str, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[Continuation]:
    """What ``transformers``' float32 greedy ``generate`` continues each prompt with, one
    prompt at a time, always ``max_new_tokens`` tokens (the end-of-sequence token does not
    stop it, as ``ignore_eos``)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # like ignore_eos
    continuations = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([list(prompt)]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [
            torch.log_softmax(logits[0].float(), dim=-1)[token].item()
            for logits, token in zip(out.logits, tokens, strict=True)
        ]
        continuations.append(Continuation(tokens, logprobs))
    return continuations


class TimeoutExpired(AssertionError):
    """A call did not return in time: a hang."""


def call_with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """``fn()`` in a daemon thread; its result or exception, or :class:`TimeoutExpired`.

    A hung call leaves its daemon thread behind (it cannot be killed), which does not keep
    the process alive.
    """
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name=f"vlite-testing: {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutExpired(f"{what} did not return within {timeout_s:g} s (a hang)")
    if error:
        raise error[0]
    return result[0]

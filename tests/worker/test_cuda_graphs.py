"""Decode graphs: capture sizes, the persistent inputs' padding, and replays that give the
eager path's tokens.

A CPU has no CUDA graphs; :class:`RerunCapturer` stands in for one by rerunning the captured
callable over the same persistent inputs and metadata object, which is what a replay sees.
That checks the worker's side (buffers, padding, which steps replay) with the Triton
backend under the interpreter; the GPU suite replays real graphs.
"""

from __future__ import annotations

import pytest
import torch

from vlite import LLM, SamplingParams
from vlite.testing.attention_cases import build_metadata
from vlite.testing.engine_runs import cached_tiny_model
from vlite.worker.cuda_graphs import (
    PAD_SLOT,
    DecodeInputBuffers,
    NotCapturable,
    capture_sizes,
)


class RerunCapturer:
    """A stand-in for CUDA graphs: "replay" reruns the callable into the captured output."""

    def __init__(self) -> None:
        self.replays = 0

    def capture(self, fn):
        output = fn()

        def replay() -> None:
            self.replays += 1
            output.copy_(fn())

        return replay, output


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert capture_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    with pytest.raises(ValueError, match="largest=0"):
        capture_sizes(0)


def test_load_writes_the_step_and_pads_the_rest():
    buffers = DecodeInputBuffers(max_seqs=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    metadata = build_metadata([[5, 6], [7]], [(20, 1), (3, 1)], 16, torch.device("cpu"))
    buffers.load(torch.tensor([11, 12]), torch.tensor([20, 3]), metadata, size=4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 0, 0]
    assert buffers.positions[:4].tolist() == [20, 3, 0, 0]
    assert buffers.slot_mapping[:4].tolist() == [6 * 16 + 4, 7 * 16 + 3, PAD_SLOT, PAD_SLOT]
    assert buffers.seq_lens[:4].tolist() == [21, 4, 1, 1]
    assert buffers.block_tables[:2, :2].tolist() == [[5, 6], [7, 0]]
    replayed = buffers.metadata(4, max_seq_len=512)
    assert replayed.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert replayed.is_all_decode and replayed.max_seq_len == 512
    # The metadata's tensors are views: a later load is what the next replay reads.
    one = build_metadata([[8]], [(0, 1)], 16, torch.device("cpu"))
    buffers.load(torch.tensor([9]), torch.tensor([0]), one, size=1)
    assert replayed.seq_lens.tolist() == [1, 4, 1, 1]
    assert replayed.slot_mapping.tolist()[0] == 8 * 16


def _greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    # Different lengths: the batch shrinks as requests finish, through padded sizes.
    params = [
        SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


#: Six prompts of different lengths (the batch shrinks as requests finish).
PROMPTS = [[3 + i, 40 + 7 * i, 9][: 1 + i % 3] + [17] * (i * 5) for i in range(6)]


def _eager_tokens_and_a_fresh_llm() -> tuple[list[list[int]], LLM]:
    """The tiny Llama's greedy tokens for :data:`PROMPTS`, eager, and a new engine of it to
    capture graphs in (the Triton backend, under the interpreter)."""
    options = dict(
        model=str(cached_tiny_model("LlamaForCausalLM")),
        attention_backend="triton",
        num_kv_blocks=64,
        dtype="float32",
        device="cpu",
    )
    return _greedy_tokens(LLM(**options), PROMPTS), LLM(**options)


def test_replayed_decodes_give_the_eager_tokens():
    eager, llm = _eager_tokens_and_a_fresh_llm()
    worker = llm.llm_engine.engine_core.executor.worker
    assert worker.cuda_graphs_unavailable_reason() is None
    capturer = RerunCapturer()
    report = worker.runner.capture_decode_graphs(capture_sizes(4), 512, capturer)
    assert report.sizes == (1, 2, 4)
    assert _greedy_tokens(llm, PROMPTS) == eager
    # Six requests decode eagerly until at most four remain, which replay (padded to 4, 2, 1).
    assert capturer.replays >= 6


class RefusingCapturer(RerunCapturer):
    """Refuses forwards of more than ``largest`` rows, as a CPU recording refuses a forward
    whose many-row products compute in PyTorch."""

    def __init__(self, largest: int) -> None:
        super().__init__()
        self.largest = largest

    def capture(self, fn):
        rows = fn().shape[0]
        if rows > self.largest:
            raise NotCapturable(f"a forward of {rows} rows computes elsewhere")
        return super().capture(fn)


def test_sizes_the_capturer_refuses_run_eagerly_and_the_rest_replay():
    eager, llm = _eager_tokens_and_a_fresh_llm()
    runner = llm.llm_engine.engine_core.executor.worker.runner
    capturer = RefusingCapturer(largest=2)
    report = runner.capture_decode_graphs((1, 2, 3, 4, 8), 512, capturer)
    assert report.sizes == (1, 2) and report.eager_sizes == (3, 4, 8)
    assert report.describe().endswith("; eager at 3-4, 8 (a forward of 3 rows computes elsewhere)")
    assert runner.decode_graphs.padded_size(2) == 2 and runner.decode_graphs.padded_size(3) is None
    assert _greedy_tokens(llm, PROMPTS) == eager
    assert capturer.replays >= 3  # the last two requests' steps, at 2 and then 1
    with pytest.raises(NotCapturable, match="a forward of 1 rows"):
        runner.capture_decode_graphs((1, 2), 512, RefusingCapturer(largest=0))


def test_a_backend_without_graph_support_runs_eagerly():
    llm = LLM(
        model=str(cached_tiny_model("LlamaForCausalLM")),
        attention_backend="torch",
        num_kv_blocks=16,
        device="cpu",
    )
    worker = llm.llm_engine.engine_core.executor.worker
    assert worker.cuda_graphs_unavailable_reason() == (
        "attention backend 'torch' does not support them"
    )
    assert worker.cuda_graph_report is None and worker.runner.decode_graphs is None


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("exact_float32_products")
@pytest.mark.parametrize("num_prompts", [1, 3, 8, 21])
def test_cuda_graph_replays_give_the_eager_tokens(num_prompts):
    """Real graphs, captured on the GPU: every decode batch size from ``num_prompts`` down
    (padded to 1, 2, 4, 8, 16, 32) replays the eager path's greedy tokens."""
    model = str(cached_tiny_model("LlamaForCausalLM"))
    prompts = [[3 + i, 40 + 7 * i, 9][: 1 + i % 3] + [17] * (i * 5) for i in range(num_prompts)]
    options = dict(model=model, attention_backend="triton", num_kv_blocks=128, dtype="float32")
    eager = _greedy_tokens(LLM(**options, device="cuda", enforce_eager=True), prompts)
    llm = LLM(**options, device="cuda", max_cudagraph_capture_size=32)
    report = llm.llm_engine.engine_core.executor.worker.cuda_graph_report
    assert report is not None and report.sizes == (1, 2, 4, 8, 16, 32)
    assert "CUDA graphs: 6 decode batch sizes (1-32)" in report.describe()
    assert _greedy_tokens(llm, PROMPTS) == eager


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("exact_float32_products")
def test_overlapped_decodes_on_cuda_give_the_synchronous_tokens():
    """With async scheduling each batch's decodes go on in the next batch before their
    tokens reach the host. Greedy tokens (stops by length and by stop token included) equal
    the synchronous engine's, both replaying graphs."""
    model = str(cached_tiny_model("LlamaForCausalLM"))
    prompts = [[3 + i, 40 + 7 * i, 9][: 1 + i % 3] + [17] * (i * 5) for i in range(12)]
    options = dict(model=model, attention_backend="triton", num_kv_blocks=128, dtype="float32")
    synchronous = LLM(**options, device="cuda", async_scheduling=False)
    expected = _greedy_tokens(synchronous, prompts)
    stops = [
        SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[t[2]]) for t in expected
    ]
    expected_stops = synchronous.generate([{"prompt_token_ids": p} for p in prompts], stops)
    overlapping = LLM(**options, device="cuda", async_scheduling=True)
    assert overlapping.llm_engine.engine_core.scheduler.overlaps_decodes
    assert _greedy_tokens(overlapping, prompts) == expected
    outputs = overlapping.generate([{"prompt_token_ids": p} for p in prompts], stops)
    assert [o.outputs[0].token_ids for o in outputs] == [
        o.outputs[0].token_ids for o in expected_stops
    ]

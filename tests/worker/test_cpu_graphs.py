"""CPU step replay: a decode forward's C calls recorded once per batch size and replayed.

The oracle is the eager forward: a replay makes the same C calls on the same memory, so its
greedy tokens must be identical, not close. The recording's guard must refuse any forward
PyTorch computes in, since a replay would skip that work.
"""

from __future__ import annotations

import pytest
import torch

from vlite import LLM, SamplingParams
from vlite.kernels import call_replay, native
from vlite.testing.tiny_gguf import write_tiny_gguf
from vlite.testing.tiny_models import make_tiny_model
from vlite.worker import cpu_graphs
from vlite.worker.cpu_graphs import NativeCallCapturer, NotCapturable
from vlite.worker.cuda_graphs import DecodeGraphs
from vlite.worker.worker import CPU_REPLAY_MAX_SEQS as MAX

PROMPTS = [[5, 9, 14, 3], [7, 7, 2], [11, 30, 4, 8, 19, 6], [2], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu-replay")
    folder = make_tiny_model(root / "hf", "LlamaForCausalLM")
    return str(write_tiny_gguf(folder, root / "tiny.gguf", quantize=("Q4_1", "Q8_0")))


def _worker(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_replayed_decode_steps_give_the_eager_tokens_exactly(
    quantized_gguf, monkeypatch, capsys, replayed_decode_sizes
):
    eager = LLM(model=quantized_gguf, num_kv_blocks=32, enforce_eager=True)
    assert _worker(eager).runner.decode_graphs is None
    expected = _greedy(eager, PROMPTS) + _greedy(eager, PROMPTS[:1])
    del eager

    replays = []
    real_replay = DecodeGraphs.replay

    def counting_replay(self, input_ids, positions, metadata):
        hidden = real_replay(self, input_ids, positions, metadata)
        replays.append(None if hidden is None else input_ids.shape[0])
        return hidden

    monkeypatch.setattr(DecodeGraphs, "replay", counting_replay)
    compiled = []

    def spying_compile(calls):
        compiled.append(real_compile(calls))
        return compiled[-1]

    real_compile = cpu_graphs.compile_replay
    monkeypatch.setattr(cpu_graphs, "compile_replay", spying_compile)
    llm = LLM(model=quantized_gguf, num_kv_blocks=32)
    # On x86-64 Linux every recorded call (norms with a float, attention with 26
    # arguments and the thread count) is replayed by the C loop.
    on_c = call_replay._library() is not None
    sizes = replayed_decode_sizes("Q4_1", "Q8_0")  # 1-32 (1-31 in AVX2 builds)
    assert len(compiled) == len(sizes) and all(r.calls_in_c == on_c for r in compiled)
    replay_line = f"CPU step replay: {len(sizes)} decode batch sizes (1-{len(sizes)})"
    assert replay_line in capsys.readouterr().err
    assert _worker(llm).runner.decode_graphs.sizes == sizes
    # Five prompts decode as a batch of 5, then one alone.
    assert _greedy(llm, PROMPTS) + _greedy(llm, PROMPTS[:1]) == expected
    assert 5 in replays and 1 in replays  # decode steps did replay


def test_recording_runs_no_kernel_and_the_replay_runs_it():
    x = torch.ones(3, 8)
    with native.recording(execute=False) as calls:
        native.fused_ops().scale_(x, 2.0)
    assert len(calls) == 1 and torch.equal(x, torch.ones(3, 8))
    calls[0](1)
    assert torch.equal(x, torch.full((3, 8), 2.0))


def test_a_forward_pytorch_computes_in_runs_eagerly_and_says_why(
    quantized_gguf, monkeypatch, capsys
):
    from vlite.models.llama import LlamaForCausalLM

    real_forward = LlamaForCausalLM.forward

    def forward_with_a_torch_op(self, *args, **kwargs):
        return real_forward(self, *args, **kwargs) * 1.0

    monkeypatch.setattr(LlamaForCausalLM, "forward", forward_with_a_torch_op)
    llm = LLM(model=quantized_gguf, num_kv_blocks=32)
    err = capsys.readouterr().err
    assert "CPU step replay: off (the forward computes torch's mul, outside the C" in err
    assert _worker(llm).runner.decode_graphs is None
    assert len(_greedy(llm, PROMPTS[:2])[0]) == 12


def test_another_attention_backend_is_not_recorded(quantized_gguf, capsys):
    # Its work may be invisible to the recording (the Triton interpreter computes in NumPy).
    llm = LLM(model=quantized_gguf, num_kv_blocks=32, attention_backend="torch")
    err = capsys.readouterr().err
    assert "CPU step replay: off (attention backend 'torch' is not the C kernel 'cpu')" in err
    assert _worker(llm).runner.decode_graphs is None


def test_a_float_model_is_not_recorded(tmp_path, capsys):
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    llm = LLM(model=str(folder), num_kv_blocks=8)
    assert "CPU step replay: off (the model does not compute with the C kernels)" in (
        capsys.readouterr().err
    )
    assert _worker(llm).runner.decode_graphs is None


def test_the_guard_refuses_computation_writes_and_forwards_without_c_calls():
    x, index = torch.randn(4), torch.tensor([1])
    with pytest.raises(NotCapturable, match="computes torch's add"):
        NativeCallCapturer().capture(lambda: x + 1)
    with pytest.raises(NotCapturable, match="computes torch's index_select"):
        NativeCallCapturer().capture(lambda: x.index_select(0, index))
    with pytest.raises(NotCapturable, match="computes torch's item"):
        NativeCallCapturer().capture(lambda: torch.empty(1) if x[0].item() else None)
    with pytest.raises(NotCapturable, match="writes a tensor in place with torch's add_"):
        NativeCallCapturer().capture(lambda: x.add_(1))
    with pytest.raises(NotCapturable, match="in place with torch's __setitem__"):
        NativeCallCapturer().capture(lambda: x.__setitem__(0, 1.0))
    with pytest.raises(NotCapturable, match="no C kernel call"):
        NativeCallCapturer().capture(lambda: torch.empty(3))


def test_a_replay_reruns_the_c_calls_over_inputs_rewritten_in_place():
    ops = native.fused_ops()
    gate_up = torch.randn(2, 16)
    capturer = NativeCallCapturer()
    replay, output = capturer.capture(lambda: ops.silu_mul(gate_up))
    assert capturer.retained_bytes >= output.numel() * 4
    gate_up.copy_(torch.randn(2, 16) * 3)
    replay()
    assert torch.equal(output, ops.silu_mul(gate_up))


def test_a_recorded_call_reads_the_thread_count_when_it_runs():
    seen = []

    def function(*args):
        seen.append(args)
        return 0

    function.__name__ = "vl_example"
    call = native.RecordedCall(function, (1, native.THREADS, 3), threads_at=1)
    call(7)
    call(2)
    assert seen == [(1, 7, 3), (1, 2, 3)]
    failing = native.RecordedCall(lambda: 1, (), threads_at=None)
    with pytest.raises(RuntimeError, match="failed on replay"):
        failing(1)


def test_an_out_of_range_row_is_refused_in_c_so_a_replay_checks_it_too():
    kernels = native.gguf_block_kernels()
    blocks = torch.zeros(4, 18, dtype=torch.uint8)  # four Q4_0 rows of 32 values
    assert kernels.gather_rows("Q4_0", blocks, 32, torch.tensor([3, 0])).shape == (2, 32)
    for bad in ([4], [-1], [0, 9]):
        with pytest.raises(IndexError, match="out of range for a matrix of 4 rows"):
            kernels.gather_rows("Q4_0", blocks, 32, torch.tensor(bad))


def test_paged_attention_skips_the_padding_rows_slot():
    kernel = native.paged_attention_kernel()
    cache = torch.zeros(2, 2, 16, 1, 32)
    step = kernel.step(
        torch.tensor([3, -1]),  # the second row is padding
        torch.tensor([[0], [1]], dtype=torch.int32),
        torch.tensor([4, 1], dtype=torch.int32),
        torch.tensor([0, 1, 2], dtype=torch.int32),
        0.5,
    )
    keys, values = torch.randn(2, 1, 32), torch.randn(2, 1, 32)
    step(torch.randn(2, 2, 32), keys, values, cache)
    assert torch.equal(cache[0, 0, 3, 0], keys[0, 0])
    written = cache.clone()
    written[:, 0, 3] = 0
    assert not written.any()  # nothing else, and nothing at "slot -1" (before the cache)


needs_c_replay = pytest.mark.skipif(
    call_replay._library() is None, reason="the C replay runs on x86-64 Linux only"
)


@needs_c_replay
def test_a_kernel_failing_in_the_c_replay_is_named():
    kernels = native.gguf_block_kernels()
    blocks = torch.zeros(4, 18, dtype=torch.uint8)
    rows = torch.tensor([3, 0])
    with native.recording() as calls:
        gathered = kernels.gather_rows("Q4_0", blocks, 32, rows)  # kept: the replay writes it
    replay = call_replay.compile_replay(calls)
    assert replay.calls_in_c
    replay(1)
    rows[0] = 9  # out of range: the kernel returns a failure
    with pytest.raises(RuntimeError, match="vl_gather_rows failed on replay"):
        replay(1)
    assert gathered.shape == (2, 32)


def test_a_call_the_c_replay_cannot_make_is_made_from_python():
    seen = []

    def function(*args):
        seen.append(args)
        return 0

    function.__name__ = "vl_untyped"  # no argtypes: not replayable in C
    replay = call_replay.compile_replay([native.RecordedCall(function, (5, 6), None)])
    assert not replay.calls_in_c
    replay(2)
    assert seen == [(5, 6)]


def test_a_quantized_qwen3_with_its_qk_norms_replays_the_eager_tokens(
    tmp_path, capsys, replayed_decode_sizes
):
    # Its per-head q/k norms run in place on the qkv product (one C call each), so nothing
    # in the forward computes in PyTorch and the steps are recorded.
    folder = make_tiny_model(tmp_path / "hf", "Qwen3ForCausalLM")
    path = str(write_tiny_gguf(folder, tmp_path / "q.gguf", quantize=("Q8_0", "Q8_0")))
    eager = _greedy(LLM(model=path, num_kv_blocks=32, enforce_eager=True), PROMPTS)
    capsys.readouterr()
    llm = LLM(model=path, num_kv_blocks=32)
    largest = len(replayed_decode_sizes("Q8_0"))
    assert f"CPU step replay: {largest} decode batch sizes (1-{largest})" in (
        capsys.readouterr().err
    )
    assert _greedy(llm, PROMPTS) == eager


@torch.inference_mode()
def test_the_recordings_memory_is_sized_from_forwards_of_one_and_two_rows(quantized_gguf):
    llm = LLM(model=quantized_gguf, num_kv_blocks=32)
    graphs = _worker(llm).runner.decode_graphs
    capturer = graphs.capturer
    one, two = (capturer._memory_of(graphs._warmed_up_forward(rows)) for rows in (1, 2))
    assert two > one > 0
    assert capturer.arena.numel() == one + (two - one) * (MAX - 1)
    # Every intermediate tensor's size is affine in the rows: the largest size fits.
    largest = graphs.sizes[-1]  # MAX, or below it where many rows multiply in PyTorch
    assert capturer._memory_of(graphs._warmed_up_forward(largest)) <= capturer.arena.numel()

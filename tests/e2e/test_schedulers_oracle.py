"""Schedulers end to end on a tiny random model: same greedy tokens as ``fcfs``.

``priority`` under a small KV cache (preemptions) and ``chunked-prefill`` with a
1000-token prompt split under a 64-token budget must produce exactly the tokens of an
unchunked ``fcfs`` run; the statistics and the ``vlite run --trace`` JSONL show the mixed
decode-and-prefill steps.
"""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from vlite import LLM, SamplingParams
from vlite.cli.main import cli
from vlite.core.stats import StepRecord, StepStats
from vlite.testing.engine_runs import cached_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG_PROMPT_LEN = 1000
BUDGET = 64


@pytest.fixture(scope="module")
def model() -> str:
    return str(cached_tiny_model("LlamaForCausalLM", max_position_embeddings=2048))


class StatsRecorder:
    """A step observer that keeps every step's StepStats in ``steps``."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []

    def __call__(self, record: StepRecord) -> None:
        self.steps.append(record.stats)


def prompts(lengths: list[int], seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(4, 300) for _ in range(n)]} for n in lengths]


def greedy_tokens(llm: LLM, inputs: list[dict], **kwargs) -> list[list[int]]:
    outputs = llm.generate(inputs, GREEDY, use_tqdm=False, **kwargs)
    return [output.outputs[0].token_ids for output in outputs]


def test_priority_gives_fcfs_greedy_tokens_under_preemption(model):
    inputs = prompts([5, 40, 17, 33, 2, 48, 9, 26])
    settings = dict(model=model, block_size=4, num_kv_blocks=24, max_num_seqs=4)
    expected = greedy_tokens(LLM(**settings, scheduler="fcfs"), inputs)
    llm = LLM(**settings, scheduler="priority")
    recorder = StatsRecorder()
    llm.llm_engine.add_step_observer(recorder)

    got = greedy_tokens(llm, inputs, priority=[3, 0, 2, 1, 0, 3, 1, 2])

    assert got == expected
    assert sum(s.num_preemptions for s in recorder.steps) > 0, "the cache should run out"


def test_priority_with_one_sequence_finishes_in_priority_order(model):
    llm = LLM(model=model, scheduler="priority", max_num_seqs=1)
    finished: list[str] = []
    engine = llm.llm_engine
    for index, priority in enumerate([2, 0, 1, 0]):
        engine.add_request(f"r{index}", prompts([6], seed=index)[0], GREEDY, priority)
    while engine.has_unfinished_requests():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished == ["r1", "r3", "r2", "r0"]


def test_chunked_prefill_of_a_1000_token_prompt_gives_the_unchunked_tokens(model):
    inputs = prompts([7, LONG_PROMPT_LEN, 3, 20])
    settings = dict(model=model, block_size=16, max_num_seqs=8)
    unchunked = LLM(**settings, scheduler="fcfs", max_num_batched_tokens=1024)
    expected = greedy_tokens(unchunked, inputs)
    chunked = LLM(**settings, scheduler="chunked-prefill", max_num_batched_tokens=BUDGET)
    recorder = StatsRecorder()
    chunked.llm_engine.add_step_observer(recorder)

    assert greedy_tokens(chunked, inputs) == expected

    steps = recorder.steps
    assert max(s.num_scheduled_tokens for s in steps) <= BUDGET
    mixed = [s for s in steps if s.num_decode_tokens and s.num_prefill_tokens]
    # The 7-token prompt decodes beside the long prompt's chunks in every step after its own.
    assert len(mixed) >= GREEDY.max_tokens - 1, "decodes should run beside the chunks"
    assert len(steps) < LONG_PROMPT_LEN // BUDGET + 2 * GREEDY.max_tokens
    assert chunked.llm_engine.last_step_stats is steps[-1]


def test_trace_shows_mixed_steps_within_the_budget_and_each_lifecycle(model, tmp_path):
    rng = random.Random(1)
    long_text = " ".join(rng.choice(["red", "blue", "fox", "sea", "boat"]) for _ in range(120))
    lines = [json.dumps({"prompt": p, "max_tokens": 8}) for p in ["Hello", "The quick", long_text]]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    trace_path = tmp_path / "trace.jsonl"
    result = CliRunner().invoke(
        cli,
        [
            "run", "--model", model, "--scheduler", "chunked-prefill",
            "--max-num-batched-tokens", "32", "--input", str(tmp_path / "in.jsonl"),
            "--trace", str(trace_path), "--json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output

    records = [json.loads(line) for line in trace_path.read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert steps and all(0 < s["num_scheduled_tokens"] <= 32 for s in steps)
    assert [s["step_index"] for s in steps] == list(range(len(steps)))
    phases = [{entry["phase"] for entry in s["batch"]} for s in steps]
    assert {"prefill", "decode"} in phases, "no step mixed decodes with a prompt chunk"
    for step in steps:
        assert sum(e["num_scheduled_tokens"] for e in step["batch"]) == step["num_scheduled_tokens"]
    lifecycles: dict[str, list[dict]] = {}
    for record in records:
        if record["event"] == "request":
            lifecycles.setdefault(record["request_id"], []).append(record)
    assert len(lifecycles) == 3
    for history in lifecycles.values():
        computed = [r["num_computed_tokens"] for r in history]
        assert computed == sorted(computed), "no preemption here: counters only grow"
        assert history[-1]["status"] == "finished_length_capped"
        assert history[-1]["num_output_tokens"] == 8
        assert all(r["status"] in ("waiting", "running") for r in history[:-1])
    long_history = max(lifecycles.values(), key=lambda h: h[0]["num_prompt_tokens"])
    assert long_history[0]["num_prompt_tokens"] > 32, "the long prompt should need chunks"


def test_priority_with_chunked_prefill_admits_urgent_first_and_chunks_without_stalls(
    model, tmp_path
):
    # vlite run --scheduler priority --enable-chunked-prefill: the long, least urgent prompt
    # waits for a seat (max_num_seqs=2), then is chunked beside a decoding request.
    rng = random.Random(2)
    long_text = " ".join(rng.choice(["red", "blue", "fox", "sea", "boat"]) for _ in range(120))
    requests = [
        {"prompt": long_text, "max_tokens": 4, "priority": 5},
        {"prompt": "Hello", "max_tokens": 4, "priority": 2},
        {"prompt": "The quick brown fox", "max_tokens": 12, "priority": 0},
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in requests) + "\n")
    trace_path = tmp_path / "trace.jsonl"
    result = CliRunner().invoke(
        cli,
        [
            "run", "--model", model, "--scheduler", "priority", "--enable-chunked-prefill",
            "--max-num-batched-tokens", "32", "--max-num-seqs", "2",
            "--input", str(tmp_path / "in.jsonl"), "--trace", str(trace_path), "--json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output

    records = [json.loads(line) for line in trace_path.read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    first_seen = {}
    for step in steps:
        for entry in step["batch"]:
            first_seen.setdefault(entry["request_id"], step["step_index"])
    assert sorted(first_seen, key=first_seen.get) == ["2", "1", "0"]  # by priority
    chunk_steps = [s for s in steps if any(e["request_id"] == "0" for e in s["batch"])]
    long_chunks = [
        e["num_scheduled_tokens"]
        for s in chunk_steps
        for e in s["batch"]
        if e["request_id"] == "0" and e["phase"] == "prefill"
    ]
    assert len(long_chunks) >= 3, "the long prompt should be computed in chunks"
    # Every step in which the long prompt is chunked beside the urgent request decodes it.
    mixed = [s for s in chunk_steps if any(e["request_id"] == "2" for e in s["batch"])]
    assert mixed, "the long prompt's chunks should share steps with the urgent request"
    for step in mixed:
        (urgent,) = [e for e in step["batch"] if e["request_id"] == "2"]
        assert (urgent["phase"], urgent["num_scheduled_tokens"]) == ("decode", 1)
    outputs = [json.loads(line) for line in result.stdout.splitlines()]
    assert [len(o["token_ids"]) for o in outputs] == [4, 4, 12]


def test_headline_command_priority_scheduler_with_triton_attention():
    result = CliRunner().invoke(
        cli,
        ["run", "--scheduler", "priority", "--attn", "triton", "--max-tokens", "2", "--json",
         "The capital of France is"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout.splitlines()[0])
    assert len(record["token_ids"]) == 2 and record["finish_reason"] == "length"

"""AsyncLLM over a real engine-core process, on a tiny model: equality, streaming, aborts."""

from __future__ import annotations

import asyncio

import pytest

from vlite.core.config import VliteConfig
from vlite.core.outputs import RequestOutputKind
from vlite.core.sampling_params import SamplingParams
from vlite.engine.async_llm import AsyncLLM
from vlite.engine.llm import LLM
from vlite.testing.tiny_models import make_tiny_model

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 8  # 128 token slots: small enough to tell whether blocks come back
PROMPTS = ["Hello, my name is", "The quick brown fox", "Tell me a joke.", "Numbers: 1 2 3"]
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> VliteConfig:
    model = make_tiny_model(tmp_path_factory.mktemp("async-llm-model"), "LlamaForCausalLM")
    return VliteConfig(
        model=str(model), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS
    )


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(config, loop):
    engine = AsyncLLM.from_config(config, startup_timeout_s=TIMEOUT_S * 2)
    yield engine
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert engine.engine_core.process.exitcode == 0  # it was asked, and stopped cleanly
    assert engine.dead_error is None and not engine.is_running


@pytest.fixture(scope="module")
def llm(config) -> LLM:
    return LLM(config=config)


def run(loop, coro, timeout: float = TIMEOUT_S):
    """Run a coroutine on the module's loop, failing (not hanging) after ``timeout``."""
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


async def collect(engine, prompt, params, **kw):
    return [output async for output in engine.generate(prompt, params, **kw)]


async def assert_all_blocks_free(engine) -> None:
    stats = await engine.get_stats()
    assert stats.num_unfinished_requests == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks == NUM_KV_BLOCKS


def test_startup_reports_the_core(engine):
    info = engine.engine_info
    assert info.attention_backend_name == "cpu"
    assert (info.num_kv_blocks, info.block_size) == (NUM_KV_BLOCKS, BLOCK_SIZE)
    assert info.max_model_len == 512
    assert (
        engine.engine_core.process.is_alive and info.pid == engine.engine_core.process.process.pid
    )


def test_concurrent_greedy_outputs_equal_llm_generate(engine, llm, loop):
    params = [greedy(max_tokens=8 + 2 * i) for i in range(len(PROMPTS))]
    expected = llm.generate(PROMPTS, params, use_tqdm=False)

    async def all_requests():
        runs = [collect(engine, p, sp) for p, sp in zip(PROMPTS, params)]
        return await asyncio.gather(*runs)

    streams = run(loop, all_requests())

    for outputs, reference in zip(streams, expected):
        final = outputs[-1]
        assert final.finished
        assert final.outputs[0].token_ids == reference.outputs[0].token_ids
        assert final.outputs[0].text == reference.outputs[0].text
        assert final.outputs[0].finish_reason == reference.outputs[0].finish_reason
        assert final.prompt_token_ids == reference.prompt_token_ids
        assert all(not o.finished for o in outputs[:-1])


def test_streamed_outputs_grow_to_the_non_streamed_text(engine, llm, loop):
    params = greedy(max_tokens=16, ignore_eos=True)
    (expected,) = llm.generate(PROMPTS[0], params, use_tqdm=False)

    outputs = run(loop, collect(engine, PROMPTS[0], params))

    # How many outputs arrive depends on timing: the collector merges the ones a consumer
    # has not taken yet (as vLLM's does), so a fast engine may deliver all 16 tokens at once.
    assert len(outputs) >= 1
    for earlier, later in zip(outputs, outputs[1:]):
        assert later.outputs[0].token_ids[: len(earlier.outputs[0].token_ids)] == (
            earlier.outputs[0].token_ids
        )
        assert later.outputs[0].text.startswith(earlier.outputs[0].text)
    assert outputs[-1].outputs[0].text == expected.outputs[0].text
    assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    assert len(outputs[-1].outputs[0].token_ids) == 16


def test_delta_outputs_concatenate_to_the_full_text(engine, llm, loop):
    params = greedy(max_tokens=16, ignore_eos=True)
    (expected,) = llm.generate(PROMPTS[1], params, use_tqdm=False)

    deltas = run(loop, collect(engine, PROMPTS[1], params, output_kind=RequestOutputKind.DELTA))

    assert len(deltas) >= 1  # merged when the consumer lags (see the test above)
    assert "".join(d.outputs[0].text for d in deltas) == expected.outputs[0].text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == expected.outputs[0].token_ids
    assert [d.outputs[0].finish_reason for d in deltas][-1] == "length"


def test_final_only_yields_one_output(engine, llm, loop):
    params = greedy(max_tokens=6, ignore_eos=True)
    (expected,) = llm.generate(PROMPTS[2], params, use_tqdm=False)

    outputs = run(
        loop, collect(engine, PROMPTS[2], params, output_kind=RequestOutputKind.FINAL_ONLY)
    )

    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].outputs[0].text == expected.outputs[0].text


def test_token_id_prompts_and_priorities_are_accepted(engine, llm, loop):
    token_ids = llm.get_tokenizer().encode(PROMPTS[3])
    params = greedy(max_tokens=5)
    (expected,) = llm.generate(PROMPTS[3], params, use_tqdm=False)

    outputs = run(loop, collect(engine, {"prompt_token_ids": token_ids}, params, priority=3))

    assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    assert outputs[-1].prompt is None


def test_cancelling_the_consumer_aborts_the_request_and_frees_its_blocks(engine, loop):
    two_outputs_seen = asyncio.Event()

    async def consume():
        count = 0
        async for _ in engine.generate("Hello", greedy(max_tokens=100, ignore_eos=True)):
            count += 1
            if count == 2:
                two_outputs_seen.set()

    async def cancel_mid_stream():
        task = asyncio.ensure_future(consume())
        await two_outputs_seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_all_blocks_free(engine)  # messages are ordered: the abort came first

    run(loop, cancel_mid_stream())


def test_leaving_the_stream_early_aborts_the_request(engine, loop):
    async def leave_after_one():
        stream = engine.generate("Hello", greedy(max_tokens=100, ignore_eos=True), "early")
        first = await anext(stream)
        await stream.aclose()
        assert not first.finished
        await assert_all_blocks_free(engine)

    run(loop, leave_after_one())


def test_a_request_needing_the_whole_cache_runs_after_aborts(engine, loop, llm):
    prompt_ids = llm.get_tokenizer().encode("Hello")
    max_tokens = NUM_KV_BLOCKS * BLOCK_SIZE - len(prompt_ids)
    params = greedy(max_tokens=max_tokens, ignore_eos=True)

    outputs = run(loop, collect(engine, "Hello", params, output_kind=RequestOutputKind.FINAL_ONLY))

    assert len(outputs[0].outputs[0].token_ids) == max_tokens


def test_abort_ends_the_stream_with_an_abort_output(engine, loop):
    async def abort_mid_stream():
        outputs = []
        async for output in engine.generate("Hi", greedy(max_tokens=100, ignore_eos=True), "ab"):
            outputs.append(output)
            if len(outputs) == 1:
                await engine.abort("ab")
        await assert_all_blocks_free(engine)
        return outputs

    outputs = run(loop, abort_mid_stream())

    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 100


def test_a_stop_string_finishes_the_request_in_the_core(engine, llm, loop):
    params = greedy(max_tokens=40, ignore_eos=True)
    (reference,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    text = reference.outputs[0].text
    stop = text[4:7]
    assert stop and text.index(stop) == 4  # the tiny model's text has a usable stop string

    async def generate_and_check_the_core():
        outputs = await collect(
            engine, PROMPTS[0], greedy(max_tokens=100, ignore_eos=True, stop=stop)
        )
        stats = await engine.get_stats()  # sent after the stop: the core has finished it
        return outputs, stats

    outputs, stats = run(loop, generate_and_check_the_core())

    completion = outputs[-1].outputs[0]
    assert completion.text == text[:4]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert stats.num_unfinished_requests == 0
    assert stats.num_free_kv_blocks == NUM_KV_BLOCKS
    # Text held back while a stop string could still match is never shown, then taken back.
    for earlier, later in zip(outputs, outputs[1:]):
        assert later.outputs[0].text.startswith(earlier.outputs[0].text)


def test_invalid_requests_raise_value_error(engine, loop):
    too_long = {"prompt_token_ids": [5] * 600}  # max_model_len is 512: the core rejects it

    with pytest.raises(ValueError, match="max_model_len"):
        run(loop, collect(engine, too_long, greedy()))
    with pytest.raises(ValueError, match="vocabulary"):
        run(loop, collect(engine, {"prompt_token_ids": [10**6]}, greedy()))
    with pytest.raises(ValueError, match="KV-cache blocks"):
        run(loop, collect(engine, "Hi", greedy(max_tokens=200)))

    async def duplicate_id():
        stream = engine.generate("Hi", greedy(max_tokens=50, ignore_eos=True), "dup")
        await anext(stream)
        try:
            with pytest.raises(ValueError, match="already in use"):
                await collect(engine, "Hi", greedy(), request_id="dup")
        finally:
            await stream.aclose()

    run(loop, duplicate_id())
    run(loop, assert_all_blocks_free(engine))


# ---- n > 1 ---------------------------------------------------------------------------------


def test_n_samples_stream_as_one_request(engine, llm, loop):
    params = SamplingParams(n=2, seed=11, temperature=1.0, max_tokens=10, ignore_eos=True)
    (expected,) = llm.generate(PROMPTS[1], params, use_tqdm=False)

    deltas = run(loop, collect(engine, PROMPTS[1], params, output_kind=RequestOutputKind.DELTA))
    cumulative = run(loop, collect(engine, PROMPTS[1], params))

    assert all(output.request_id == deltas[0].request_id for output in deltas)
    assert [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
    joined = {0: [], 1: []}
    for output in deltas:
        for completion in output.outputs:  # only the samples that changed
            joined[completion.index] += completion.token_ids
    assert [joined[0], joined[1]] == [c.token_ids for c in expected.outputs]
    final = cumulative[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1]
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in expected.outputs]
    assert all(len(o.outputs) == 2 for o in cumulative)
    run(loop, assert_all_blocks_free(engine))


def test_aborting_an_n_request_aborts_every_sample(engine, loop):
    async def abort_mid_stream():
        outputs = []
        params = greedy(n=2, max_tokens=50, ignore_eos=True)
        async for output in engine.generate("Hi", params, "nab"):
            outputs.append(output)
            if len(outputs) == 1:
                await engine.abort("nab")
        await assert_all_blocks_free(engine)
        return outputs

    outputs = run(loop, abort_mid_stream())

    last = outputs[-1]
    assert last.finished
    assert [c.finish_reason for c in last.outputs] == ["abort", "abort"]


def test_an_n_request_the_core_rejects_raises_and_leaves_nothing(engine, loop):
    with pytest.raises(ValueError, match="KV-cache blocks"):
        run(loop, collect(engine, "Hi", greedy(n=2, max_tokens=200)))
    run(loop, assert_all_blocks_free(engine))
    assert not engine.output_processor.has_unfinished_requests()

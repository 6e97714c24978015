"""AsyncLLM over two engine-core processes (DataParallelClient), on a tiny model: outputs
equal to one engine's, work on both cores, aborts reaching the right core, a dead core."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from vlite.core.config import VliteConfig
from vlite.core.sampling_params import SamplingParams
from vlite.engine.async_llm import AsyncLLM
from vlite.engine.data_parallel_client import DataParallelClient
from vlite.engine.exceptions import EngineDeadError
from vlite.engine.llm import LLM
from vlite.testing.tiny_models import make_tiny_model

NUM_KV_BLOCKS = 8
PROMPTS = [f"Request number {index} says" for index in range(8)]
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> VliteConfig:
    model = make_tiny_model(tmp_path_factory.mktemp("dp-model"), "LlamaForCausalLM")
    return VliteConfig(
        model=str(model), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, cpu_threads=1
    )


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def start_engine(config: VliteConfig) -> AsyncLLM:
    return AsyncLLM(config, data_parallel_size=2, startup_timeout_s=TIMEOUT_S * 2)


@pytest.fixture(scope="module")
def engine(config, loop):
    engine = start_engine(config)
    yield engine
    engine.shutdown()
    assert [process.exitcode for process in engine.engine_core.processes] == [0, 0]
    assert not any(process.ipc_dir.exists() for process in engine.engine_core.processes)


def run(loop, coro):
    return loop.run_until_complete(asyncio.wait_for(coro, TIMEOUT_S))


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def long_request() -> SamplingParams:
    return greedy(100, ignore_eos=True)


async def last_output(
    engine: AsyncLLM, prompt: str, params: SamplingParams, request_id: str | None = None
):
    outputs = [output async for output in engine.generate(prompt, params, request_id)]
    return outputs[-1]


def test_both_cores_serve_and_the_outputs_equal_one_engine_s(engine, config, loop):
    expected = LLM(config=config).generate(PROMPTS, greedy(8), use_tqdm=False)

    async def all_requests():
        before = await engine.get_engine_stats()
        outputs = await asyncio.gather(*(last_output(engine, p, greedy(8)) for p in PROMPTS))
        return before, outputs, await engine.get_engine_stats()

    before, outputs, after = run(loop, all_requests())

    assert [o.outputs[0].text for o in outputs] == [e.outputs[0].text for e in expected]
    admitted = [b.totals.num_new_prompt_tokens - a.totals.num_new_prompt_tokens
                for a, b in zip(before, after)]  # fmt: skip
    assert all(tokens > 0 for tokens in admitted), admitted
    assert engine.engine_core.core_of == {}  # finished requests are forgotten
    assert engine.engine_core.router.loads == [0, 0]
    assert engine.data_parallel_size == 2 and len({i.pid for i in engine.engine_infos}) == 2


def test_the_samples_of_one_request_go_to_one_core(engine, loop):
    async def cores_while_running():
        stream = engine.generate("Hello", greedy(20, n=3, ignore_eos=True), "samples")
        await anext(stream)
        cores = dict(engine.engine_core.core_of)
        await stream.aclose()
        return cores

    cores = run(loop, cores_while_running())

    assert len(cores) == 3 and len(set(cores.values())) == 1
    assert engine.engine_core.core_of == {}


def test_leaving_a_stream_frees_blocks_on_its_core_only(engine, loop):
    async def leave_one_of_two():
        first = engine.generate("Once upon a time", long_request(), "first")
        second = engine.generate("In a galaxy far away", long_request(), "second")
        await anext(first)
        await anext(second)
        core_of = engine.engine_core.core_of
        first_core, second_core = core_of["first"], core_of["second"]
        await first.aclose()
        stats = await engine.get_engine_stats()  # each core got its abort before this
        await second.aclose()
        return first_core, second_core, stats

    first_core, second_core, stats = run(loop, leave_one_of_two())

    assert first_core != second_core  # the second went to the idle core
    freed, busy = stats[first_core], stats[second_core]
    assert freed.num_unfinished_requests == 0 and freed.kv_cache_usage == 0
    assert freed.num_free_kv_blocks == NUM_KV_BLOCKS
    assert busy.num_running_requests == 1 and busy.kv_cache_usage > 0


def test_a_killed_core_fails_every_request_naming_itself(config, loop):
    engine = start_engine(config)
    try:
        client: DataParallelClient = engine.engine_core
        pids = [info.pid for info in engine.engine_infos]

        async def fail(prompt: str, request_id: str) -> str:
            with pytest.raises(EngineDeadError) as raised:
                await last_output(engine, prompt, long_request(), request_id)
            return str(raised.value)

        async def kill_core_one():
            for pid in pids:  # stopped: the tiny model would finish before the kill
                os.kill(pid, signal.SIGSTOP)
            failures = [
                asyncio.ensure_future(fail(prompt, name))
                for prompt, name in (("Once upon a time", "a"), ("Far away", "b"))
            ]
            await asyncio.sleep(0.1)  # both sent, one to each core
            assert sorted(client.core_of.values()) == [0, 1]
            os.kill(pids[1], signal.SIGKILL)
            os.kill(pids[0], signal.SIGCONT)
            errors = await asyncio.gather(*failures)
            return errors, await engine.get_engine_stats()

        errors, stats = run(loop, kill_core_one())

        assert all(error.startswith("engine core 1 of 2 (pid ") for error in errors), errors
        assert "engine core 1 of 2" in str(engine.dead_error)
        assert stats[1] is None
        assert stats[0].num_unfinished_requests == 0  # its request was aborted there
        with pytest.raises(EngineDeadError):
            run(loop, last_output(engine, "Hello", greedy(2)))
    finally:
        engine.shutdown()
    assert engine.engine_core.processes[0].exitcode == 0
    assert not any(process.ipc_dir.exists() for process in engine.engine_core.processes)


def test_a_data_parallel_size_below_one_is_refused(config):
    with pytest.raises(ValueError, match="data_parallel_size must be at least 1.*got 0"):
        AsyncLLM(config, data_parallel_size=0)

"""The engine-core process failing: a step that raises, the process killed, a failed start."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal

import pytest

from vlite.core.config import VliteConfig
from vlite.core.engine_core import EngineCore
from vlite.core.outputs import EngineCoreOutputs
from vlite.core.sampling_params import SamplingParams
from vlite.engine.async_llm import AsyncLLM
from vlite.engine.exceptions import EngineDeadError, EngineGenerateError, EngineStartupError
from vlite.testing.tiny_models import make_tiny_model

TIMEOUT_S = 60
POISON = "poison"


class FaultyEngineCore(EngineCore):
    """Its step raises while a request whose id starts with "poison" is unfinished.

    Built inside the engine-core process (it is pickled by reference to this module).
    """

    def step(self) -> EngineCoreOutputs:
        if any(request_id.startswith(POISON) for request_id in self.scheduler.requests):
            raise RuntimeError("injected step failure")
        return super().step()


def failing_core_factory(config: VliteConfig, model_spec) -> EngineCore:
    raise RuntimeError("this core refuses to start")


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> VliteConfig:
    model = make_tiny_model(tmp_path_factory.mktemp("core-proc-model"), "LlamaForCausalLM")
    return VliteConfig(model=str(model), dtype="float32", num_kv_blocks=16)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engines(config):
    """A live engine with a faulty core; a fresh one if a test killed the last one."""
    started: list[AsyncLLM] = []

    def live_engine() -> AsyncLLM:
        if not started or not started[-1].is_running:
            started.append(
                AsyncLLM(
                    config,
                    engine_core_factory=FaultyEngineCore,
                    startup_timeout_s=TIMEOUT_S * 2,
                )
            )
        return started[-1]

    yield live_engine
    for engine in started:
        engine.shutdown()


def run(loop, coro, timeout: float = TIMEOUT_S):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


def long_request() -> SamplingParams:
    return SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


async def collect(engine, prompt, params, request_id=None):
    return [output async for output in engine.generate(prompt, params, request_id)]


def test_a_failing_step_fails_the_requests_in_flight_and_the_engine_goes_on(engines, loop):
    engine = engines()

    async def poison_mid_stream():
        bystander = engine.generate("Hello", long_request(), "bystander")
        await anext(bystander)  # running when the poison arrives
        with pytest.raises(EngineGenerateError, match="injected step failure"):
            await collect(engine, "Hi", long_request(), f"{POISON}-1")
        with pytest.raises(EngineGenerateError, match="injected step failure"):
            async for _ in bystander:
                pass
        return await engine.get_stats()

    stats = run(loop, poison_mid_stream())

    assert stats.num_failed_steps == 1
    assert stats.num_unfinished_requests == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks  # the failed requests' blocks
    after = run(loop, collect(engine, "Hello", SamplingParams(max_tokens=4, temperature=0)))
    assert after[-1].finished and len(after[-1].outputs[0].token_ids) == 4


def test_killing_the_core_process_fails_every_pending_request_promptly(engines, loop):
    engine = engines()
    process = engine.engine_core.process.process

    async def drain(stream) -> None:
        async for _ in stream:
            pass

    async def kill_mid_stream():
        streams = [engine.generate(f"Prompt {i}", long_request()) for i in range(3)]
        for stream in streams:
            await anext(stream)
        os.kill(process.pid, signal.SIGKILL)
        return await asyncio.gather(*(drain(s) for s in streams), return_exceptions=True)

    results = run(loop, kill_mid_stream(), timeout=20)

    assert all(isinstance(result, EngineDeadError) for result in results)
    assert str(engine.dead_error) == (
        f"the engine core process died: it exited with code {-signal.SIGKILL}"
    )
    with pytest.raises(EngineDeadError):
        run(loop, collect(engine, "Hi", long_request()))
    # Shutting a dead engine down is fine, twice, and leaves no process behind.
    engine.shutdown()
    engine.shutdown()
    assert not process.is_alive()
    assert process not in multiprocessing.active_children()


def test_a_core_that_fails_to_start_reports_its_error(config):
    children_before = set(multiprocessing.active_children())

    with pytest.raises(EngineStartupError, match="this core refuses to start"):
        AsyncLLM(config, engine_core_factory=failing_core_factory, startup_timeout_s=TIMEOUT_S * 2)

    assert set(multiprocessing.active_children()) <= children_before

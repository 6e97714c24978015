"""A constraint that passes the front end's ``validate`` but fails to compile in the core
fails its own request alone, with the compiler's reason, offline and through AsyncLLM (the
core in its own process), while the other requests complete."""

from __future__ import annotations

import asyncio

import pytest

from vlite import LLM, SamplingParams
from vlite.core.config import VliteConfig
from vlite.core.errors import InvalidRequestError
from vlite.engine.async_llm import AsyncLLM

LATE_FAILING_BACKEND = '''
import vlite


class LateFailingBackend:
    """Validates everything; compiles nothing."""

    def __init__(self, tokenizer, vocab_size):
        pass

    @classmethod
    def validate(cls, params):
        pass

    def compile(self, params):
        raise ValueError(f"no grammar today for {params.kind}")


@vlite.hookimpl
def register_structured_output_backends(register):
    register("late-failing", LateFailingBackend)
'''
FAILING = SamplingParams(
    max_tokens=4, structured_outputs={"regex": "[a-z]+", "backend": "late-failing"}
)
PLAIN = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_offline_the_failure_is_raised_naming_the_request(install_plugin, tiny_model):
    install_plugin("late-failing-backend", LATE_FAILING_BACKEND)
    llm = LLM(model=tiny_model)

    with pytest.raises(InvalidRequestError, match="no grammar today for regex"):
        llm.generate(["Hello"], FAILING, use_tqdm=False)

    assert not llm.llm_engine.has_unfinished_requests()
    (output,) = llm.generate(["Hello"], PLAIN, use_tqdm=False)  # the engine goes on
    assert len(output.outputs[0].token_ids) == 6


def test_through_the_core_process_only_that_request_fails(install_plugin, tiny_model):
    install_plugin("late-failing-backend", LATE_FAILING_BACKEND)
    engine = AsyncLLM(VliteConfig(model=tiny_model, cpu_threads=1), startup_timeout_s=120)

    async def both():
        async def run(params):
            final = None
            async for output in engine.generate("Hello there", params):
                final = output
            return final

        return await asyncio.gather(run(FAILING), run(PLAIN), return_exceptions=True)

    try:
        failed, plain = asyncio.run(asyncio.wait_for(both(), 60))
    finally:
        engine.shutdown()

    assert isinstance(failed, InvalidRequestError), failed
    assert "the late-failing grammar could not be compiled: no grammar today" in str(failed)
    assert len(plain.outputs[0].token_ids) == 6

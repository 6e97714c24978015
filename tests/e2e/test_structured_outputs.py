"""Structured outputs end to end on a tiny random model (its byte-level tokenizer can spell
anything, and random weights stress the masks): every output follows its constraint under
both backends, whatever else is in the batch, with chunked prefill and preemption, under
async scheduling and tensor parallelism; requests without constraints are unchanged."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from vlite import LLM, SamplingParams
from vlite.core.errors import InvalidRequestError
from vlite.testing.tiny_models import make_tiny_model

BACKENDS = ["xgrammar", "llguidance"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,5}-\d{2}"
CHOICES = ["red", "green", "blue tooth"]
GRAMMAR = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
GRAMMAR_SHAPE = re.compile(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM"))


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=tiny_llama, num_kv_blocks=64)


def constrained(backend: str, max_tokens: int = 120, **constraint) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        structured_outputs={**constraint, "backend": backend},
    )


def check_follows(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert GRAMMAR_SHAPE.fullmatch(text), text


CASES = {"json": PERSON, "regex": REGEX, "choice": CHOICES, "grammar": GRAMMAR}
PROMPTS = [f"Request {index}: the answer is" for index in range(4)]


def mixed_batch(backend: str) -> tuple[list[str], list[SamplingParams], list[str | None]]:
    """Every kind of constraint on every prompt, plus unconstrained requests between them."""
    prompts, params, kinds = [], [], []
    for prompt in PROMPTS:
        for kind, value in CASES.items():
            prompts.append(prompt)
            params.append(constrained(backend, **{kind: value}))
            kinds.append(kind)
        prompts.append(prompt)
        params.append(SamplingParams(max_tokens=12, temperature=0.0))
        kinds.append(None)
    return prompts, params, kinds


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_output_follows_its_constraint_and_plain_requests_are_unchanged(llm, backend):
    prompts, params, kinds = mixed_batch(backend)
    plain_alone = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))

    outputs = llm.generate(prompts, params, use_tqdm=False)

    plain_in_batch = []
    for output, kind in zip(outputs, kinds):
        completion = output.outputs[0]
        if kind is None:
            plain_in_batch.append(completion.token_ids)
            continue
        assert completion.finish_reason == "stop", (kind, completion.text)
        check_follows(kind, completion.text)
    assert plain_in_batch == [out.outputs[0].token_ids for out in plain_alone]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_outputs_follow_the_schema_for_every_sample(llm, backend):
    params = SamplingParams(
        max_tokens=120,
        temperature=1.0,
        seed=7,
        n=3,
        structured_outputs={"json": PERSON, "backend": backend},
    )

    (output,) = llm.generate(["Tell me about somebody:"], params, use_tqdm=False)

    assert len(output.outputs) == 3
    for completion in output.outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert len({c.text for c in output.outputs}) > 1  # the samples differ


def greedy_texts(llm: LLM, backend: str) -> list[str]:
    prompts, params, _ = mixed_batch(backend)
    return [out.outputs[0].text for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "settings",
    [
        dict(enable_chunked_prefill=True, max_num_batched_tokens=16, num_kv_blocks=12),
        dict(
            scheduler="priority",
            enable_chunked_prefill=True,
            max_num_batched_tokens=16,
            num_kv_blocks=12,
        ),
        dict(async_scheduling=True),
    ],
    ids=["chunked-prefill-preemption", "priority-chunks-preemption", "async-scheduling"],
)
def test_the_same_outputs_with_chunks_preemption_and_async_scheduling(llm, tiny_llama, settings):
    other = LLM(model=tiny_llama, block_size=16, **settings)
    try:
        texts = greedy_texts(other, "xgrammar")
        if "num_kv_blocks" in settings:
            assert other.llm_engine.engine_core.scheduler.num_preemptions > 0
    finally:
        other.llm_engine.shutdown()

    assert texts == greedy_texts(llm, "xgrammar")


@pytest.mark.parametrize(
    "settings",
    [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
    ids=["tp2", "pp2"],
)
def test_tensor_and_pipeline_parallel_ranks_apply_the_same_masks(llm, tiny_llama, settings):
    other = LLM(model=tiny_llama, executor="multiproc", cpu_threads=1, **settings)
    try:
        texts = greedy_texts(other, "llguidance")
    finally:
        other.llm_engine.shutdown()

    assert texts == greedy_texts(llm, "llguidance")


def test_equal_constraints_compile_once(llm):
    manager = llm.llm_engine.engine_core.structured_outputs
    before = len(manager._cache)
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}

    llm.generate(["a", "b", "c"], constrained("xgrammar", json=schema), use_tqdm=False)

    assert len(manager._cache) == before + 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_constraint_that_cannot_compile_is_refused_before_the_engine(llm, backend):
    with pytest.raises(InvalidRequestError, match=f"invalid regex constraint for {backend}"):
        llm.generate(["x"], constrained(backend, regex="a(b"), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="backend 'nope'"):
        llm.generate(["x"], constrained("nope", regex="a"), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


# ---- the default model: the mask takes nothing the grammar allows ----------------------------

NATURAL_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "def fibonacci(n):",
    "Translate to German: good morning",
]


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    llm = LLM(max_model_len=512)
    yield llm
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_under_a_permissive_grammar_equals_unconstrained_greedy(default_llm, backend):
    plain = default_llm.generate(
        NATURAL_PROMPTS, SamplingParams(max_tokens=40, temperature=0.0), use_tqdm=False
    )
    anything = constrained(backend, max_tokens=40, regex=r"[\s\S]*")

    outputs = default_llm.generate(NATURAL_PROMPTS, anything, use_tqdm=False)

    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_constrained_token_differs_from_the_argmax_only_where_the_argmax_is_forbidden(
    default_llm, backend
):
    """Replays each output in a fresh matcher: wherever the sampled token is not the raw
    argmax (``logprobs`` are taken before any mask), the argmax was not allowed there."""
    from vlite.core.structured_output import allocate_bitmask, allowed_tokens
    from vlite.core.structured_output_params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
    }
    params = SamplingParams(
        max_tokens=60, temperature=0.0, logprobs=1,
        structured_outputs={"json": schema, "backend": backend},
    )  # fmt: skip
    outputs = default_llm.generate(NATURAL_PROMPTS, params, use_tqdm=False)
    engine_core = default_llm.llm_engine.engine_core
    vocab_size = engine_core.model_spec.vocab_size
    backend_cls = engine_core.registry.get("structured_output_backend", backend)
    compiled = backend_cls(default_llm.get_tokenizer(), vocab_size).compile(
        StructuredOutputsParams(json=schema)
    )
    num_differing = 0
    for output in outputs:
        completion = output.outputs[0]
        matcher = compiled.new_matcher()
        for token_id, position in zip(completion.token_ids, completion.logprobs):
            argmax = min(position, key=lambda t: position[t].rank)
            if argmax != token_id:
                num_differing += 1
                bitmask = allocate_bitmask(1, vocab_size)
                matcher.fill_bitmask(bitmask, 0)
                assert not allowed_tokens(bitmask[0], vocab_size)[argmax], (
                    f"the grammar allowed the argmax {argmax}, yet {token_id} was sampled"
                )
            assert matcher.accept_token(token_id)
        jsonschema.validate(json.loads(completion.text), schema)
    assert num_differing > 0  # the grammar did steer the model

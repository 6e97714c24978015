"""InputProcessor: prompts to EngineCoreRequests, token-id checks, chat templates."""

from __future__ import annotations

import numpy as np
import pytest

from vlite.core.errors import InvalidRequestError
from vlite.core.sampling_params import SamplingParams
from vlite.engine.input_processor import InputProcessor
from vlite.testing.tiny_models import make_tiny_tokenizer


@pytest.fixture
def processor(tokenizer) -> InputProcessor:
    return InputProcessor(tokenizer, vocab_size=len(tokenizer))


def test_text_prompts_are_tokenized_with_bos(processor, tokenizer):
    params = SamplingParams(max_tokens=3)

    request, text = processor.process("r1", "Hello world", params, priority=2)

    assert text == "Hello world"
    assert request.prompt_token_ids == tokenizer.encode("Hello world")
    assert request.prompt_token_ids[0] == tokenizer.bos_token_id
    assert (request.request_id, request.priority) == ("r1", 2)
    assert request.sampling_params is params
    assert request.eos_token_id == tokenizer.eos_token_id
    assert request.arrival_time > 0


def test_token_id_prompts_pass_through_as_ints(processor):
    request, text = processor.process(
        "r", {"prompt_token_ids": np.array([5, 6, 7])}, SamplingParams()
    )

    assert request.prompt_token_ids == [5, 6, 7]
    assert all(type(t) is int for t in request.prompt_token_ids)
    assert text is None


@pytest.mark.parametrize(
    ("prompt", "error", "match"),
    [
        ({"prompt_token_ids": [1, -2]}, ValueError, "integers >= 0"),
        ({"prompt_token_ids": "abc"}, ValueError, "integers >= 0"),
        ({"prompt_token_ids": [1, 10**6]}, ValueError, "vocabulary"),
        (42, InvalidRequestError, "expected a string"),
    ],
)
def test_invalid_prompts_are_refused(processor, prompt, error, match):
    with pytest.raises(error, match=match):
        processor.process("r", prompt, SamplingParams())


def test_chat_template_gives_text_and_ids_ready_for_a_reply(processor, tokenizer):
    prompt = processor.apply_chat_template([{"role": "user", "content": "Hi"}])

    assert prompt["prompt"] == "<|user|>\nHi\n<|assistant|>\n"
    assert prompt["prompt_token_ids"] == tokenizer.encode(
        prompt["prompt"], add_special_tokens=False
    )


def test_a_tokenizer_without_chat_template_is_an_error():
    bare = make_tiny_tokenizer()  # a fresh one: the session fixture stays unchanged
    bare.chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        InputProcessor(bare).apply_chat_template([{"role": "user", "content": "Hi"}])


def test_a_template_that_rejects_the_messages_is_an_invalid_request():
    strict = make_tiny_tokenizer()
    strict.chat_template = "{{ raise_exception('roles must alternate') }}"

    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        InputProcessor(strict).apply_chat_template([{"role": "user", "content": "Hi"}])


def test_a_fault_of_the_tokenizer_is_not_reported_as_bad_input():
    broken = make_tiny_tokenizer()

    def fails(*args, **kwargs):
        raise RuntimeError("the tokenizer broke")

    broken.apply_chat_template = fails
    with pytest.raises(RuntimeError, match="the tokenizer broke") as raised:
        InputProcessor(broken).apply_chat_template([{"role": "user", "content": "Hi"}])
    assert not isinstance(raised.value, InvalidRequestError)


def test_text_without_special_tokens_has_no_bos(processor, tokenizer):
    text, ids = processor.tokenize("Hello world", add_special_tokens=False)

    assert text == "Hello world"
    assert ids == tokenizer.encode("Hello world")[1:]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"add_generation_prompt": False}, "<|user|>\nHi\n<|assistant|>\nWhy\n"),
        (
            {"add_generation_prompt": False, "continue_final_message": True},
            "<|user|>\nHi\n<|assistant|>\nWhy",
        ),
    ],
)
def test_chat_template_options_shape_the_text(processor, tokenizer, options, expected):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Why"}]

    prompt = processor.apply_chat_template(messages, **options)

    assert prompt["prompt"] == expected
    assert prompt["prompt_token_ids"] == tokenizer.encode(expected, add_special_tokens=False)


def test_chat_template_with_special_tokens_adds_a_bos(processor, tokenizer):
    messages = [{"role": "user", "content": "Hi"}]

    prompt = processor.apply_chat_template(messages, add_special_tokens=True)

    assert prompt["prompt_token_ids"] == tokenizer.encode("<|user|>\nHi\n<|assistant|>\n")
    assert prompt["prompt_token_ids"][0] == tokenizer.bos_token_id


def test_detokenize_keeps_special_tokens_and_refuses_ids_outside_the_vocabulary(
    processor, tokenizer
):
    assert processor.detokenize(tokenizer.encode("Hello world")) == "<s>Hello world"
    for bad in (-1, len(tokenizer)):
        with pytest.raises(InvalidRequestError, match=f"token 1 is {bad}, outside"):
            processor.detokenize([5, bad])

"""IncrementalDetokenizer with a real (tiny, byte-level BPE) tokenizer."""

from __future__ import annotations

import itertools

import pytest

from vlite.engine.detokenizer import IncrementalDetokenizer

TEXT = "The quick brown fox jumps over the lazy dog."
PROMPT = "Tell me a joke."


def feed_one_by_one(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[bool]:
    return [detokenizer.add_tokens([token_id]) for token_id in token_ids]


def token_texts(tokenizer, token_ids: list[int]) -> list[str]:
    return [tokenizer.decode([token_id]) for token_id in token_ids]


@pytest.mark.parametrize(
    "text",
    [
        TEXT,
        " Hello, world! How are you today?",
        "café, naïve, 🙂 and 日本語 are not in the training text",
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    ],
)
def test_incremental_text_equals_the_full_decode(tokenizer, encode, text):
    token_ids = encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, encode(PROMPT), stop=[])

    texts_so_far = []
    for token_id in token_ids:
        assert detokenizer.add_tokens([token_id]) is False
        texts_so_far.append(detokenizer.text)

    assert detokenizer.text == tokenizer.decode(token_ids, skip_special_tokens=True) == text
    # Text only ever grows, and never shows half a UTF-8 character.
    for earlier, later in itertools.pairwise(texts_so_far):
        assert later.startswith(earlier)
    assert all("\ufffd" not in t for t in texts_so_far)
    assert detokenizer.stop_string is None


def test_multi_byte_characters_are_held_back_until_complete(tokenizer, encode):
    token_ids = encode("é")
    assert len(token_ids) == 2  # one byte per token: the first alone is not valid UTF-8
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=[])

    detokenizer.add_tokens(token_ids[:1])
    assert detokenizer.text == ""
    detokenizer.add_tokens(token_ids[1:])
    assert detokenizer.text == "é"


def test_adding_many_tokens_at_once_equals_one_by_one(tokenizer, encode):
    token_ids = encode(TEXT)
    at_once = IncrementalDetokenizer(tokenizer, encode(PROMPT), stop=[])

    at_once.add_tokens(token_ids)

    assert at_once.text == TEXT


def test_special_tokens_are_skipped(tokenizer, encode):
    token_ids = encode("Hello") + [tokenizer.eos_token_id]
    detokenizer = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id], stop=[])

    detokenizer.add_tokens(token_ids)

    assert detokenizer.text == "Hello"


def test_stop_string_straddling_two_tokens_is_detected_and_cut(tokenizer, encode):
    stop = "ck b"
    token_ids = encode(TEXT)
    pieces = token_texts(tokenizer, token_ids)
    # The stop string really is split across tokens: no token holds it whole, and the
    # token that completes it ("ck b" ends in " b") starts after the stop string does.
    assert not any(stop in piece for piece in pieces)
    completing = next(i for i in range(len(pieces)) if stop in tokenizer.decode(token_ids[: i + 1]))
    completing_start = len(tokenizer.decode(token_ids[:completing]))
    assert TEXT.index(stop) < completing_start
    assert pieces[completing - 1].endswith("ck") and pieces[completing] == " b"
    detokenizer = IncrementalDetokenizer(tokenizer, encode(PROMPT), stop=[stop])

    results = feed_one_by_one(detokenizer, token_ids[: completing + 1])

    assert results == [False] * completing + [True]
    assert detokenizer.text == "The qui"
    assert detokenizer.text == TEXT[: TEXT.index(stop)]
    assert detokenizer.stop_string == stop


def test_stop_string_across_several_tokens_in_one_call(tokenizer, encode):
    stop = "brown fox"
    token_ids = encode(TEXT)
    assert not any(stop in piece for piece in token_texts(tokenizer, token_ids))
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["nothing", stop])

    assert detokenizer.add_tokens(token_ids) is True

    assert detokenizer.text == "The quick "
    assert detokenizer.stop_string == stop


def test_stop_string_inside_a_single_token(tokenizer, encode):
    stop = "ve"
    token_ids = encode(TEXT)
    pieces = token_texts(tokenizer, token_ids)
    (holder,) = [i for i, piece in enumerate(pieces) if stop in piece]
    assert pieces[holder] == "ver"  # the stop string is strictly inside one token
    detokenizer = IncrementalDetokenizer(tokenizer, encode(PROMPT), stop=[stop])

    results = feed_one_by_one(detokenizer, token_ids[: holder + 1])

    assert results == [False] * holder + [True]
    assert detokenizer.text == "The quick brown fox jumps o"
    assert detokenizer.stop_string == stop


def test_multi_byte_stop_string(tokenizer, encode):
    text = "Un café noir"
    token_ids = encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["é"])

    assert detokenizer.add_tokens(token_ids) is True

    assert detokenizer.text == "Un caf"
    assert detokenizer.stop_string == "é"


def test_earliest_stop_string_in_the_text_wins(tokenizer, encode):
    # The token "ck" completes both "ck" and "uick"; "uick" starts earlier in the text.
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["ck", "uick"])

    assert detokenizer.add_tokens(encode(TEXT)) is True

    assert detokenizer.text == "The q"
    assert detokenizer.stop_string == "uick"


def test_stop_string_in_the_prompt_is_not_matched(tokenizer, encode):
    detokenizer = IncrementalDetokenizer(tokenizer, encode("a brown fox"), stop=["fox"])

    assert feed_one_by_one(detokenizer, encode(" jumps")) == [False] * len(encode(" jumps"))
    assert detokenizer.text == " jumps"


def test_no_stop_string_gives_the_full_text(tokenizer, encode):
    token_ids = encode(TEXT)
    detokenizer = IncrementalDetokenizer(tokenizer, encode(PROMPT), stop=["cat", "zebra"])

    assert not any(feed_one_by_one(detokenizer, token_ids))
    assert detokenizer.text == TEXT
    assert detokenizer.stop_string is None


def test_stop_strings_are_not_looked_for_in_the_first_min_tokens(tokenizer, encode):
    token_ids = encode("ab ab ab ab ab ab")
    first_two = tokenizer.decode(token_ids[:2])
    assert "ab" in first_two

    detokenizer = IncrementalDetokenizer(tokenizer, encode(PROMPT), stop=["ab"], min_tokens=2)
    stopped = feed_one_by_one(detokenizer, token_ids)

    assert stopped[:2] == [False, False] and any(stopped[2:])
    assert detokenizer.text.startswith(first_two)


def test_a_stop_string_must_end_in_new_text(tokenizer, encode):
    """Once min_tokens is met, an occurrence wholly inside the protected text does not count."""
    token_ids = encode("xy zzz")
    protected = len(encode("xy"))
    detokenizer = IncrementalDetokenizer(
        tokenizer, encode(PROMPT), stop=["xy", "q q q q q"], min_tokens=protected
    )

    assert not any(feed_one_by_one(detokenizer, token_ids))
    assert detokenizer.text == "xy zzz"


def _default_tokenizer():
    import importlib.util

    from vlite.models.spec import DEFAULT_MODEL_INSTALL, DEFAULT_MODEL_PACKAGE

    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip(f"the default model is not installed: {DEFAULT_MODEL_INSTALL}")
    from vlite.models.gguf import load_gguf_tokenizer
    from vlite.models.spec import default_model_path

    return load_gguf_tokenizer(default_model_path())


@pytest.mark.parametrize("which", ["tiny", "default-model"])
def test_the_fast_decoder_gives_the_tokenizers_own_text(tokenizer, which):
    import random

    from vlite.engine.detokenizer import skip_special_decoder

    tok = tokenizer if which == "tiny" else _default_tokenizer()
    decode = skip_special_decoder(tok)
    rng = random.Random(0)
    specials = list(tok.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 12))]
        ids[rng.randrange(len(ids) + 1) : 0] = rng.sample(specials, 1)  # a special token in
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tokenizer, monkeypatch):
    from vlite.engine.detokenizer import skip_special_decoder

    calls = []
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: calls.append(ids) or "x")
    assert skip_special_decoder(tokenizer)([5, 6]) == "x" and calls == [[5, 6]]

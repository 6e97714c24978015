"""The OpenAI-compatible server, on uvicorn in a thread, over a tiny model's engine process."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from vlite.core.config import VliteConfig
from vlite.server.settings import ServerSettings
from vlite.testing.server_thread import running_server
from vlite.testing.tiny_models import make_tiny_model

MODEL_NAME = "tiny-llama"
TIMEOUT_S = 60
CHAT = [{"role": "user", "content": "Tell me a joke."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("server-model"), "LlamaForCausalLM")
    # A fixed thread count: the governor changing it between two requests could change
    # the order of float32 sums, and so a greedy token of the random tiny model.
    config = VliteConfig(model=str(model), dtype="float32", num_kv_blocks=8, cpu_threads=1)
    settings = ServerSettings(served_model_name=MODEL_NAME, log_level="warning")
    with running_server(config, settings, TIMEOUT_S) as api_server:
        yield api_server
    assert not api_server.engine.engine_core.process.is_alive  # the core went with it


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.address, timeout=TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.engine.get_tokenizer()


def stream_events(client, path: str, body: dict) -> list:
    """The JSON payloads of an SSE response, checking it ends with ``data: [DONE]``."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def engine_stats(server):
    future = asyncio.run_coroutine_threadsafe(server.engine.get_stats(), server.loop)
    return future.result(TIMEOUT_S)


def greedy(**body) -> dict:
    return {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True, **body}


def test_health_and_models(client):
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert (card["id"], card["object"], card["max_model_len"]) == (MODEL_NAME, "model", 512)


def test_completion_with_usage(client, tokenizer):
    body = greedy(prompt="The quick brown fox", max_tokens=7, user="ignored")

    response = client.post("/v1/completions", json=body)

    assert response.status_code == 200, response.text
    result = response.json()
    assert result["id"].startswith("cmpl-") and result["object"] == "text_completion"
    assert result["model"] == MODEL_NAME
    (choice,) = result["choices"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    num_prompt = len(tokenizer.encode("The quick brown fox"))
    assert result["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 7,
        "total_tokens": num_prompt + 7,
    }
    # Request ids are unique.
    assert client.post("/v1/completions", json=body).json()["id"] != result["id"]


def test_streamed_completion_deltas_join_to_the_full_text(client):
    body = greedy(prompt="Once upon a time", max_tokens=12)
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]

    events = stream_events(
        client, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )

    *chunks, usage_chunk = events
    # One chunk or several: outputs the stream has not sent yet are merged (timing).
    assert len(chunks) >= 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == full
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["id"] for c in events}) == 1
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12


def test_token_id_prompt_equals_the_text_prompt(client, tokenizer):
    body = greedy(max_tokens=6)
    by_text = client.post("/v1/completions", json={**body, "prompt": "Hello there"}).json()
    ids = tokenizer.encode("Hello there")
    by_ids = client.post("/v1/completions", json={**body, "prompt": ids}).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"] == by_text["usage"]


def test_stop_string_ends_the_completion(client):
    body = greedy(prompt="Hello", max_tokens=30)
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = text[3:5]
    assert stop and text.index(stop) == 3

    choice = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]

    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        text[:3],
        "stop",
        stop,
    )


def test_chat_completion_streamed_and_not(client):
    body = greedy(messages=CHAT, max_tokens=9)

    result = client.post("/v1/chat/completions", json=body).json()
    events = stream_events(client, "/v1/chat/completions", body)

    assert result["id"].startswith("chatcmpl-") and result["object"] == "chat.completion"
    (choice,) = result["choices"]
    assert choice["message"]["role"] == "assistant"
    assert result["usage"]["completion_tokens"] == 9
    assert result["usage"]["total_tokens"] == result["usage"]["prompt_tokens"] + 9
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert streamed == choice["message"]["content"]
    assert events[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }


def test_chat_without_max_tokens_fills_the_cache(client):
    body = {"messages": CHAT, "temperature": 0, "ignore_eos": True}  # 8 blocks: 128 tokens
    result = client.post("/v1/chat/completions", json=body).json()
    assert result["usage"]["total_tokens"] == 128
    assert result["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", ">= 0"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p", "(0, 1]"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
        ("/v1/completions", {"prompt": "x", "top_k": -5}, "top_k", "-1"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n", ">= 1"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens", "integer"),
        ("/v1/completions", {}, "prompt", "required"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "one request per prompt"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs", "[0, 20]"),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of", "not supported"),
        ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo", "not supported"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
        (
            "/v1/completions",
            {"prompt": "x", "presence_penalty": 2.5},
            "presence_penalty",
            "[-2, 2]",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "frequency_penalty": -3},
            "frequency_penalty",
            "[-2, 2]",
        ),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
        ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p", "[0, 1]"),
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 4, "min_tokens": 5},
            "min_tokens",
            "<= max_tokens",
        ),
        ("/v1/completions", {"prompt": [5] * 600}, "prompt", "maximum context length is"),
        ("/v1/completions", {"prompt": [5] * 400, "max_tokens": 200}, "max_tokens", "lower"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}, "max_tokens", "less than"),
        ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed", "less than"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [2**70]}, "stop_token_ids.0", ""),
        ("/v1/completions", {"prompt": "x", "n": 129}, "n", "limit of 128"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 300}, None, "KV-cache blocks"),
        ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
        ("/v1/chat/completions", {"messages": CHAT, "n": -1}, "n", ">= 1"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "top_logprobs": 2},
            "top_logprobs",
            "logprobs=true",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            "[0, 20]",
        ),
        ("/v1/chat/completions", {"messages": CHAT, "stop": [""]}, "stop", "non-empty"),
    ],
)
def test_bad_requests_get_an_openai_400_naming_the_field(client, path, body, param, message):
    for stream in (False, True):
        response = client.post(path, json={**body, "stream": stream})

        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param
        assert message in error["message"]
        assert (error["type"], error["code"]) == ("BadRequestError", 400)


def test_unknown_model_is_a_404(client):
    response = client.post("/v1/completions", json={"model": "gpt-5", "prompt": "x"})
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"


def test_concurrent_streams_each_get_their_own_text(server, client):
    prompts = ["Hello", "The engine", "A journey", "Numbers: 1"]
    expected = [
        client.post("/v1/completions", json=greedy(prompt=p, max_tokens=10)).json() for p in prompts
    ]

    async def stream_all():
        async with httpx.AsyncClient(base_url=server.address, timeout=TIMEOUT_S) as aclient:

            async def one(prompt):
                body = greedy(prompt=prompt, max_tokens=10, stream=True)
                texts = []
                async with aclient.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            texts.append(json.loads(line[6:])["choices"][0]["text"])
                return "".join(texts)

            return await asyncio.gather(*(one(p) for p in prompts))

    texts = asyncio.run(asyncio.wait_for(stream_all(), TIMEOUT_S))

    assert texts == [e["choices"][0]["text"] for e in expected]


def test_the_openai_client_streams(server):
    client = openai.OpenAI(base_url=f"{server.address}/v1", api_key="unused", timeout=TIMEOUT_S)
    extra = {"ignore_eos": True}

    full = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=8, temperature=0, extra_body=extra
    )
    stream = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=8, temperature=0, stream=True, extra_body=extra
    )
    streamed = "".join(chunk.choices[0].text for chunk in stream)
    chat_stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0, stream=True, extra_body=extra
    )
    chunks = list(chat_stream)

    assert streamed == full.choices[0].text and full.usage.completion_tokens == 8
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list()] == [MODEL_NAME]


def test_a_client_leaving_mid_stream_aborts_its_request(server, client, monkeypatch):
    aborted = threading.Event()
    abort_now = server.engine._abort_now

    def record_abort(request_ids):  # runs on the server's loop, where the abort is sent
        abort_now(request_ids)
        aborted.set()

    monkeypatch.setattr(server.engine, "_abort_now", record_abort)
    num_steps_before = engine_stats(server).totals.num_steps
    body = greedy(prompt="Hello", max_tokens=120, stream=True)
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
    # The connection is closed: the server notices at its next write and aborts.
    assert aborted.wait(TIMEOUT_S)
    stats = engine_stats(server)  # asked after the abort was sent: the core has done it
    assert stats.num_unfinished_requests == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert stats.totals.num_steps - num_steps_before < 60  # aborted, not run to its 120 tokens


# ---- n, logprobs and penalties ---------------------------------------------------------------


def test_completion_logprobs_have_the_openai_shape(client, tokenizer):
    body = greedy(prompt="The quick brown fox", max_tokens=5, logprobs=2)

    choice = client.post("/v1/completions", json=body).json()["choices"][0]

    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 5
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    for token, token_logprob, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]
    ):
        assert top[token] == token_logprob  # greedy: the sampled token is the top one
        assert 1 <= len(top) <= 2 and max(top.values()) == token_logprob
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0
    assert offsets[1:] == [offsets[i] + len(logprobs["tokens"][i]) for i in range(len(offsets) - 1)]


def test_echo_with_logprobs_answers_as_the_legacy_api_for_loglikelihoods(server, client, tokenizer):
    """What lm-evaluation-harness' local-completions model sends for a loglikelihood: the
    prompt back, each prompt token's logprob (``None`` for the first), nothing generated."""
    prompt = "The quick brown fox"
    body = greedy(prompt=prompt, max_tokens=0, echo=True, logprobs=1)

    answer = client.post("/v1/completions", json=body).json()

    choice = answer["choices"][0]
    ids = tokenizer(prompt)["input_ids"]
    assert choice["text"] == prompt
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tokenizer.decode([token]) for token in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert len(logprobs["token_logprobs"]) == len(ids)
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    for token, logprob, top in zip(
        logprobs["tokens"][1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]
    ):
        assert top[token] == logprob and len(top) in (1, 2)
    assert answer["usage"]["completion_tokens"] == 0
    # The same prompt's tokens, scored by the engine through the Python API.
    expected = reference_prompt_logprobs(server, ids)
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)


def reference_prompt_logprobs(server, ids: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(server.config.model, dtype=torch.float32)
    with torch.no_grad():
        rows = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    return [rows[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def test_echo_puts_the_prompt_before_the_completion(client, tokenizer):
    prompt = "The quick brown fox"
    plain = client.post("/v1/completions", json=greedy(prompt=prompt, max_tokens=3, logprobs=0))
    echoed = client.post(
        "/v1/completions", json=greedy(prompt=prompt, max_tokens=3, logprobs=0, echo=True)
    )
    plain_choice, echoed_choice = plain.json()["choices"][0], echoed.json()["choices"][0]
    assert echoed_choice["text"] == prompt + plain_choice["text"]
    num_prompt = len(tokenizer(prompt)["input_ids"])
    logprobs = echoed_choice["logprobs"]
    assert logprobs["tokens"][num_prompt:] == plain_choice["logprobs"]["tokens"]
    assert logprobs["text_offset"][num_prompt] == len(prompt)


def test_prompt_logprobs_in_vllms_shape(client, tokenizer):
    body = greedy(prompt="The quick brown fox", max_tokens=1, prompt_logprobs=2)
    completion = client.post("/v1/completions", json=body).json()["choices"][0]
    chat = client.post(
        "/v1/chat/completions", json=greedy(messages=CHAT, max_tokens=1, prompt_logprobs=0)
    ).json()
    ids = tokenizer("The quick brown fox")["input_ids"]
    for logprobs, prompt_ids in (
        (completion["prompt_logprobs"], ids),
        (chat["prompt_logprobs"], None),
    ):
        assert logprobs[0] is None and all(position for position in logprobs[1:])
        if prompt_ids is not None:
            assert len(logprobs) == len(prompt_ids)
            for position, token in zip(logprobs[1:], prompt_ids[1:]):
                entry = position[str(token)]
                assert entry["logprob"] <= 0 and entry["rank"] >= 1
                assert entry["decoded_token"] == tokenizer.decode([token])


@pytest.mark.parametrize(
    "body,message",
    [
        ({"max_tokens": 0}, "max_tokens=0 generates nothing"),
        ({"echo": True, "stream": True}, "echo=true is not supported with stream=true"),
    ],
)
def test_echo_refusals_name_the_setting(client, body, message):
    response = client.post("/v1/completions", json=greedy(prompt="Hi", **body))
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_streamed_completion_logprobs_cover_every_token(client):
    body = greedy(prompt="Once upon a time", max_tokens=6, logprobs=1)
    full = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]

    chunks = stream_events(client, "/v1/completions", body)

    streamed = [c["choices"][0]["logprobs"] for c in chunks]
    assert sum((s["tokens"] for s in streamed), []) == full["tokens"]
    assert sum((s["token_logprobs"] for s in streamed), []) == full["token_logprobs"]
    assert sum((s["text_offset"] for s in streamed), []) == full["text_offset"]


def test_completion_with_n_gives_indexed_choices(client):
    body = {
        "model": MODEL_NAME,
        "prompt": "Hello",
        "max_tokens": 6,
        "n": 2,
        "seed": 3,
        "ignore_eos": True,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.1,
        "min_p": 0.01,
        "min_tokens": 2,
    }

    result = client.post("/v1/completions", json=body).json()
    events = stream_events(client, "/v1/completions", body)

    assert [c["index"] for c in result["choices"]] == [0, 1]
    assert result["choices"][0]["text"] != result["choices"][1]["text"]
    assert result["usage"]["completion_tokens"] == 12
    streamed = {0: "", 1: ""}
    finishes = {}
    for event in events:
        (choice,) = event["choices"]
        streamed[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert streamed == {c["index"]: c["text"] for c in result["choices"]}  # seeded: same
    assert finishes == {0: "length", 1: "length"}


def test_chat_logprobs_and_n_have_the_openai_shape(client):
    body = greedy(messages=CHAT, max_tokens=4, n=2, logprobs=True, top_logprobs=2)

    result = client.post("/v1/chat/completions", json=body).json()

    assert [c["index"] for c in result["choices"]] == [0, 1]
    assert result["usage"]["completion_tokens"] == 8
    for choice in result["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 4
        for entry in content:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert entry["bytes"] == list(entry["token"].encode())
            assert len(entry["top_logprobs"]) == 2
            assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # greedy
            assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
    without = client.post("/v1/chat/completions", json=greedy(messages=CHAT, max_tokens=2)).json()
    assert without["choices"][0]["logprobs"] is None


def test_streamed_chat_with_n_names_each_choice(client):
    body = greedy(messages=CHAT, max_tokens=4, n=2, logprobs=True)
    full = client.post("/v1/chat/completions", json=body).json()

    events = stream_events(client, "/v1/chat/completions", body)

    roles = [e["choices"][0]["index"] for e in events if "role" in e["choices"][0]["delta"]]
    assert roles == [0, 1]
    content = {0: "", 1: ""}
    tokens = {0: [], 1: []}
    finishes = {}
    for event in events:
        (choice,) = event["choices"]
        content[choice["index"]] += choice["delta"].get("content", "")
        if choice["logprobs"]:
            tokens[choice["index"]] += [t["token"] for t in choice["logprobs"]["content"]]
            assert all(t["top_logprobs"] == [] for t in choice["logprobs"]["content"])
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length"}
    for choice in full["choices"]:
        assert content[choice["index"]] == choice["message"]["content"]
        assert tokens[choice["index"]] == [t["token"] for t in choice["logprobs"]["content"]]


def scrape(client) -> dict[str, float]:
    """``/metrics`` samples by name (every sample carries this server's model label)."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples = {}
    for line in response.text.splitlines():
        if not line.startswith("#"):
            name_and_labels, value = line.rsplit(" ", 1)
            name, labels = name_and_labels.split("{", 1)
            assert f'model_name="{MODEL_NAME}"' in labels
            if 'le="' not in labels:  # histogram buckets are checked by the unit tests
                samples[name] = float(value)
    return samples


def test_metrics_count_the_work_of_each_request(client, tokenizer):
    prompt = "Colours: red, green, blue, yellow, black, white. " * 3
    before = scrape(client)

    body = greedy(prompt=prompt, max_tokens=6)
    assert client.post("/v1/completions", json=body).status_code == 200
    after_first = scrape(client)
    assert client.post("/v1/completions", json=body).status_code == 200
    after_second = scrape(client)

    def grew(name: str, start: dict, end: dict) -> float:
        return end[name] - start[name]

    num_prompt = len(tokenizer.encode(prompt))
    # Every sampled token counts: the first comes from the prefill step, five from decodes.
    assert grew("vlite:generation_tokens_total", before, after_first) == 6
    assert grew("vlite:prompt_tokens_total", before, after_first) == num_prompt
    assert grew("vlite:prefill_tokens_computed_total", before, after_first) == num_prompt
    assert grew("vlite:engine_steps_total", before, after_first) == 6
    assert grew("vlite:prefix_cache_queries_total", before, after_first) == num_prompt
    # The repeat finds the prompt's full blocks in the prefix cache.
    assert grew("vlite:prefix_cache_hits_total", after_first, after_second) > 0
    # Each finished request lands once in every latency and length histogram.
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert grew(f"vlite:{histogram}_count", before, after_first) == 1, histogram
    assert grew("vlite:request_generation_tokens_sum", before, after_first) == 6
    assert grew("vlite:request_prompt_tokens_sum", before, after_first) == num_prompt
    assert grew("vlite:inter_token_latency_seconds_count", before, after_first) == 5
    assert after_second["vlite:engine_healthy"] == 1
    assert after_second["vlite:num_requests_running"] == 0
    assert after_second["vlite:num_requests_waiting"] == 0
    assert 0 <= after_second["vlite:kv_cache_usage_perc"] <= 1


# ---- timings (llama.cpp's) ---------------------------------------------------------------

TIMINGS_KEYS = {
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
    "queue_ms",
}


def check_timings(timings: dict, usage: dict) -> None:
    """The counts agree with the usage, the times are measured, the rates follow from them."""
    assert set(timings) == TIMINGS_KEYS
    assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"]
    assert timings["prompt_n"] >= 1  # the prompt's last token is always computed
    assert timings["predicted_n"] == usage["completion_tokens"]
    for name in ("prompt_ms", "predicted_ms", "queue_ms"):
        assert timings[name] is not None and timings[name] >= 0, name
    assert timings["prompt_ms"] > 0  # a forward pass takes time
    assert timings["prompt_per_second"] == pytest.approx(
        timings["prompt_n"] * 1000 / timings["prompt_ms"]
    )
    assert timings["prompt_per_token_ms"] == pytest.approx(
        timings["prompt_ms"] / timings["prompt_n"]
    )
    if timings["predicted_n"] > 1:
        assert timings["predicted_ms"] > 0
        assert timings["predicted_per_second"] == pytest.approx(
            timings["predicted_n"] * 1000 / timings["predicted_ms"]
        )


def test_a_completion_reports_its_timings_and_the_prefix_cache_hit_on_a_repeat(client):
    # A prompt no other test sends, longer than a KV block: the repeat finds it cached.
    body = greedy(prompt="Language models predict the next word. " * 4, max_tokens=5)

    first = client.post("/v1/completions", json=body).json()
    repeat = client.post("/v1/completions", json=body).json()

    check_timings(first["timings"], first["usage"])
    check_timings(repeat["timings"], repeat["usage"])
    assert first["timings"]["cache_n"] == 0
    assert first["timings"]["prompt_n"] == first["usage"]["prompt_tokens"]
    assert repeat["timings"]["cache_n"] > 0
    assert repeat["timings"]["predicted_n"] == 5


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Once upon a time"}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ],
    ids=["completions", "chat"],
)
def test_timings_end_each_response_streamed_or_not(client, path, body):
    body = greedy(**body, max_tokens=6)
    with_usage = {**body, "stream_options": {"include_usage": True}}

    whole = client.post(path, json=body).json()
    usage_events = stream_events(client, path, with_usage)
    plain_events = stream_events(client, path, body)

    check_timings(whole["timings"], whole["usage"])
    # Streamed, the last event carries them: the usage chunk, or the finishing chunk.
    for events in (usage_events, plain_events):
        assert ["timings" in event for event in events] == [False] * (len(events) - 1) + [True]
    check_timings(usage_events[-1]["timings"], usage_events[-1]["usage"])
    assert plain_events[-1]["choices"][0]["finish_reason"] == "length"
    check_timings(plain_events[-1]["timings"], whole["usage"])


def test_timings_of_samples_and_of_a_stop_string(client):
    samples = client.post(
        "/v1/completions", json=greedy(prompt="Hello there", max_tokens=4, n=2, seed=1)
    ).json()
    check_timings(samples["timings"], samples["usage"])
    assert samples["timings"]["predicted_n"] == 8

    # A stop string ends the request in the API process, not in the engine core.
    body = greedy(prompt="The engine", max_tokens=30)
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stopped = client.post("/v1/completions", json={**body, "stop": [text[4:6]]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    check_timings(stopped["timings"], stopped["usage"])

"""``vlite serve``: its help, and a real server process on a free port with a tiny model."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from click.testing import CliRunner

from vlite.cli.main import cli
from vlite.testing.tiny_models import make_tiny_model

TIMEOUT_S = 120


def test_serve_help_lists_the_server_and_engine_flags_with_an_example():
    result = CliRunner().invoke(cli, ["serve", "--help"])

    assert result.exit_code == 0, result.output
    for flag in ("--host", "--port", "--served-model-name", "--model", "--scheduler", "--attn"):
        assert flag in result.output
    assert "curl http://127.0.0.1:8000/v1/completions" in result.output
    words = " ".join(result.output.split())  # help text wraps at the terminal width
    assert "[default: 127.0.0.1]" in words and "[default: 8000]" in words
    assert "The KV cache stays large by default: the server cannot know its load" in words


def test_serve_keeps_the_default_kv_cache_size(tmp_path):
    # vlite serve sizes nothing from requests: the worker's default rule (the budget, or
    # max_num_seqs sequences of max_model_len tokens) decides.
    from vlite.core.config import VliteConfig
    from vlite.server.api_server import with_serving_defaults

    config = with_serving_defaults(VliteConfig(model=str(tmp_path)), None, {}, 1)
    assert config.kv_cache_tokens is None and config.num_kv_blocks is None
    assert config.kv_cache_memory_gib is None


def test_serve_rejects_a_bad_engine_flag_before_starting():
    result = CliRunner().invoke(cli, ["serve", "--max-num-seqs", "0"])

    assert result.exit_code != 0
    assert "max_num_seqs" in result.output


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def _wait_for_line(lines: queue.Queue, pattern: str, seen: list[str]) -> re.Match:
    while True:
        line = lines.get(timeout=TIMEOUT_S)
        if line is None:
            pytest.fail("vlite serve exited before it was ready:\n" + "".join(seen))
        seen.append(line)
        if match := re.search(pattern, line):
            return match


@pytest.mark.slow
def test_serve_as_a_subprocess_answers_and_stops_cleanly(tmp_path):
    model = make_tiny_model(tmp_path / "model", "LlamaForCausalLM")
    command = [sys.executable, "-m", "vlite", "serve", "--model", str(model), "--port", "0"]
    command += ["--num-kv-blocks", "16", "--served-model-name", "tiny", "--log-level", "warning"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(process.stderr, lines), daemon=True).start()
    seen: list[str] = []
    try:
        backend = _wait_for_line(lines, r"attention backend: (\w+) \(KV cache in (\w+)\)", seen)
        assert backend.groups() == ("cpu", "float32")  # a checkpoint keeps the model's dtype
        memory = _wait_for_line(lines, r"memory: weights .*, KV cache (\d+) blocks x ", seen)
        assert memory.group(1) == "16"  # --num-kv-blocks
        scheduling = _wait_for_line(
            lines, r"scheduler: ([\w-]+), (\d+) tokens per step, chunked prefill (\w+)", seen
        )
        assert scheduling.groups() == ("fcfs", "128", "on")  # the serving defaults on CPU
        core_pid = int(_wait_for_line(lines, r"engine core: pid (\d+)", seen).group(1))
        address = _wait_for_line(lines, r"at (http://127\.0\.0\.1:\d+)", seen).group(1)

        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
        response = httpx.post(f"{address}/v1/completions", json=body, timeout=TIMEOUT_S)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3

        process.send_signal(signal.SIGINT)  # Ctrl-C
        assert process.wait(timeout=TIMEOUT_S) == 0, "".join(seen)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=TIMEOUT_S)
    with pytest.raises(ProcessLookupError):  # the engine core went with the server
        os.kill(core_pid, 0)

"""Meta-tests: every hookspec is documented in docs/plugins.md and exercised by a test here;
every example in the document runs."""

from __future__ import annotations

import inspect
import json
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import vlite
from vlite import LLM, SamplingParams
from vlite.core import hookspecs
from vlite.core.logits_processor import LogitsProcessor
from vlite.core.plugins import PLUGIN_KINDS, PluginRegistry, build_plugin_manager
from vlite.core.proposer import DraftRequest, SpeculativeConfig
from vlite.models.llama import LlamaForCausalLM
from vlite.plugins.attention.torch_ref import TorchAttentionBackend
from vlite.plugins.executors.uniproc import UniprocExecutor
from vlite.plugins.proposers.ngram import NgramProposer
from vlite.plugins.reasoning_parsers.qwen3 import Qwen3ReasoningParser
from vlite.plugins.samplers.default import DefaultSampler
from vlite.plugins.schedulers.fcfs import FcfsPolicy
from vlite.plugins.structured_outputs.xgrammar_backend import XGrammarBackend
from vlite.plugins.tool_parsers.hermes import HermesToolParser
from vlite.plugins.weight_formats.gguf import GGUFBlockFormat
from vlite.testing.tiny_gguf import write_tiny_gguf

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
HOOKSPECS = {
    name: function
    for name, function in vars(hookspecs).items()
    if hasattr(function, f"{hookspecs.PROJECT_NAME}_spec")
}
#: Plugin kind -> the interface section documenting it.
INTERFACES = {
    "scheduler": "Scheduler",
    "attention_backend": "AttentionBackend",
    "sampler": "Sampler",
    "executor": "Executor",
    "model": "CausalLM",
    "structured_output_backend": "StructuredOutputBackend",
    "logits_processor": "LogitsProcessor",
    "proposer": "Proposer",
    "weight_format": "WeightFormat",
    "tool_parser": "ToolParser",
    "reasoning_parser": "ReasoningParser",
}


def signature_of(name: str) -> str:
    parameters = inspect.signature(HOOKSPECS[name]).parameters
    return f"{name}({', '.join(parameters)})"


def python_examples() -> list[tuple[int, str]]:
    """(line number, code) of every ```python block in the document."""
    text = DOCS.read_text()
    examples = []
    for match in re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M):
        indent = len(match.group(1))
        code = "\n".join(line[indent:] for line in match.group(2).splitlines())
        examples.append((text[: match.start()].count("\n") + 1, code))
    return examples


# ---- documented -----------------------------------------------------------------------


def test_hookspecs_are_found():
    assert set(PLUGIN_KINDS.values()) < set(HOOKSPECS)
    assert "register_cli_commands" in HOOKSPECS


@pytest.mark.parametrize("name", sorted(HOOKSPECS))
def test_every_hookspec_is_documented_with_its_signature(name):
    heading = f"### `{signature_of(name)}`"
    text = DOCS.read_text()
    assert heading in text, f"docs/plugins.md has no section {heading!r}"
    section = text.split(heading, 1)[1].split("\n### ", 1)[0]
    assert "**Called**" in section, f"the section of {name} does not say when it is called"
    assert "```python" in section, f"the section of {name} has no runnable example"


@pytest.mark.parametrize("name", sorted(HOOKSPECS))
def test_every_hookspec_docstring_says_when_and_where_it_is_called(name):
    doc = inspect.getdoc(HOOKSPECS[name])
    assert "Called" in doc and "process" in doc


@pytest.mark.parametrize("kind", sorted(PLUGIN_KINDS))
def test_every_plugin_kind_has_its_interface_documented(kind):
    assert f"### {INTERFACES[kind]}\n" in DOCS.read_text()


@pytest.mark.parametrize("example", python_examples(), ids=lambda e: f"line-{e[0]}")
def test_every_python_example_runs(example):
    _, code = example
    exec(compile(code, str(DOCS), "exec"), {"__name__": "docs_example"})


def test_the_document_has_an_example_per_hook_at_least():
    assert len(python_examples()) >= len(HOOKSPECS)


# ---- exercised --------------------------------------------------------------------------

CALLS: Counter = Counter()
RECORDING_ARCHITECTURE = "RecordingLlamaForCausalLM"


class RecordingScheduler(FcfsPolicy):
    def running_order(self, running):
        CALLS["scheduler.running_order"] += 1
        return super().running_order(running)


class RecordingAttentionBackend(TorchAttentionBackend):
    def forward(self, *args, **kwargs):
        CALLS["attention_backend.forward"] += 1
        return super().forward(*args, **kwargs)


class RecordingSampler(DefaultSampler):
    def sample(self, logits, metadata):
        CALLS["sampler.sample"] += 1
        return super().sample(logits, metadata)


class RecordingExecutor(UniprocExecutor):
    def execute_model(self, scheduler_output):
        CALLS["executor.execute_model"] += 1
        super().execute_model(scheduler_output)


class RecordingLlama(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        CALLS["model.forward"] += 1
        return super().forward(*args, **kwargs)


class RecordingMatcher:
    def __init__(self, inner) -> None:
        self.inner = inner

    def fill_bitmask(self, bitmask, row):
        CALLS["structured_output_backend.fill_bitmask"] += 1
        self.inner.fill_bitmask(bitmask, row)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class RecordingStructuredOutputBackend(XGrammarBackend):
    def compile(self, params):
        inner = super().compile(params)

        class Compiled:
            def new_matcher(self):
                return RecordingMatcher(inner.new_matcher())

        return Compiled()


class RecordingLogitsProcessor(LogitsProcessor):
    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        CALLS["logits_processor.apply"] += 1
        return logits


class RecordingProposer(NgramProposer):
    def propose(self, requests):
        CALLS["proposer.propose"] += 1
        return super().propose(requests)


class RecordingToolParser(HermesToolParser):
    def feed(self, delta_text):
        CALLS["tool_parser.feed"] += 1
        return super().feed(delta_text)


class RecordingReasoningParser(Qwen3ReasoningParser):
    def feed(self, delta_text):
        CALLS["reasoning_parser.feed"] += 1
        return super().feed(delta_text)


class RecordingWeightFormat(GGUFBlockFormat):
    def linear(self, weight, x):
        CALLS["weight_format.linear"] += 1
        return super().linear(weight, x)


class RecordingPlugin:
    """Implements every registration hook, counting calls."""

    @vlite.hookimpl
    def register_weight_formats(self, register):
        CALLS["register_weight_formats"] += 1
        register("recording", RecordingWeightFormat)

    @vlite.hookimpl
    def register_structured_output_backends(self, register):
        CALLS["register_structured_output_backends"] += 1
        register("recording", RecordingStructuredOutputBackend)

    @vlite.hookimpl
    def register_logits_processors(self, register):
        CALLS["register_logits_processors"] += 1
        register("recording", RecordingLogitsProcessor)

    @vlite.hookimpl
    def register_proposers(self, register):
        CALLS["register_proposers"] += 1
        register("recording", RecordingProposer)

    @vlite.hookimpl
    def register_tool_parsers(self, register):
        CALLS["register_tool_parsers"] += 1
        register("recording", RecordingToolParser)

    @vlite.hookimpl
    def register_reasoning_parsers(self, register):
        CALLS["register_reasoning_parsers"] += 1
        register("recording", RecordingReasoningParser)

    @vlite.hookimpl
    def register_schedulers(self, register):
        CALLS["register_schedulers"] += 1
        register("recording", RecordingScheduler)

    @vlite.hookimpl
    def register_attention_backends(self, register):
        CALLS["register_attention_backends"] += 1
        register("recording", RecordingAttentionBackend)

    @vlite.hookimpl
    def register_samplers(self, register):
        CALLS["register_samplers"] += 1
        register("recording", RecordingSampler)

    @vlite.hookimpl
    def register_executors(self, register):
        CALLS["register_executors"] += 1
        register("recording", RecordingExecutor)

    @vlite.hookimpl
    def register_models(self, register):
        CALLS["register_models"] += 1
        register(RECORDING_ARCHITECTURE, RecordingLlama)


def test_registration_hooks_are_called_and_the_engine_uses_what_they_register(tiny_model, tmp_path):
    folder = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = [RECORDING_ARCHITECTURE]
    (folder / "config.json").write_text(json.dumps(config))
    CALLS.clear()
    registry = PluginRegistry(build_plugin_manager(extra_plugins=(RecordingPlugin(),)))
    for hook_name in PLUGIN_KINDS.values():
        assert CALLS[hook_name] == 1, f"{hook_name} was called {CALLS[hook_name]} times"
    llm = LLM(
        model=str(folder),
        registry=registry,
        scheduler="recording",
        attention_backend="recording",
        sampler="recording",
        executor="recording",
        speculative_config={"method": "recording"},
    )
    constraint = {"regex": "[a-z ]*", "backend": "recording"}
    params = SamplingParams(
        max_tokens=3, temperature=0.5, seed=1, ignore_eos=True, structured_outputs=constraint
    )
    # The second request, without a grammar, speculates (the proposer drafts for it).
    plain = SamplingParams(max_tokens=8, temperature=0.5, seed=1, ignore_eos=True)
    outputs = llm.generate(["Hello", "Hello"], [params, plain], use_tqdm=False)
    assert [len(output.outputs[0].token_ids) for output in outputs] == [3, 8]
    # weight_format: a float model, see the next test; the parsers: the server's, see below.
    for kind in set(PLUGIN_KINDS) - {"weight_format", "tool_parser", "reasoning_parser"}:
        used = [key for key in CALLS if key.startswith(f"{kind}.")]
        assert used and all(CALLS[key] >= 3 for key in used), f"the {kind} was not used"


def test_a_registered_weight_format_computes_a_quantized_model(tiny_model, tmp_path):
    """The plan keeps a GGUF file's quantized matrices in the registered format (preferred
    to the built-in one), and the model's products run through it."""
    path = write_tiny_gguf(tiny_model, tmp_path / "tiny-q.gguf", quantize=("Q4_1", "Q8_0"))
    CALLS.clear()
    registry = PluginRegistry(build_plugin_manager(extra_plugins=(RecordingPlugin(),)))
    assert CALLS["register_weight_formats"] == 1
    llm = LLM(model=str(path), registry=registry, num_kv_blocks=16)
    plan = llm.llm_engine.engine_core.quantization
    assert plan.format_names == {"Q4_1": "recording", "Q8_0": "recording"}
    assert "kept quantized (weight format 'recording':" in plan.describe(torch.float32)
    llm.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert CALLS["weight_format.linear"] >= 3


def test_a_registered_proposer_is_found_by_name_and_drafts():
    """register_proposers fills the registry's proposers; the class is built as
    ``cls(SpeculativeConfig)`` and proposes."""
    CALLS.clear()
    registry = PluginRegistry(build_plugin_manager(extra_plugins=(RecordingPlugin(),)))
    assert CALLS["register_proposers"] == 1
    cls = registry.get("proposer", "recording")
    assert cls is RecordingProposer
    proposer = cls(SpeculativeConfig(method="recording", num_speculative_tokens=2))
    request = DraftRequest("a", [1, 2, 3, 1, 2], num_prompt_tokens=3, max_drafts=2)
    assert proposer.propose([request]) == {"a": [3, 1]}
    assert CALLS["proposer.propose"] == 1


def test_a_registered_tool_parser_is_what_the_server_reads_calls_with():
    """register_tool_parsers fills the registry's tool parsers; the server's chat endpoint
    builds the one ``--tool-call-parser`` names, per reply, and feeds it the text."""
    from vlite.server.output_constraints import ToolPlan
    from vlite.server.tool_calls import new_stream, tool_parser_class

    CALLS.clear()
    registry = PluginRegistry(build_plugin_manager(extra_plugins=(RecordingPlugin(),)))
    assert CALLS["register_tool_parsers"] == 1
    cls = tool_parser_class("recording", registry)
    assert cls is RecordingToolParser
    plan = ToolPlan("auto", tools=[{"type": "function", "function": {"name": "f"}}])
    reply = new_stream(cls, plan.tools).whole(
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    )
    assert reply.content is None and reply.tool_calls[0].function.name == "f"
    assert CALLS["tool_parser.feed"] == 1


def test_a_registered_reasoning_parser_is_what_the_server_splits_replies_with():
    """register_reasoning_parsers fills the registry's reasoning parsers; the server's chat
    endpoint builds the one ``--reasoning-parser`` names, per reply, and feeds it the text."""
    from vlite.server.reasoning import new_split, reasoning_parser_class

    CALLS.clear()
    registry = PluginRegistry(build_plugin_manager(extra_plugins=(RecordingPlugin(),)))
    assert CALLS["register_reasoning_parsers"] == 1
    cls = reasoning_parser_class("recording", registry)
    assert cls is RecordingReasoningParser
    assert new_split(cls).whole("<think>hmm</think>yes") == ("hmm", "yes")
    assert CALLS["reasoning_parser.feed"] == 1


CLI_PLUGIN = """
import click
import vlite


@click.command("hello-from-plugin")
@click.argument("name")
def hello(name):
    click.echo(f"Hello from a plugin, {name}!")


@vlite.hookimpl
def register_cli_commands(cli):
    cli.add_command(hello)
"""


def test_register_cli_commands_is_called_by_main(install_plugin, monkeypatch, capsys):
    from vlite.cli.main import cli, main

    install_plugin("cli-plugin", CLI_PLUGIN)
    monkeypatch.setattr(sys, "argv", ["vlite", "hello-from-plugin", "Ada"])
    try:
        with pytest.raises(SystemExit) as info:
            main()
    finally:
        cli.commands.pop("hello-from-plugin", None)  # main() adds to the shared group
    assert info.value.code == 0
    assert capsys.readouterr().out == "Hello from a plugin, Ada!\n"


EXERCISED_BY = {
    **dict.fromkeys(
        PLUGIN_KINDS.values(),
        test_registration_hooks_are_called_and_the_engine_uses_what_they_register,
    ),
    "register_cli_commands": test_register_cli_commands_is_called_by_main,
    "register_weight_formats": test_a_registered_weight_format_computes_a_quantized_model,
    "register_proposers": test_a_registered_proposer_is_found_by_name_and_drafts,
    "register_tool_parsers": test_a_registered_tool_parser_is_what_the_server_reads_calls_with,
    "register_reasoning_parsers": (
        test_a_registered_reasoning_parser_is_what_the_server_splits_replies_with
    ),
}


def test_every_hookspec_is_exercised_by_a_test():
    missing = set(HOOKSPECS) - set(EXERCISED_BY)
    assert not missing, f"hookspecs without a test here: {sorted(missing)}"
    implemented = {name for name in vars(RecordingPlugin) if name.startswith("register_")}
    assert implemented == set(PLUGIN_KINDS.values())

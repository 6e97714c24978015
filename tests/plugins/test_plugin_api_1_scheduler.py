"""A scheduler plugin written for plugin API 1 (from the docs of that version: a subclass of
``vlite.core.scheduler.Scheduler`` declaring ``VLITE_PLUGIN_API = ">=1,<2"``) still loads,
passes the conformance suite, runs in the engine, and is reported as deprecated."""

from __future__ import annotations

import sys
import types

import pytest

import vlite
from vlite.core.request import Request
from vlite.core.scheduler import Scheduler
from vlite.testing import SchedulerConformance


class ShortestPromptFirstScheduler(Scheduler):
    """The API-1 example plugin's policy, as that version's docs wrote it."""

    supports_chunked_prefill = False

    def waiting_sort_key(self, request: Request) -> tuple:
        return (request.num_prompt_tokens, self.arrival_index(request))

    def choose_victim(self, running: list[Request]) -> Request:
        return max(running, key=self.waiting_sort_key)


def _api_1_plugin() -> types.ModuleType:
    module = types.ModuleType("api_1_scheduler_plugin")
    module.VLITE_PLUGIN_API = ">=1,<2"

    @vlite.hookimpl
    def register_schedulers(register):
        register("api-1-shortest-prompt-first", ShortestPromptFirstScheduler)

    module.register_schedulers = register_schedulers
    sys.modules.setdefault(module.__name__, module)
    return module


API_1_PLUGIN = _api_1_plugin()


@pytest.mark.filterwarnings("ignore:scheduler .*plugin API 1:DeprecationWarning")
class TestApi1Scheduler(SchedulerConformance):
    plugin_name = "api-1-shortest-prompt-first"
    extra_plugins = (API_1_PLUGIN,)
    load_entry_points = False


def test_building_an_api_1_scheduler_warns_with_what_to_use_instead(tiny_model):
    from vlite.core.plugins import PluginRegistry, build_plugin_manager

    registry = PluginRegistry(build_plugin_manager(extra_plugins=(API_1_PLUGIN,)))
    with pytest.warns(
        DeprecationWarning, match="register a .*SchedulingPolicy subclass.*until 2027-06-30"
    ):
        llm = vlite.LLM(
            model=tiny_model, registry=registry, scheduler="api-1-shortest-prompt-first"
        )
    outputs = llm.generate(["a b c", "a"], vlite.SamplingParams(max_tokens=2))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 2]

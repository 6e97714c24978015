"""The plugin's own behaviour: its policy and its registration."""

import vlite_plugin_example
from vlite_plugin_example import MultinomialSampler, NoRepeatNgram, ShortestPromptFirstPolicy

from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.testing.scheduler_driver import SchedulerDriver


def test_registered_through_the_entry_point():
    registry = PluginRegistry(build_plugin_manager())
    scheduler = registry.entry("scheduler", "shortest-prompt-first")
    assert scheduler.obj is ShortestPromptFirstPolicy
    assert (scheduler.package, scheduler.plugin_name) == ("vlite-plugin-example", "example")
    assert registry.get("sampler", "multinomial") is MultinomialSampler
    assert registry.get("logits_processor", "no-repeat-ngram") is NoRepeatNgram


def test_declares_a_compatible_plugin_api():
    from vlite.core.plugins import api_requirement_allows

    assert api_requirement_allows(vlite_plugin_example.VLITE_PLUGIN_API)


def test_admits_the_shortest_prompt_first():
    driver = SchedulerDriver.create(
        ShortestPromptFirstPolicy,
        num_blocks=64,
        block_size=4,
        max_num_seqs=1,
        max_num_batched_tokens=64,
    )
    for request_id, length in [("long", 30), ("short", 3), ("middle", 12)]:
        driver.add(request_id, list(range(1, length + 1)), max_tokens=2)
    admitted = []
    while driver.scheduler.has_unfinished_requests():
        admitted += [new.request_id for new in driver.step().scheduler_output.new_requests]
    assert admitted == ["short", "middle", "long"]


def test_preempts_the_request_it_would_admit_last():
    driver = SchedulerDriver.create(
        ShortestPromptFirstPolicy,
        num_blocks=6,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )
    driver.add("short", [1, 2, 3], max_tokens=8)
    driver.add("long", list(range(1, 9)), max_tokens=8)
    driver.run()
    assert driver.preempted_ids == {"long"}
    assert driver.outputs == driver.expected


def test_a_request_selects_the_processor_and_only_it_changes(tmp_path):
    from vlite import LLM, SamplingParams
    from vlite.testing.tiny_models import make_tiny_model

    llm = LLM(model=str(make_tiny_model(tmp_path, "LlamaForCausalLM")))
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    no_repeat = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, extra_args={"no_repeat_ngram_size": 1}
    )
    prompt = {"prompt_token_ids": [5, 6, 7]}
    repeated, distinct, plain_again = (
        out.outputs[0].token_ids
        for out in llm.generate([prompt, prompt, prompt], [plain, no_repeat, plain])
    )
    assert len(set(repeated)) < len(repeated)  # a random tiny model repeats itself
    assert len(set(distinct)) == len(distinct) == 24
    assert plain_again == repeated

"""vlite-plugin-example: a shortest-prompt-first scheduler, a multinomial sampler and a
logits processor that a request selects (no repeated n-grams).

The entry point ``example`` in the ``vlite`` group names this module; vlite registers it
with its plugin manager, which calls the hook functions below at engine construction.
"""

import vlite
from vlite_plugin_example.no_repeat import NoRepeatNgram
from vlite_plugin_example.sampler import MultinomialSampler
from vlite_plugin_example.scheduler import ShortestPromptFirstPolicy

#: The vlite plugin API versions this plugin works with (checked when vlite loads it).
VLITE_PLUGIN_API = ">=3,<4"

__all__ = ["MultinomialSampler", "NoRepeatNgram", "ShortestPromptFirstPolicy"]


@vlite.hookimpl
def register_schedulers(register):
    register("shortest-prompt-first", ShortestPromptFirstPolicy)


@vlite.hookimpl
def register_samplers(register):
    register("multinomial", MultinomialSampler)


@vlite.hookimpl
def register_logits_processors(register):
    register("no-repeat-ngram", NoRepeatNgram)

"""ModelConformance on an outside-style model plugin.

Granite (``granite_plugin.py``) is registered only through ``extra_plugins``, as a plugin
package under test would be, with multipliers other than 1.0 so that each of the Llama
hooks it overrides is exercised. The built-in architectures run the same suite in
``tests/testing/test_builtin_conformance.py`` (``TestBuiltinModels``).
"""

from __future__ import annotations

import granite_plugin

from vlite.testing import ModelConformance


class TestGraniteConformance(ModelConformance):
    plugin_name = "GraniteForCausalLM"
    extra_plugins = (granite_plugin,)
    load_entry_points = False
    tiny_config = {
        "embedding_multiplier": 2.0,
        "attention_multiplier": 0.1,
        "residual_multiplier": 0.5,
        "logits_scaling": 4.0,
    }

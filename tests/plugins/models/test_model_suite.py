"""ModelConformance on an outside-style model plugin.

Granite (``granite_plugin.py``) is registered only through ``extra_plugins``, as a plugin
package under test would be; its class's ``tiny_config`` sets multipliers other than 1.0,
so that each of the Llama hooks it overrides is exercised. The built-in architectures run
the same suite in ``tests/testing/test_builtin_conformance.py`` (``TestBuiltinModels``).
"""

from __future__ import annotations

import json

import granite_plugin

from vlite.testing import ModelConformance


class TestGraniteConformance(ModelConformance):
    plugin_name = "GraniteForCausalLM"
    extra_plugins = (granite_plugin,)
    load_entry_points = False

    def test_the_tiny_model_has_the_model_class_tiny_config(self, tiny_model_folder):
        config = json.loads((tiny_model_folder / "config.json").read_text())
        wanted = granite_plugin.GraniteForCausalLM.tiny_config
        assert {field: config[field] for field in wanted} == wanted

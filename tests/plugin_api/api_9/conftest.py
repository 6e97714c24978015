"""A frozen copy, collected only by ``tests/plugin_api/test_frozen_plugins.py`` (which runs it
as an installed package would run): never by the main suite."""

collect_ignore = ["example_tests", "vlite_plugin_example"]

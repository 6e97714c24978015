"""Fixtures for the tests of vlite.testing: pytester runs suites against broken plugins."""

pytest_plugins = ["pytester"]

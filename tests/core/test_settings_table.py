"""The README's settings table names every VliteConfig setting (a new one cannot be left out)."""

from __future__ import annotations

import re
from pathlib import Path

from vlite.core.config import VliteConfig

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_settings_table_names_every_setting():
    text = README.read_text()
    table = text[text.index("| setting | default | meaning |") :]
    table = table[: table.index("\n\n")]
    first_cells = [row.split("|")[1] for row in table.splitlines()[2:]]
    named = set(re.findall(r"`([a-z0-9_]+)`", " ".join(first_cells)))
    assert set(VliteConfig.model_fields) - named == set()
    assert named - set(VliteConfig.model_fields) == set()

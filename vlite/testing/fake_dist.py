"""Installed-looking plugin packages for tests: a module plus a ``.dist-info`` on ``sys.path``.

:func:`write_plugin_distribution` writes what ``pip install`` would leave for a one-module
plugin package: the module and a ``NAME-VERSION.dist-info`` folder with ``METADATA`` and
an ``entry_points.txt`` in the ``vlite`` group. Put the folder on ``sys.path`` (pytest's
``monkeypatch.syspath_prepend``) or ``PYTHONPATH`` and ``importlib.metadata`` finds the
entry point exactly as it finds a real one, so plugin loading is tested end to end.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from vlite.core.plugins import ENTRY_POINT_GROUP


def write_plugin_distribution(
    root: Path,
    dist_name: str,
    modules: dict[str, str],
    entry_points: dict[str, str],
    version: str = "1.0",
) -> Path:
    """Write ``modules`` (module name -> source) and the distribution's metadata to ``root``.

    Args:
        dist_name: the package name (``"my-vlite-plugin"``).
        entry_points: entry-point name -> object reference (``"my_module"``).

    Returns:
        ``root``, to put on ``sys.path``.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for module_name, source in modules.items():
        (root / f"{module_name}.py").write_text(textwrap.dedent(source))
    normalized = re.sub(r"[-_.]+", "_", dist_name)
    dist_info = root / f"{normalized}-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n"
    )
    lines = [f"[{ENTRY_POINT_GROUP}]"] + [f"{name} = {ref}" for name, ref in entry_points.items()]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root

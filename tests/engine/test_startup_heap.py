"""A process's start-up objects leave the garbage collector's generations."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc
from vlite.engine.startup_heap import freeze_startup_heap
kept = [[i] for i in range(20000)]  # long-lived objects, as a loaded model's
gc.collect()
walked_before = len(gc.get_objects(2))
freeze_startup_heap()
print(gc.get_freeze_count(), walked_before, len(gc.get_objects(2)))
"""


def test_a_full_collection_no_longer_walks_what_start_up_made():
    # In a child process: freezing this test session's own heap would keep its cycles.
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True
    )
    frozen, walked_before, walked_after = map(int, result.stdout.split())
    assert walked_before >= 20000
    assert frozen >= 20000
    assert walked_after < 1000

"""reuse_freed_memory: large tensors come from the allocator's heap, not fresh mappings."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vlite.worker import cpu_memory

# Prints whether a 64 MiB tensor lies in the process's [heap] (glibc's brk heap, whose
# freed memory is reused) or in a mapping of its own (unmapped on free, faulted in afresh
# on the next allocation).
_SCRIPT = """
import sys, torch
from vlite.worker.cpu_memory import reuse_freed_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
tensor = torch.empty(64 << 20, dtype=torch.uint8)
address = tensor.data_ptr()
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[heap]"):
        start, end = (int(part, 16) for part in line.split()[0].split("-"))
        print(start <= address < end)
        break
else:
    print(False)
"""


def _in_heap(mode: str) -> bool:
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, check=True
    )
    return result.stdout.strip() == "True"


@pytest.mark.skipif(cpu_memory._glibc() is None, reason="glibc's allocator only")
def test_large_tensors_come_from_the_heap_once_set():
    assert not _in_heap("default")  # glibc maps allocations this large on their own
    assert _in_heap("reuse")

"""reuse_freed_memory: large freed tensors are reused instead of being mapped afresh."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vlite.worker import cpu_memory

_SCRIPT = """
import resource, sys, torch
from vlite.worker.cpu_memory import reuse_freed_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
def touch():
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # 64 MiB, freed on return
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults_of_second_allocation(mode: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, check=True
    )
    return int(result.stdout.strip())


@pytest.mark.skipif(cpu_memory._glibc() is None, reason="glibc's allocator only")
def test_freed_memory_is_reused_without_page_faults():
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    # Without the setting glibc maps the 64 MiB afresh: a fault per page.
    assert _page_faults_of_second_allocation("default") > pages // 2
    # With it, the second allocation reuses the first one's pages.
    assert _page_faults_of_second_allocation("reuse") < pages // 20

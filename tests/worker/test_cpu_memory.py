"""reuse_freed_memory: large tensors come from the allocator's heap, not fresh mappings;
lazily_zeroed: a KV cache resident only where written."""

from __future__ import annotations

import os
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


# Measures, in a fresh process (an earlier test's worker may have told this one's allocator
# to keep freed memory, which would count a reduction's scratch space as resident), how
# much a lazily zeroed 64 MiB cache adds to the resident size: after reading it all, after
# writing 100 of its 2048 blocks, and after writing it whole.
_LAZY_SCRIPT = """
import torch
from vlite.worker.cpu_memory import lazily_zeroed

def resident_mib():
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

before = resident_mib()
cache = lazily_zeroed((2, 2048, 16, 8, 64), torch.bfloat16)
assert cache.shape == (2, 2048, 16, 8, 64) and cache.dtype == torch.bfloat16
assert not cache.any()
read = resident_mib() - before
cache[:, :100] = 1.5
partly = resident_mib() - before
assert cache[1, 99].float().mean().item() == 1.5 and not cache[:, 100:].any()
cache[:] = 2.0
print(read, partly, resident_mib() - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmRSS")
def test_a_lazily_zeroed_tensor_is_resident_only_where_written():
    result = subprocess.run(
        [sys.executable, "-c", _LAZY_SCRIPT], capture_output=True, text=True, check=True
    )
    read, partly, whole = (float(value) for value in result.stdout.split())
    assert read < 16  # reading maps the shared zero page, not new memory
    assert partly < 16  # 100 of 2048 blocks: about 3 MiB
    assert whole > 48

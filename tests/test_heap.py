"""services/common/heap.py: with freed memory kept, buffers of megabytes freed and allocated
again reuse the same pages instead of faulting new ones in (what made a worker's write-back
of one prompt cost 3x as much, bench/writeback.py). Counted as the process's minor page
faults, in fresh processes: one with glibc's malloc as it comes, one after keep_freed_memory.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# Rounds of 8 buffers of 8 MiB, each written whole, all freed at the end of the round: as a
# write-back's blocks, Put request and serialization come and go together.
CHURN = """
import resource, sys
from rtp_serve.services.common.heap import keep_freed_memory
if sys.argv[1] == "kept" and not keep_freed_memory():
    sys.exit(3)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def round_():
    buffers = [bytearray(8 << 20) for _ in range(8)]
    del buffers
round_()  # the first round maps the memory, either way
before = faults()
for _ in range(5):
    round_()
print(faults() - before)
"""


def _faults(heap: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHURN, heap], capture_output=True, text=True, check=False
    )
    if out.returncode == 3:
        pytest.skip("this libc has no mallopt (not glibc)")
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_freed_buffers_are_reused_without_page_faults() -> None:
    pages = 5 * 8 * (8 << 20) // 4096  # every page of every round, faulted in again
    assert _faults("glibc") > pages // 2  # the control: glibc hands them back
    assert _faults("kept") < pages // 50

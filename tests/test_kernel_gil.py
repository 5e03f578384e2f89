"""The compiled kernels run without the GIL, as torch's own ops do: in a worker the event
loop (gRPC streams, KV events, write-back) runs Python beside the engine thread's kernels,
instead of waiting for each kernel to end and then stopping the engine while it runs.

The check: another Python thread records the time at every turn of a loop; it can only run
while nobody holds the GIL, so it records a time strictly inside a kernel call exactly when
the kernel let go of it (`ran_beside`; the kernels built without the release record none)."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rtp_serve.kernels.linear import pack_panels

MODULE = Path(__file__).resolve().parents[1] / "kernels" / "csrc" / "module.cpp"
# Bindings that compute nothing (a constant), so need not release it.
CONSTANTS = {"panel_width", "vector_lanes", "int8_gemm_supported"}


def ran_beside(call, tries: int = 20) -> bool:
    """Whether another Python thread ran while `call()` was running (in one try of several:
    on a busy machine that thread may get no core during one call). The switch interval is
    made huge, so that thread runs only where the GIL is let go of, never by a forced
    switch; it lets go at each turn (sleep(0)); the result outlives the window (freeing a
    big tensor lets go of the GIL too)."""
    ticks: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        while not ticks:  # the spinner is running
            time.sleep(0.001)
        for _ in range(tries):
            start = time.perf_counter()
            out = call()
            end = time.perf_counter()
            del out
            if any(start < t < end for t in ticks[-100_000:]):
                return True
        return False
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(interval)


def test_the_check_sees_a_call_that_holds_the_gil():
    # bytes * n fills its result with the GIL held: no other thread runs meanwhile.
    assert not ran_beside(lambda: b"x" * 50_000_000, tries=2)
    assert ran_beside(lambda: torch.mm(torch.ones(256, 1024), torch.ones(1024, 1024)))


def test_every_kernel_binding_releases_the_gil():
    defs = re.findall(r'm\.def\("(\w+)", &\w+,( nogil,)?', MODULE.read_text())
    assert len(defs) >= 9
    holding = [name for name, nogil in defs if not nogil and name not in CONSTANTS]
    assert not holding, f"bound without py::call_guard<py::gil_scoped_release>: {holding}"


@pytest.mark.parametrize("kernel", ["packed_gemm", "rows_gemm", "rms_norm"])
def test_a_kernel_lets_python_threads_run(ops, kernel):
    torch.manual_seed(0)
    x = torch.randn(64, 2048)
    w = torch.randn(4096, 2048)
    if kernel == "packed_gemm":
        panels = pack_panels(w, ops.panel_width())
        call = lambda: ops.packed_gemm(x, panels, w.shape[0], None, None, None)  # noqa: E731
    elif kernel == "rows_gemm":
        call = lambda: ops.rows_gemm(x, w, None, None, None)  # noqa: E731
    else:
        big, weight = torch.randn(16384, 2048), torch.ones(2048)
        call = lambda: ops.rms_norm(big, weight, 1e-6)  # noqa: E731
    assert ran_beside(call), f"no Python thread ran during {kernel}: it holds the GIL"

"""The chaos table at test size (bench/chaos.py --test-size): a launched cluster under steady
streaming load, each service SIGKILLed (and restarted by the launcher) or a worker SIGSTOPped
past its TTL, one fault at a time. Every fault but the frontend's own loses no request,
every served text is the offline engine's, routing is healthy again, no block leaks and the
master's index equals what the workers hold."""

from __future__ import annotations

import pytest

from bench import chaos


@pytest.mark.parametrize(
    ("topology", "faults"),
    [
        ("pd:2:2", "all"),  # prefill, decode, stop-decode, cache, redis, nats, master, ...
        ("fused:2", "fused,stop-fused"),  # the rest is the same services as in PD
    ],
)
def test_every_fault_under_load(topology, faults):
    args = chaos.parse_args(["--test-size", "--topology", topology, "--faults", faults])
    rows = chaos.run(args)
    report = chaos.table(rows)
    expected = chaos.ALL_PD if faults == "all" else faults.split(",")
    assert [r.fault for r in rows] == expected, report
    for row in rows:
        assert row.passed(chaos.FAULTS[row.fault]), report
        assert row.requests > 0, report  # traffic really ran through the fault

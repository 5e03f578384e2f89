"""The soak at test size (bench/soak.py --test-size): a fused cluster held at saturation for
a minute with streamed and whole completions and chats, n=2, stop strings, client-side
cancellations and mid-stream disconnects. Nothing fails, no block leaks, and no process's
memory grows much past its level after warm-up. (The 5% memory and TTFT-drift targets are
the 10-minute program's; a minute on a shared machine is too short and noisy to judge them,
so this checks for a gross leak only.)"""

from __future__ import annotations

from bench import soak

GROSS_LEAK = 0.25  # growth past warm-up, within one minute, that only a leak explains


def test_a_minute_at_saturation_fails_nothing_and_leaks_nothing():
    args = soak.parse_args(["--test-size"])
    report = soak.run(args)
    text = soak.render(report, args)
    assert report["failed"] == 0, text
    assert report["leaked_blocks"] == 0, text
    assert all(report["by_kind"][k] > 0 for k in soak.KINDS), text  # every kind of traffic ran
    assert report["memory"], text
    for name, m in report["memory"].items():
        assert m["growth"] <= GROSS_LEAK, f"{name} grew {m['growth']:.0%}\n{text}"

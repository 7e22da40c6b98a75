"""The soak run in its short mode: random faults of every kind, nothing wrong, twice or lost."""

from __future__ import annotations

from tests.support.soak import Soak, print_report

# Long enough for a few dozen random disturbances of every kind (`python -m benchmarks.soak --long` runs 5,000):
# at 1 ms a prompt token (82 tokens on average) the disturbances themselves stretch the job to about a minute.
SAMPLES = 100
PREFILL_US_PER_TOKEN = 1000


def test_short_soak(tmp_path):
    report = Soak(tmp_path, f"sqlite:///{tmp_path / 'soak.db'}", seed=3, prefill_us_per_token=PREFILL_US_PER_TOKEN).run(
        SAMPLES, deadline_s=400
    )
    print_report(report)
    assert report["stored_but_wrong"] == 0
    assert report["stored_twice"] == 0
    assert report["lost"] == 0
    assert report["stored"] + report["failed"] == SAMPLES
    assert report["stored"] > SAMPLES // 2, report
    assert sum(report["injected"].values()) > 0 and sum(report["actions"].values()) >= 10, report

"""The soak run in its short mode: random faults of every kind, nothing wrong, twice or lost."""

from __future__ import annotations

from tests.support.soak import Soak, print_report

# Long enough for a few dozen random disturbances of every kind (`python -m tests.soak --long` runs 5,000).
SAMPLES = 100


def test_short_soak(tmp_path):
    report = Soak(tmp_path, f"sqlite:///{tmp_path / 'soak.db'}", seed=3).run(SAMPLES, deadline_s=400)
    print_report(report)
    assert report["stored_but_wrong"] == 0
    assert report["stored_twice"] == 0
    assert report["lost"] == 0
    assert report["stored"] + report["failed"] == SAMPLES
    assert report["stored"] > SAMPLES // 2, report
    assert sum(report["injected"].values()) > 0 and sum(report["actions"].values()) > 3, report

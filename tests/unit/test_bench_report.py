"""The benchmarks' tables: a figure wider than its column never runs into the next one, and the JSON
report holds every row's figures unrounded."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.report import Column, Report, add_json_argument

COLUMNS = (Column("run", "run", left=True), Column("rate", "x min", ".2f"), Column("low", "min", ".2f"))


def args(tmp_path, **extra) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_json_argument(parser)
    return parser.parse_args(["--json", str(tmp_path / "out" / "figures.json")], argparse.Namespace(**extra))


def test_a_figure_wider_than_its_column_stays_apart_from_the_next(tmp_path, capsys):
    report = Report("bench_x", args(tmp_path))
    table = report.table("runs", *COLUMNS)
    table.add(run="bare loop", rate=1.5, low=0.83)
    table.add(run="service, with a long name", rate=1014.7, low=0.83)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "x", "min", "min"]
    assert lines[1].split() == ["bare", "loop", "1.50", "0.83"]
    assert lines[2].split()[-2:] == ["1014.70", "0.83"]


def test_markdown_rows_and_missing_figures(tmp_path, capsys):
    report = Report("bench_x", args(tmp_path))
    table = report.table("runs", *COLUMNS, Column("share", "share", ".0%|!"), markdown=True)
    table.add(run="a", rate=2.0, low=None, share=0.5)
    assert capsys.readouterr().out.splitlines() == [
        "| run | x min | min | share |",
        "|---|---|---|---|",
        "| a | 2.00 | - | 50%! |",
    ]


def test_the_json_report_holds_every_figure_unrounded(tmp_path):
    report = Report("bench_x", args(tmp_path, samples=3))
    table = report.table("runs", *COLUMNS, header=False)
    table.add(run="a", rate=1 / 3, low=0.25, extra_key=7)
    report.figure("disk_gb_s", 1.25)
    report.write()
    document = json.loads((tmp_path / "out" / "figures.json").read_text())
    assert document["benchmark"] == "bench_x" and document["arguments"] == {"samples": 3}
    assert document["figures"] == {"disk_gb_s": 1.25}
    assert document["tables"] == {"runs": [{"run": "a", "rate": 1 / 3, "low": 0.25, "extra_key": 7}]}
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["figures.json"]  # no temporary file left


def test_a_row_without_a_shown_figure_is_refused(tmp_path):
    table = Report("bench_x", args(tmp_path)).table("runs", *COLUMNS, header=False)
    with pytest.raises(KeyError, match="low"):
        table.add(run="a", rate=1.0)


def test_without_json_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    add_json_argument(parser)
    report = Report("bench_x", parser.parse_args([]))
    report.table("runs", *COLUMNS, header=False)
    report.write()
    assert list(tmp_path.iterdir()) == []

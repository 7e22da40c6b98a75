"""Prometheus text as hsx serves it, and the Grafana dashboard's PromQL (deploy/grafana/hsx.json): the
series names a scrape holds (each line checked against the text format), and the metric names an
expression reads, so that a test can hold the dashboard to what hsx really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "hsx.json"
OPERATIONS = ROOT / "docs" / "operations.md"
# Prometheus's own series: an alert rule may read them.
PROMETHEUS_OWN = {"up"}

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABELS = r'\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*",?)*\}'
_SAMPLE = re.compile(rf"({_NAME})({_LABELS})? (-?[0-9.eE+-]+|NaN|[+-]Inf)")
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("",), "gauge": ("",)}


def series_names(text: str) -> set[str]:
    """Every series name of a scrape. Each line must be a comment (HELP, TYPE) or a sample whose name
    a TYPE line declared before it (a histogram's with _bucket, _sum or _count); AssertionError names
    the first line that is not."""
    declared: set[str] = set()
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            declared |= {name + suffix for suffix in _SUFFIXES[kind]}
            continue
        if line.startswith("# HELP ") or not line:
            continue
        sample = _SAMPLE.fullmatch(line)
        assert sample is not None, f"not a sample line: {line!r}"
        assert sample[1] in declared, f"{sample[1]} has no TYPE line before it"
        names.add(sample[1])
    return names


def declared_names(text: str) -> set[str]:
    """Every series name the scrape's TYPE lines declare (a histogram's three), samples or not."""
    found = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            found |= {name + suffix for suffix in _SUFFIXES[kind]}
    return found


# What a name in PromQL can be besides a metric: keywords, and what stands in a grouping or a matcher.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression reads: strings, label matchers, ranges and grouping label lists
    taken out, then every name that is not a function or aggregation (followed by "(") or a keyword."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(rf"(?<![\w.]){_NAME}", text):
        rest = text[m.end() :].lstrip()
        if m[0] in _KEYWORDS or rest.startswith("(") or re.fullmatch(r"\d.*", m[0]):
            continue
        names.add(m[0])
    return names


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def dashboard_expressions(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every query of every panel, rows' panels included."""
    found = []
    for panel in doc["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            found += [(inner["title"], t["expr"]) for t in inner.get("targets", [])]
    return found


def documented_alerts() -> list[tuple[str, str]]:
    """(alert, expression) of every rule in docs/operations.md's block of alerts."""
    text = OPERATIONS.read_text(encoding="utf-8")
    block = re.search(r"<!-- alerts:[^>]*-->\n```yaml\n(.*?)```", text, re.S)
    assert block, "no alerts block in docs/operations.md"
    groups = yaml.safe_load(block[1])["groups"]
    return [(rule["alert"], rule["expr"]) for group in groups for rule in group["rules"]]

"""What a benchmark prints for people and writes for programs.

A `Table` prints each row as it is measured. Its columns are at least as wide as their titles, and a
figure wider than its column widens its own cell only: cells are always two spaces apart (or a pipe
apart, in Markdown), so a figure that grows never runs into the next one. The same figures, unrounded,
go to the JSON file named by `--json PATH` (`Report.write`), which is what programs and the tests read,
never the aligned text.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

GAP = "  "


@dataclass(frozen=True)
class Column:
    """One column: the row's key it shows, its title, the format of its figures (a format spec, or a
    suffix after `|`: `".0f|s"` prints `12s`), and whether it is text, aligned left."""

    key: str
    title: str
    spec: str = ""
    left: bool = False
    width: int = 0

    def cell(self, value: Any) -> str:
        if value is None:
            return "-"
        spec, _, suffix = self.spec.partition("|")
        return format(value, spec) + suffix

    @property
    def size(self) -> int:
        return max(len(self.title), self.width)

    def pad(self, text: str) -> str:
        return text.ljust(self.size) if self.left else text.rjust(self.size)


@dataclass
class Table:
    """A table printed row by row, kept for the JSON report."""

    name: str
    columns: tuple[Column, ...]
    markdown: bool = False
    rows: list[dict[str, Any]] = field(default_factory=list)

    def header(self) -> str:
        if self.markdown:
            titles = "| " + " | ".join(c.title for c in self.columns) + " |"
            return titles + "\n|" + "---|" * len(self.columns)
        return GAP.join(c.pad(c.title) for c in self.columns).rstrip()

    def line(self, row: dict[str, Any]) -> str:
        cells = [c.cell(row.get(c.key)) for c in self.columns]
        if self.markdown:
            return "| " + " | ".join(cells) + " |"
        return GAP.join(c.pad(text) for c, text in zip(self.columns, cells)).rstrip()

    def print_header(self) -> None:
        print(self.header(), flush=True)

    def add(self, **row: Any) -> dict[str, Any]:
        """Keep the row (every key, shown or not) and print its line."""
        unknown = {c.key for c in self.columns} - row.keys()
        if unknown:
            raise KeyError(f"{self.name}: the row has no {sorted(unknown)}")
        self.rows.append(row)
        print(self.line(row), flush=True)
        return row


class Report:
    """A benchmark's tables and its other figures, written as one JSON document."""

    def __init__(self, benchmark: str, args: argparse.Namespace):
        self.benchmark = benchmark
        self.arguments = {k: v for k, v in vars(args).items() if k != "json"}
        self.path: str | None = getattr(args, "json", None)
        self.tables: dict[str, Table] = {}
        self.figures: dict[str, Any] = {}

    def table(self, name: str, *columns: Column, markdown: bool = False, header: bool = True) -> Table:
        """A new table, its header printed (unless `header=False`, for one printed later)."""
        if name in self.tables:
            raise ValueError(f"{self.benchmark}: a second table named {name!r}")
        table = self.tables[name] = Table(name, columns, markdown)
        if header:
            table.print_header()
        return table

    def figure(self, key: str, value: Any) -> Any:
        self.figures[key] = value
        return value

    def document(self) -> dict[str, Any]:
        return {
            "benchmark": self.benchmark,
            "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "cpus": len(os.sched_getaffinity(0)),
            "arguments": self.arguments,
            "figures": self.figures,
            "tables": {name: t.rows for name, t in self.tables.items()},
        }

    def write(self) -> None:
        """Write the document to `--json PATH`, whole or not at all, when the path was given."""
        if not self.path:
            return
        target = Path(self.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=target.parent, suffix=".tmp", delete=False) as f:
            json.dump(self.document(), f, indent=1, default=_plain)
        os.replace(f.name, target)


def _plain(value: Any) -> Any:
    """Paths and numpy or torch scalars as JSON has them."""
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write every figure, unrounded, to this JSON file (tables as lists of rows)",
    )

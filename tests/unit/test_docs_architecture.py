"""docs/architecture.md against the tree: every package and module its tree and its floors name exists, every
package under app/hsx and every top-level module is in both, and the lists of the repository's modules and of
the engines are the ones the code has."""

from __future__ import annotations

import re
from pathlib import Path

from hsx.sources import Source

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "app" / "hsx"
PAGE = ROOT / "docs" / "architecture.md"

ENTRY = re.compile(r"app/hsx/[\w./]*")
# A file or folder named in an entry's text: spans.py, index.html, repository/, versions/.
NAMED = re.compile(r"(?<![\w./<])(\w+(?:\.(?:py|js|css|html)|/))(?![\w/])")
BACKTICKED = re.compile(r"`([^`]+)`")


def section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def tree(text: str) -> str:
    block = section(text, "The tree")
    start = block.index("```\n") + 4
    return block[start : block.index("```", start)]


def entries(block: str) -> dict[str, str]:
    """Each line of the tree that names an `app/hsx/…` path first, with its text and the lines that go on
    from it (indented)."""
    listed: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        if line[:1].strip():
            path, _, words = line.partition(" ")
            current = path if ENTRY.fullmatch(path) else None
            if current is not None:
                listed[current] = words
        elif current is not None:
            listed[current] += "\n" + line
    return listed


def floors(text: str) -> str:
    """The floors table's `what stands there` cells."""
    rows = [line for line in section(text, "Floors").splitlines() if re.match(r"\| *\d+ *\|", line)]
    return "\n".join(rows)


def packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)


def top_level_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py")


def named_in_tree(path: Path, listed: dict[str, str]) -> bool:
    """Whether the tree names `path`: as an entry of its own, or in its parent's entry (`repository/`,
    `layers.py`), or in the entry of a module beside it."""
    rel = path.relative_to(ROOT).as_posix()
    own = rel + "/" if path.is_dir() else rel
    if own in listed:
        return True
    token = path.name + "/" if path.is_dir() else path.name
    parent = path.parent.relative_to(ROOT).as_posix()
    return any(
        token in NAMED.findall(words)
        for entry, words in listed.items()
        if entry.rstrip("/") == parent or entry.rsplit("/", 1)[0] == parent
    )


def test_every_path_and_file_the_tree_names_exists():
    listed = entries(tree(PAGE.read_text(encoding="utf-8")))
    missing = [entry for entry in listed if not (ROOT / entry).exists()]
    for entry, words in listed.items():
        missing += [f"{path} (in {entry})" for path in ENTRY.findall(words) if not (ROOT / path).exists()]
        folder = ROOT / entry if entry.endswith("/") else (ROOT / entry).parent
        for name in NAMED.findall(words):
            if not any(folder.rglob(name.rstrip("/"))):
                missing.append(f"{name} (in {entry})")
    assert not missing, f"{PAGE.relative_to(ROOT)}'s tree names what app/hsx does not hold: {missing}"


def test_every_package_and_top_level_module_is_in_the_tree():
    listed = entries(tree(PAGE.read_text(encoding="utf-8")))
    left_out = [
        p.relative_to(ROOT).as_posix() for p in [*packages(), *top_level_modules()] if not named_in_tree(p, listed)
    ]
    assert not left_out, f"{PAGE.relative_to(ROOT)}'s tree leaves out {left_out}"


def test_the_floors_name_every_top_level_package_and_module_and_nothing_else():
    named = set(BACKTICKED.findall(floors(PAGE.read_text(encoding="utf-8"))))
    top = {p.name for p in packages() if p.parent == PACKAGE} | {p.stem for p in top_level_modules()}
    assert top <= named, f"the floors leave out {sorted(top - named)}"
    everything = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in packages()}
    unknown = sorted(n for n in named if n.strip("/").rsplit("/", 1)[-1] not in everything | {"hsx"})
    assert not unknown, f"the floors name what app/hsx does not hold: {unknown}"


def test_the_repository_modules_are_the_ones_the_page_lists():
    modules = {p.stem for p in (PACKAGE / "db" / "repository").glob("*.py")} - {"__init__", "_base"}
    text = PAGE.read_text(encoding="utf-8")
    change = next(line for line in section(text, "Where a change goes").split("\n- ") if "db/repository/" in line)
    for where, words in (("the floors", floors(text)), ("where a change goes", change)):
        assert modules <= set(BACKTICKED.findall(words)), (
            f"{where} leave out {sorted(modules - set(BACKTICKED.findall(words)))}"
        )


def test_every_engine_is_in_the_tree():
    words = entries(tree(PAGE.read_text(encoding="utf-8")))["app/hsx/backends/"]
    modules = {f"{s.engine.rsplit('.', 2)[-2]}.py" for s in Source}
    assert modules <= set(NAMED.findall(words))


def test_the_checks_see_what_they_should(tmp_path):
    block = (
        "app/hsx/db/          models, and\n"
        "                     repository/: queries (jobs.py)\n"
        "app/hsx/wire.py  models; layers.py lists\n"
    )
    listed = entries(block)
    assert set(listed) == {"app/hsx/db/", "app/hsx/wire.py"}
    assert NAMED.findall(listed["app/hsx/db/"]) == ["repository/", "jobs.py"]
    assert named_in_tree(PACKAGE / "db" / "repository", listed)
    assert named_in_tree(PACKAGE / "layers.py", listed), "named beside wire.py"
    assert not named_in_tree(PACKAGE / "cli" / "client", listed)
    assert NAMED.findall("python -m benchmarks.<name>; tests/ unit/, docs/README.md") == ["tests/", "unit/"]

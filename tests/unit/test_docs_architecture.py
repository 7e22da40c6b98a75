"""docs/architecture.md against the tree: every package and module the page names exists (in its tree, its
floors, and as a dotted name or a path anywhere), every package and module under app/hsx is in its tree, every
top-level one in its floors too, and the lists of the repository's modules and of the engines are the ones the
code has."""

from __future__ import annotations

import importlib
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


# A dotted name in backticks: `hsx.backends.engine.Engine`, `db.engine`, `reference.__main__`.
DOTTED = re.compile(r"(?:hsx|[a-z_]+)(?:\.[A-Za-z_]\w*)+")
# A path in backticks: `api/`, `db/repository/__init__.py`, `tests/unit/`.
PATH = re.compile(r"[\w.]+(?:/[\w.]+)*/?")
FILE_SUFFIXES = (".py", ".md", ".toml", ".json", ".js", ".css", ".html", ".txt")
# Files the tree needs not name: package markers, `python -m` entry points, and Alembic's scripts, which it
# names as a folder (versions/).
UNNAMED = re.compile(r"(^|/)(__init__|__main__)\.py$|^app/hsx/migrations/versions/")


def packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)


def top_level_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py")


def modules() -> list[Path]:
    """Every module and package of app/hsx the tree must name."""
    files = [p for p in PACKAGE.rglob("*.py") if not UNNAMED.search(p.relative_to(ROOT).as_posix())]
    return sorted([*files, *packages()])


def named_by_tree(listed: dict[str, str]) -> set[Path]:
    """The files and folders the tree names: its entries, and what each entry's text names, found inside the
    entry's folder (anywhere below it) or, for an entry that is a module, beside it."""
    named = set()
    for entry, words in listed.items():
        named.add((ROOT / entry.rstrip("/")).resolve())
        folder = ROOT / entry if entry.endswith("/") else (ROOT / entry).parent
        look = folder.rglob if entry.endswith("/") else folder.glob
        for token in NAMED.findall(words):
            named.update(p.resolve() for p in look(token.rstrip("/")))
    return named


def resolves(dotted: str) -> bool:
    """Whether `dotted` is a module of hsx or a name in one (`hsx.cli.COMMANDS`; `db.engine` is hsx.db.engine)."""
    name = dotted if dotted.split(".", 1)[0] == "hsx" else f"hsx.{dotted}"
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                try:
                    obj = importlib.import_module(f"{obj.__name__}.{attr}")  # type: ignore[attr-defined]
                except (ModuleNotFoundError, AttributeError):
                    return False
            else:
                obj = getattr(obj, attr)
        return True
    return False


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


def test_every_module_and_package_is_in_the_tree():
    """Not only the packages: every module (db/repository/preparing.py, backends/engines/vllm.py,
    chat/process.py, storage/fp8.py), so that a module added without a line on the page fails here."""
    named = named_by_tree(entries(tree(PAGE.read_text(encoding="utf-8"))))
    left_out = [p.relative_to(ROOT).as_posix() for p in modules() if p.resolve() not in named]
    assert not left_out, f"{PAGE.relative_to(ROOT)}'s tree leaves out {left_out}"


def test_every_dotted_name_and_path_the_page_names_exists():
    """`hsx.backends.engine.Engine`, `db.engine`, `extraction.exposition`, `api/`, `tests/unit/`: whatever the
    page names in backticks as a module, a name in one, or a path, is there."""
    missing = []
    for code in BACKTICKED.findall(PAGE.read_text(encoding="utf-8")):
        if DOTTED.fullmatch(code) and not code.endswith(FILE_SUFFIXES):
            found = resolves(code)
        elif PATH.fullmatch(code) and "/" in code:
            found = any((base / code).exists() for base in (ROOT, PACKAGE))
        else:
            continue  # a command, a flag, a route, a name in prose
        if not found:
            missing.append(code)
    assert not missing, f"{PAGE.relative_to(ROOT)} names what is not there: {missing}"


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
    named = named_by_tree(listed)
    assert (PACKAGE / "db" / "repository" / "jobs.py").resolve() in named, "named inside the db/ entry"
    assert (PACKAGE / "layers.py").resolve() in named
    assert (PACKAGE / "db" / "models.py").resolve() not in named
    assert (PACKAGE / "cli" / "client" / "jobs.py").resolve() not in named, "a module's entry names only beside it"
    assert resolves("hsx.cli.COMMANDS") and resolves("db.engine") and resolves("reference.__main__")
    assert not resolves("hsx.cli.NOWHERE") and not resolves("db.nowhere")

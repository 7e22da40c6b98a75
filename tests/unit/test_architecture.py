"""docs/architecture.md's map is the rule for imports inside hsx: every `import hsx.…` and `from hsx.… import …`
under app/hsx (at the top of a module, inside a function, under TYPE_CHECKING) is one the map allows; and no
module imports a name another keeps private (`_x`), or a package's private module from outside it.

`python -m tests.unit.test_architecture` prints the imports as they are, package by package."""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "app" / "hsx"
MAP = ROOT / "docs" / "architecture.md"
NONE = {"", "—", "-"}


def read_map(text: str) -> dict[str, set[str]]:
    """The map's rows, package (or module) -> what it may import, from the table whose header names
    `package` and `may import`."""
    rows: dict[str, set[str]] = {}
    columns: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            columns = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if columns is None:
            columns = cells
            continue
        if "package" not in columns or "may import" not in columns or set(line) <= set("|-: "):
            continue
        name = _plain(cells[columns.index("package")])
        allowed = cells[columns.index("may import")]
        assert name not in rows, f"{MAP.name}: two rows for {name}"
        rows[name] = {_plain(a) for a in allowed.split(",") if _plain(a) not in NONE}
    assert rows, f"{MAP.name} has no table with the columns `package` and `may import`"
    return rows


def _plain(cell: str) -> str:
    return cell.replace("`", "").replace("\\", "").strip()


def module_of(path: Path) -> str:
    """The module's name inside hsx (`api.jobs`, `db.repository`); `hsx` for the package's own __init__."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or "hsx"


def _is_module(name: str) -> bool:
    path = PACKAGE.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # inside hsx: `db.repository`, `wire`; "" for a relative import


def imports_of(source: str) -> list[Import]:
    """Every import of an hsx module in `source`, wherever it stands; `from hsx.x import y` names the
    module x.y when y is one, else x."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.append(Import(node.lineno, ""))
            continue
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [_submodule_or(node.module, a.name) for a in node.names]
        else:
            continue
        found += [Import(node.lineno, n.removeprefix("hsx").lstrip(".") or "hsx") for n in names if _in_hsx(n)]
    return found


def _in_hsx(name: str) -> bool:
    return name == "hsx" or name.startswith("hsx.")


def _submodule_or(module: str, name: str) -> str:
    inner = f"{module}.{name}"
    return inner if _in_hsx(inner) and _is_module(inner.removeprefix("hsx.")) else module


def allowed(rules: dict[str, set[str]], module: str, target: str) -> bool:
    """Whether `module` may import `target`: its own package, or what its package's row and the rows of
    the modules it lies in list."""
    own = module.split(".", maxsplit=1)[0]
    if target.split(".", maxsplit=1)[0] == own and module != "hsx":
        return True
    parts = module.split(".")
    entries = set().union(*(rules.get(".".join(parts[:n]), set()) for n in range(1, len(parts) + 1)))
    return any(target == e or target.startswith(e + ".") for e in entries)


def violations(rules: dict[str, set[str]], path: Path, source: str) -> list[str]:
    where, module = path.relative_to(ROOT), module_of(path)
    package = module.split(".")[0]
    if package not in rules:
        return [f"{where}: {package} has no row in {MAP.relative_to(ROOT)}"]
    out = []
    for imp in imports_of(source):
        if not imp.target:
            out.append(f"{where}:{imp.line}: a relative import; write it as hsx.… so that the map can check it")
        elif not allowed(rules, module, imp.target):
            why = f"which the map does not allow {package} to import"
            out.append(f"{where}:{imp.line}: {module} imports hsx.{imp.target}, {why}")
    return out


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_import_is_one_the_map_allows():
    rules = read_map(MAP.read_text())
    found = [v for path in sources() for v in violations(rules, path, path.read_text())]
    assert not found, "\n".join(found)


def test_every_row_names_a_package_or_module_that_exists():
    rules = read_map(MAP.read_text())
    named = set(rules) | {e for entries in rules.values() for e in entries}
    missing = sorted(n for n in named if n != "hsx" and not _is_module(n))
    assert not missing, f"{MAP.relative_to(ROOT)} names what app/hsx does not hold: {missing}"


def test_a_route_that_reaches_past_the_service_is_caught():
    rules = read_map(MAP.read_text())
    route = PACKAGE / "api" / "jobs.py"
    source = "def page(session):\n    from hsx.db import repository as repo\n    return repo.list_jobs(session)\n"
    assert violations(rules, route, source) == [
        "app/hsx/api/jobs.py:2: api.jobs imports hsx.db.repository, which the map does not allow api to import"
    ]
    for source in (
        "import hsx.db.repository\n",
        "from hsx.db.repository import reads\n",
        "from hsx.db.models import JobRow\n",
    ):
        assert violations(rules, route, source), source
    assert not violations(rules, PACKAGE / "api" / "app.py", "from hsx.db.engine import make_engine\n")
    assert not violations(rules, PACKAGE / "service" / "queries.py", "from hsx.db import repository\n")


def test_the_wire_models_stand_on_the_bottom_floor():
    """`api`, `service` and `sdk` share hsx.wire; none of them reaches into another for a body's model."""
    rules = read_map(MAP.read_text())
    assert rules["wire"] <= {"states", "names", "layers", "dtypes", "sources", "lengths"}  # floor 0, as wire is
    assert "api" not in rules["sdk"] and "api" not in rules["service"]


def private_imports(path: Path, source: str) -> list[str]:
    """Imports of a private name (`_x`) from another module, and of a private module (`_base`, `_core`)
    from outside its package: what modules share is public in its module, or in its package's `_base`."""
    module, out = module_of(path), []
    name = module if module == "hsx" else f"hsx.{module}"
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ImportFrom) and node.module and _in_hsx(node.module)):
            continue
        where = f"{path.relative_to(ROOT)}:{node.lineno}"
        private = [a.name for a in node.names if a.name.startswith("_")]
        if private:
            out.append(f"{where}: imports {', '.join(private)} from {node.module}")
        parts = node.module.split(".")
        for n, part in enumerate(parts):
            outside = not f"{name}.".startswith(".".join(parts[:n]) + ".")
            if part.startswith("_") and outside:
                out.append(f"{where}: imports {node.module}, private to {'.'.join(parts[:n])}")
    return out


def test_no_module_imports_what_another_keeps_private():
    found = [v for path in sources() for v in private_imports(path, path.read_text())]
    assert not found, "\n".join(found)


def test_a_private_import_is_caught():
    cli = PACKAGE / "cli" / "client" / "manifest.py"
    assert private_imports(cli, "from hsx.sdk._core import write_atomic\n") == [
        "app/hsx/cli/client/manifest.py:1: imports hsx.sdk._core, private to hsx.sdk"
    ]
    jobs = PACKAGE / "db" / "repository" / "jobs.py"
    assert private_imports(jobs, "from hsx.db.repository.transitions import _transition\n") == [
        "app/hsx/db/repository/jobs.py:1: imports _transition from hsx.db.repository.transitions"
    ]
    assert not private_imports(jobs, "from hsx.db.repository._base import rowcount\n")


def _graph(rules: dict[str, set[str]]) -> dict[str, set[str]]:
    """What each row's package (or module) imports outside its own package, as the sources have it."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sources():
        module = module_of(path)
        parts = module.split(".")
        row = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in rules), parts[0])
        graph[row] |= {
            i.target for i in imports_of(path.read_text()) if i.target.split(".")[0] != parts[0] or row == "hsx"
        }
    return graph


if __name__ == "__main__":
    rules = read_map(MAP.read_text())
    for row, targets in sorted(_graph(rules).items()):
        print(f"{row} imports {', '.join(sorted(targets)) or '—'}")
        may = "also may import" if "." in row else "may import"
        print(f"{'':{len(row)}} {may} {', '.join(sorted(rules.get(row, set()))) or '—'}")

"""The engines behind one interface: hsx.sources.Source is the one registry, each of its members names an
Engine of its own module under hsx/backends/engines, what takes a source (settings, `--source`, the API)
takes the registry's, and no code outside the engines tells engines apart by name."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from hsx import backends
from hsx.backends.dumps import DumpRoot
from hsx.backends.engine import PROBE_IDS, Capture, Engine, Look, Server
from hsx.backends.engines.vllm import VLLM_INFO_FILE, VLLMEngine
from hsx.backends.http import BackendUnavailable
from hsx.cli import build_parser
from hsx.config import Settings
from hsx.sources import AUTO, Source, source_label
from hsx.wire import WorkerOut

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "app" / "hsx"
ENGINES = PACKAGE / "backends" / "engines"
REGISTRY = PACKAGE / "sources.py"
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens there


def server(tmp_path: Path) -> Server:
    return Server(CLOSED, DumpRoot(tmp_path / "dumps"), tmp_path / "staging", timeout_s=2.0)


@pytest.mark.parametrize("source", list(Source), ids=str)
def test_each_registered_engine_is_an_engine_of_its_own_module(source):
    cls = backends.engine_class(source)
    assert issubclass(cls, Engine) and cls.source is source
    assert cls.__module__.startswith("hsx.backends.engines."), "an engine lives in a module of hsx/backends/engines"
    assert source.description, "the registry says what each engine is (hsx serve --help)"
    assert source.label and source_label(source.value) == source.label, "and names it for people in messages"


def test_every_engine_module_is_registered():
    modules = {f"hsx.backends.engines.{p.stem}" for p in ENGINES.glob("*.py") if p.stem != "__init__"}
    assert modules == {backends.engine_class(s).__module__ for s in Source}


def test_auto_tries_every_engine_in_the_registrys_order():
    assert backends.engines_for(AUTO) == [backends.engine_class(s) for s in Source]
    assert backends.engines_for(Source.VLLM) == [VLLMEngine]


def test_settings_cli_and_api_take_the_registrys_sources(monkeypatch):
    assert Settings().source == AUTO
    for source in Source:
        assert Settings(source=source.value).source is source
        monkeypatch.setenv("HSX_SOURCE", source.value)
        assert Settings().source is source
    with pytest.raises(ValueError, match=f"must be one of {AUTO}, {', '.join(Source)}"):
        Settings(source="trtllm")
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flag = next(a for a in serve._actions if a.dest == "source")
    assert flag.choices == [AUTO, *(s.value for s in Source)]
    assert all(s.value in (flag.help or "") for s in Source)
    schema = WorkerOut.model_json_schema()["$defs"]["Source"]
    assert schema["enum"] == [s.value for s in Source]


def test_vllm_is_taken_by_auto_only_where_its_connector_wrote_its_file(tmp_path):
    s = server(tmp_path)
    s.root.path.mkdir(parents=True)
    assert VLLMEngine.discover(Look(s, auto=True, after_outage=False)) is None, "no file: not vLLM, no request"
    with pytest.raises(BackendUnavailable):
        VLLMEngine.discover(Look(s, auto=False, after_outage=False))
    (s.root.path / VLLM_INFO_FILE).write_text('{"format": "hsx-vllm/1"}')
    with pytest.raises(BackendUnavailable):
        VLLMEngine.discover(Look(s, auto=True, after_outage=False))
    with pytest.raises(BackendUnavailable):
        backends.discover(s, AUTO)
    s.close()


def test_a_restart_is_a_new_boot_id(tmp_path):
    s = server(tmp_path)

    def engine(boot_id: str | None) -> Engine:
        capture = Capture(layers=[2], model={}, layers_from="test", boot_id=boot_id)
        return VLLMEngine(s, capture, model="m")

    assert engine("b").restarted(engine("a"))
    assert not engine("a").restarted(engine("a"))
    assert not engine("a").restarted(engine(None)) and not engine(None).restarted(engine("a")), "unknown: no restart"
    s.close()


def test_a_look_reads_what_engines_share_once():
    look = Look(server=None, auto=True, after_outage=False)  # type: ignore[arg-type]
    reads: list[int] = []
    assert look.once("info", lambda: reads.append(1) or "said") == "said"
    assert look.once("info", lambda: reads.append(2) or "again") == "said"
    assert reads == [1]


# --- no engine told apart by name outside the engines -------------------------------------------------------


def engine_code(path: Path) -> bool:
    """The engines' own modules and the registry: the only places that may name an engine."""
    return path == REGISTRY or ENGINES in path.parents


def names_an_engine(node: ast.AST) -> str | None:
    """What in `node` names an engine: a source (`x.source`, `source`), a member of Source, or an engine's value."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Attribute) and inner.attr == "source":
            return f"{ast.unparse(inner)}"
        if isinstance(inner, ast.Name) and inner.id == "source":
            return "source"
        if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == "Source":
            return ast.unparse(inner)
        if isinstance(inner, ast.Constant) and inner.value in {s.value for s in Source}:
            return repr(inner.value)
    return None


def engine_branches(path: Path, source: str) -> list[str]:
    """Each comparison or match on an engine's name in `source`, and each import of an engine's module
    (the registry loads them by name), as file:line: what."""
    where = path.relative_to(ROOT)
    out = []
    for node in ast.walk(ast.parse(source)):
        tested = None
        if isinstance(node, ast.Compare):
            tested = node
        elif isinstance(node, ast.Match):
            tested = node.subject
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Source":
            out.append(f"{where}:{node.lineno}: names {ast.unparse(node)}")
            continue
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hsx.backends.engines"):
            out.append(f"{where}:{node.lineno}: imports {node.module}")
            continue
        if tested is not None and (named := names_an_engine(tested)) is not None:
            out.append(f"{where}:{node.lineno}: compares {named}: {ast.unparse(node)[:80]}")
    return out


def test_no_code_outside_the_engines_tells_engines_apart():
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if not engine_code(path)
        for hit in engine_branches(path, path.read_text(encoding="utf-8"))
    ]
    assert not found, "\n".join(found)


def test_the_scan_sees_a_branch_on_an_engine():
    loop = PACKAGE / "extraction" / "request_loop.py"
    cases = {
        'if engine.source == "vllm":\n    pass\n': "compares engine.source",
        "if capture.source in (Source.DUMPS, Source.VLLM):\n    pass\n": "compares capture.source",
        'named = kind == "dumps"\n': "compares 'dumps'",
        "match settings.source:\n    case _:\n        pass\n": "compares settings.source",
        "from hsx.backends.engines.vllm import VLLMEngine\n": "imports hsx.backends.engines.vllm",
    }
    for code, what in cases.items():
        assert any(what in hit for hit in engine_branches(loop, code)), code
    assert not engine_branches(loop, "if engine.concurrent:\n    pass\n")


def test_the_settings_reference_offers_every_engine():
    """docs/operations.md's `--source` row names every choice the registry gives."""
    operations = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    row = next(line for line in operations.splitlines() if line.startswith("| `--source`"))
    assert {f"`{s.value}`" for s in Source} | {f"`{AUTO}`"} <= set(re.findall(r"`[^`]+`", row))


def test_the_probe_is_long_enough_for_a_fresh_bfloat16_vllm_on_the_cpu():
    """vLLM 0.32's CPU build lost its worker to SIGILL when a 4-token prompt was its first request in bfloat16,
    and took 16 (tests/acceptance/test_real_vllm_bf16.py runs it): the probe is often a server's first request."""
    assert len(PROBE_IDS) >= 16 and max(PROBE_IDS) < 32, "ids every vocabulary has"

"""The encodings behind one interface: hsx.storage.encoding.ENCODINGS holds one Encoding per module of
hsx/storage/encoding, under the names the API takes (hsx.dtypes.ENCODINGS), each owning its tensors, specs,
manifest layout, bytes per row, encoder and decoder; and no code outside hsx.storage tells encodings apart by
name (an AST scan, as tests/unit/test_engines.py makes for engines)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hsx import dtypes
from hsx.dtypes import DTYPES
from hsx.manifest import SHARD_LAYOUT, shard_layout
from hsx.storage.encoding import ENCODINGS, Encoding, encoding_of
from hsx.wire import JobOptions

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "app" / "hsx"
STORAGE = PACKAGE / "storage"
ENCODING_MODULES = STORAGE / "encoding"


def test_the_registry_holds_the_names_the_api_takes_in_their_order():
    assert tuple(ENCODINGS) == dtypes.ENCODINGS
    assert JobOptions.model_json_schema()["properties"]["encoding"]["enum"] == list(ENCODINGS)
    assert all(isinstance(e, Encoding) and e.name == name for name, e in ENCODINGS.items())


def test_each_encoding_is_a_module_of_its_own_and_every_module_is_registered():
    modules = {p.stem for p in ENCODING_MODULES.glob("*.py")} - {"__init__", "base"}
    assert modules == {type(e).__module__.rsplit(".", 1)[1] for e in ENCODINGS.values()}
    assert modules == set(ENCODINGS)


def test_an_unknown_encoding_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown encoding 'zstd'; one of raw, lossless, fp8"):
        encoding_of("zstd")


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_each_encoding_owns_its_layout_tensors_specs_and_bytes(name):
    encoding, bf16 = ENCODINGS[name], DTYPES["bfloat16"]
    names = encoding.tensor_names("layer_3")
    assert list(encoding.specs("layer_3", 7, bf16, 64)) == names
    assert set(shard_layout(name)) == {k for k in SHARD_LAYOUT if k != "layer_<i>"} | set(
        encoding.tensor_names("layer_<i>")
    )
    assert 0 < encoding.stored_row_bytes(bf16, 64) <= 128
    if encoding.encoded:
        enc = encoding.encoder("layer_3", bf16, 64)
        assert [t[0] for t in enc.tensors()] == names
        assert encoding.metadata(bf16, 64) == {"encoding": name, "dtype": "bfloat16", "hidden_size": "64"}
    else:
        with pytest.raises(ValueError, match="through no encoder"):
            encoding.encoder("layer_3", bf16, 64)
        assert encoding.metadata(bf16, 64) == {}


# --- no encoding told apart by name outside hsx.storage ---------------------------------------------------


def names_an_encoding(node: ast.AST) -> str | None:
    """What in `node` names an encoding: an encoding's name as a string, or a value called `encoding`."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Constant) and inner.value in dtypes.ENCODINGS:
            return repr(inner.value)
        if isinstance(inner, ast.Attribute) and inner.attr == "encoding":
            return ast.unparse(inner)
        if isinstance(inner, ast.Name) and inner.id == "encoding":
            return inner.id
    return None


def encoding_branches(path: Path, source: str) -> list[str]:
    """Each comparison or match on an encoding's name in `source`, as file:line: what."""
    where = path.relative_to(ROOT)
    out = []
    for node in ast.walk(ast.parse(source)):
        tested = node if isinstance(node, ast.Compare) else node.subject if isinstance(node, ast.Match) else None
        if tested is not None and (named := names_an_encoding(tested)) is not None:
            out.append(f"{where}:{node.lineno}: compares {named}: {ast.unparse(node)[:80]}")
    return out


def test_no_code_outside_storage_tells_encodings_apart():
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if STORAGE not in path.parents
        for hit in encoding_branches(path, path.read_text(encoding="utf-8"))
    ]
    assert not found, "\n".join(found)


def test_the_scan_sees_a_branch_on_an_encoding():
    reader = PACKAGE / "training" / "reader.py"
    cases = {
        'if metadata.get("encoding", "raw") != "raw":\n    pass\n': "compares 'raw'",
        "if job.manifest.encoding == name:\n    pass\n": "compares job.manifest.encoding",
        'lossy = kind in ("fp8", "int8")\n': "compares 'fp8'",
        "match encoding:\n    case _:\n        pass\n": "compares encoding",
    }
    for code, what in cases.items():
        assert any(what in hit for hit in encoding_branches(reader, code)), code
    assert not encoding_branches(reader, "if encoding_of(name).encoded:\n    pass\n")

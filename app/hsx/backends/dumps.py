"""The dump root: clear it, find our completed dump, move it out, validate it.

Every check in shared "what a reader must check" lives here but one: that every value is finite,
which writing the shard checks as it copies the values (hsx.storage.shards). Anything that fails
a check is a DumpRejected with a short machine-readable code and a human reason, never a stored
sample.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from hsx.dtypes import DTYPES, DTYPES_BY_CODE, HIDDEN_STATE_DTYPES
from hsx.identity import Identity
from hsx.layers import layer_key
from hsx.storage.safetensors_raw import SafetensorsFormatError, TensorSpan, encode_header, read_index

REQUIRED_META = ("num_tokens", "layers", "hidden_size", "dtype")


@dataclass(frozen=True)
class LoadedTensor:
    """A layer read from the `.pt` file of an older server's dump: its safetensors dtype code, shape and raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


# The codes of a request the server answered whose dump never came: the sample's fault only while the
# server that answered is still the one running (a server killed after its reply loses the dump with it).
NEVER_CAME = frozenset({"no_dump", "incomplete", "dump_timeout"})


class DumpRejected(Exception):
    def __init__(self, code: str, reason: str):
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason

    @property
    def never_came(self) -> bool:
        return self.code in NEVER_CAME


class DumpRootBusy(Exception):
    """Another process already writes through this dump root."""


def ids_sha256(input_ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(input_ids, dtype="<i8").tobytes()).hexdigest()


@dataclass
class Dump:
    """A validated dump, moved out of the root: its meta and each layer's raw bytes."""

    path: Path
    meta: dict[str, Any]
    layers: dict[int, TensorSpan | bytes]
    key: str | None = None  # the directory name the server wrote, e.g. req_17
    identity: Identity | None = None  # what proved it is the sample's (hsx.identity)

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes if isinstance(s, TensorSpan) else len(s) for s in self.layers.values())


class DumpRoot:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock_fd: int | None = None

    def acquire(self) -> None:
        """Take the file-system half of the single-writer rule: an exclusive lock on the root."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise DumpRootBusy(
                    f"dump root {self.path} is locked by another process; only one writer may use a dump root"
                ) from exc
            raise
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def entries(self) -> list[Path]:
        try:
            # A symlink is never a dump: following one could read or delete outside the root.
            return [p for p in self.path.iterdir() if p.name.startswith("req_") and p.is_dir() and not p.is_symlink()]
        except FileNotFoundError:
            return []

    def files(self, pattern: str) -> list[Path]:
        """Plain files of the root matching `pattern` (vLLM's hidden-states files and their locks)."""
        return [p for p in self.path.glob(pattern) if p.is_file() and not p.is_symlink()]

    def clear(self) -> None:
        for p in self.path.glob("req_*"):
            if p.is_symlink():
                p.unlink(missing_ok=True)
            elif p.is_dir():
                shutil.rmtree(p, ignore_errors=True)

    def completed(self) -> list[Path]:
        return [p for p in self.entries() if (p / "done").exists()]

    def rid_dir(self, rid: str) -> Path:
        return self.path / f"req_{rid}"


def read_meta(d: Path) -> dict[str, Any]:
    if not (d / "done").exists():
        raise DumpRejected("incomplete", f"{d.name} has no done marker")
    try:
        meta = json.loads((d / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DumpRejected("bad_meta", f"{d.name}/meta.json unreadable: {exc}") from exc
    if not isinstance(meta, dict):
        raise DumpRejected("bad_meta", f"{d.name}/meta.json is not an object")
    check_meta_fields(d.name, meta)
    return meta


def check_meta_fields(name: str, meta: dict[str, Any]) -> None:
    """Required fields present and of the right JSON type, layers distinct and ascending, or
    DumpRejected("bad_meta")."""
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise DumpRejected("bad_meta", f"{name}/meta.json lacks {', '.join(missing)}")
    wrong = [
        k
        for k, ok in (
            ("num_tokens", _count(meta["num_tokens"])),
            ("hidden_size", _count(meta["hidden_size"]) and meta["hidden_size"] > 0),
            ("layers", isinstance(meta["layers"], list) and meta["layers"] and all(_count(i) for i in meta["layers"])),
            ("dtype", isinstance(meta["dtype"], str)),
            ("cached_tokens", meta.get("cached_tokens") is None or _count(meta["cached_tokens"])),
            ("input_ids_sha256", meta.get("input_ids_sha256") is None or isinstance(meta["input_ids_sha256"], str)),
        )
        if not ok
    ]
    if wrong:
        raise DumpRejected("bad_meta", f"{name}/meta.json has malformed {', '.join(wrong)}")
    layers = meta["layers"]
    if layers != sorted(set(layers)):
        # A layer listed twice would be two tensors of one name in the shard, which no reader opens.
        raise DumpRejected(
            "bad_meta", f"{name}/meta.json lists layers {layers}: each captured layer must appear once, ascending"
        )


def _count(v: object) -> bool:
    """A non-negative JSON integer (bool is an int in Python, not in JSON)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _dump_ids(d: Path) -> list[int] | None:
    f = d / "input_ids.safetensors"
    if not f.exists():
        return None
    try:
        with safe_open(str(f), framework="numpy") as st:
            return st.get_tensor("input_ids").astype(np.int64).tolist()
    except Exception as exc:  # any unreadable file is a rejected dump, whatever the library raised
        raise DumpRejected("bad_input_ids", f"{d.name}/input_ids.safetensors unreadable: {exc}") from exc


def identify(d: Path, meta: dict[str, Any], input_ids: list[int], rid: str) -> Identity:
    """How this dump proves it is the one for `input_ids`, sent with `rid`: by its ids, its rid, or
    only by its token count (hsx.identity). DumpRejected("not_ours") when anything it carries says
    it is another request's."""
    if meta.get("num_tokens") != len(input_ids):
        raise DumpRejected("not_ours", f"{d.name}: num_tokens {meta.get('num_tokens')} != expected {len(input_ids)}")
    proof = Identity.COUNT
    sha = meta.get("input_ids_sha256")
    if sha is not None:
        if sha.lower() != ids_sha256(input_ids):
            raise DumpRejected("not_ours", f"{d.name}: input_ids_sha256 differs from the sample's ids")
        proof = Identity.IDS
    ids = _dump_ids(d)
    if ids is not None:
        if ids != input_ids:
            raise DumpRejected("not_ours", f"{d.name}: input_ids differ from the sample's ids")
        proof = Identity.IDS
    dump_rid = meta.get("rid")
    if dump_rid is not None:
        # Even with equal ids: another client may send the same prompt, and its dump is not ours.
        if dump_rid != rid:
            raise DumpRejected("not_ours", f"{d.name}: rid {str(dump_rid)[:100]!r} is not this request's {rid!r}")
        if proof == Identity.COUNT:
            proof = Identity.RID
    return proof


def move_out(d: Path, dest: Path) -> Path:
    """Take the dump out of the root (a rename on the same file system) so the root is clear."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        shutil.rmtree(dest)
    try:
        os.rename(d, dest)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        shutil.move(str(d), str(dest))
    return dest


def _layer_sources(d: Path, meta: dict[str, Any]) -> dict[int, TensorSpan | LoadedTensor]:
    layers = [int(i) for i in meta["layers"]]
    st_file = d / "hidden_states.safetensors"
    if st_file.exists():
        try:
            index = read_index(st_file)
        except SafetensorsFormatError as exc:
            raise DumpRejected("bad_tensor_file", str(exc)) from exc
        out: dict[int, TensorSpan | LoadedTensor] = {}
        for i in layers:
            if f"layer_{i}" not in index:
                raise DumpRejected("missing_layer", f"layer_{i} is not in hidden_states.safetensors")
            out[i] = index[f"layer_{i}"]
        return out
    # Older servers dump one torch.save'd tensor per layer; never unpickle anything but tensors.
    import torch  # only these dumps need it; the service otherwise runs without loading torch

    out = {}
    for i in layers:
        f = d / f"layer_{i}.pt"
        if not f.exists():
            raise DumpRejected("missing_layer", f"neither hidden_states.safetensors nor layer_{i}.pt exists")
        try:
            t = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:  # truncated or hostile pickle: both are a rejected dump
            raise DumpRejected("bad_tensor_file", f"layer_{i}.pt unreadable: {exc}") from exc
        if not isinstance(t, torch.Tensor):
            raise DumpRejected("bad_tensor_file", f"layer_{i}.pt holds {type(t).__name__}, not a tensor")
        name = str(t.dtype).removeprefix("torch.")
        code = DTYPES[name].code if name in DTYPES else str(t.dtype)
        out[i] = LoadedTensor(code, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


def validate(
    d: Path,
    meta: dict[str, Any],
    *,
    expect_layers: list[int] | None = None,
    expect_hidden: int | None = None,
    expect_dtype: str | None = None,
) -> Dump:
    """Check shapes, dtypes and cache use; return the dump with byte sources.

    Reading every value for NaN and Inf is left to write_shard, which reads each byte
    anyway (hsx.storage.shards): a check here would read the whole dump a second time on the
    request path, while the model server waits for our next request."""
    check_meta_fields(d.name, meta)
    if int(meta.get("cached_tokens") or 0) != 0:
        raise DumpRejected("cached_tokens", f"{meta['cached_tokens']} prompt tokens came from the prefix cache")
    n, hidden, dtype = int(meta["num_tokens"]), int(meta["hidden_size"]), str(meta["dtype"])
    if dtype not in HIDDEN_STATE_DTYPES:
        raise DumpRejected("wrong_dtype", f"meta dtype {dtype!r} is not bfloat16, float16 or float32")
    layers = [int(i) for i in meta["layers"]]
    # A server may capture more than a job asks for (keep_layers then keeps only the job's), never less.
    if expect_layers is not None and not set(expect_layers) <= set(layers):
        missing = sorted(set(expect_layers) - set(layers))
        raise DumpRejected(
            "wrong_layers", f"dump captured layers {layers}, expected {list(expect_layers)} (without {missing})"
        )
    if expect_hidden is not None and hidden != expect_hidden:
        raise DumpRejected("wrong_shape", f"hidden_size {hidden} != {expect_hidden}")
    if expect_dtype is not None and dtype != expect_dtype:
        raise DumpRejected("wrong_dtype", f"dtype {dtype} != {expect_dtype}")
    checked: dict[int, TensorSpan | bytes] = {}
    for i, src in _layer_sources(d, meta).items():
        actual = DTYPES_BY_CODE[src.dtype].name if src.dtype in DTYPES_BY_CODE else src.dtype
        if actual != dtype:
            raise DumpRejected("wrong_dtype", f"layer_{i} is {actual}, meta says {dtype}")
        if tuple(src.shape) != (n, hidden):
            raise DumpRejected("wrong_shape", f"layer_{i} has shape {list(src.shape)}, expected [{n}, {hidden}]")
        checked[i] = _raw(src)
    return Dump(d, meta, checked)


def _raw(src: TensorSpan | LoadedTensor) -> TensorSpan | bytes:
    """What write_shard copies: a span of the dump's file, or an old dump's loaded bytes."""
    return src if isinstance(src, TensorSpan) else src.data


def load_staged(d: Path) -> Dump:
    """Reopen a dump that was validated and staged earlier (possibly before a restart)."""
    meta = read_meta(d)
    sources = _layer_sources(d, meta)
    return Dump(d, meta, {i: _raw(src) for i, src in sources.items()})


def keep_layers(dump: Dump, layers: list[int]) -> Dump:
    """The staged dump holding only `layers` (each among its own) as far as every reader of it knows: its
    meta.json lists them, which is all the shard flusher and a restart's `load_staged` read (the other
    layers' bytes stay in its file until the dump is removed with its shard)."""
    if [int(i) for i in dump.meta["layers"]] == list(layers):
        return dump
    meta = {**dump.meta, "layers": list(layers)}
    write_meta(dump.path, meta)
    return Dump(dump.path, meta, {i: dump.layers[i] for i in layers}, dump.key, dump.identity)


def write_meta(d: Path, meta: dict[str, Any]) -> None:
    """A staged dump's meta.json replaced whole (a temporary file renamed over it)."""
    tmp = d / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
    os.replace(tmp, d / "meta.json")


def write_dump(dest: Path, meta: dict[str, Any], blocks: list[np.ndarray]) -> None:
    """A dump directory of hsx's own making (rows taken from an answer or a server's file): one
    `[tokens, hidden]` tensor per layer of `meta["layers"]`, each block the contiguous bits of
    `meta["dtype"]`, and `done` last; an earlier attempt's leftovers are replaced."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    code = DTYPES[meta["dtype"]].code
    header = encode_header([(layer_key(i), code, b.shape) for i, b in zip(meta["layers"], blocks)], {})
    fd = os.open(dest / "hidden_states.safetensors", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(header)
        for block in blocks:
            f.write(block.data)  # contiguous: written without a copy
    (dest / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    (dest / "done").touch()


def stage_dump(
    dest: Path,
    meta: dict[str, Any],
    blocks: list[np.ndarray],
    identity: Identity,
    *,
    expect_layers: list[int] | None,
    expect_hidden: int | None,
    expect_dtype: str | None,
) -> Dump:
    """write_dump, then validate what was written as any dump is; the dump carries `identity`, and
    nothing is left at `dest` when either step fails."""
    try:
        write_dump(dest, meta, blocks)
        dump = validate(dest, meta, expect_layers=expect_layers, expect_hidden=expect_hidden, expect_dtype=expect_dtype)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    dump.identity = identity
    return dump

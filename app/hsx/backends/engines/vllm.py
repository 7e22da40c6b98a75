"""vLLM's extract_hidden_states path: one sample is one `POST /v1/completions`, its hidden states a
file vLLM writes and names in the answer.

vLLM started with `--speculative-config '{"method": "extract_hidden_states", ...}'` and hsx's KV
connector (deploy/vllm: vLLM's own connector, made to work on a CPU-only host too) writes, for each
request, `<dump root>/<vLLM's request id>.safetensors` with `hidden_states` `[tokens, layers, hidden]`
and the prompt's `token_ids`, and answers the path in `kv_transfer_params.hidden_states_path`. The
answer can come before the file is whole: vLLM's writer holds `<path>.lock` while it writes, so the
file is read under a shared lock on it. The connector also writes `hsx-vllm.json` into the root at
start-up: the layers it captures, the model, and a boot id.

Identity is proven, never assumed: the path must lie in the dump root and carry the request id hsx
chose (`X-Request-Id`), and the file's token ids must be the sample's, every one. The rows are staged
as a dump directory like any other, one tensor per layer, so the rest of the writer cannot tell where
they came from; the file and its lock are removed once they are.

Layer numbers: vLLM's layer k is the residual stream after k decoder layers, as hsx numbers layers,
but its layer L (the model's layer count) is taken *before* the final norm, where hsx's other sources
give it after; the job's model info says so (`final_layer: pre_norm`), and so does its manifest.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from hsx.backends.dumps import Dump, DumpRejected, ids_sha256, stage_dump
from hsx.backends.engine import Capture, CaptureProblem, Engine, Expectation, Limits, Look, Server, count
from hsx.backends.http import BackendRejected, HttpBackend
from hsx.backends.model import describe_model
from hsx.dtypes import DTYPES_BY_CODE, HIDDEN_STATE_DTYPES
from hsx.identity import Identity
from hsx.sources import Source
from hsx.storage.safetensors_raw import SafetensorsFormatError, TensorSpan, read_index

VLLM_INFO_FILE = "hsx-vllm.json"
VLLM_INFO_FORMAT = "hsx-vllm/1"
LOCK_POLL_S = 0.005


class VLLMClient(HttpBackend):
    """The part of vLLM's OpenAI-compatible server that extraction uses."""

    def model(self) -> tuple[str, int | None]:
        """The name requests must give (the one model the server serves) and its context length
        (max_model_len: prompt and generated tokens together; None when the answer does not say)."""
        data = self._request("GET", "/v1/models").json().get("data") or []
        if not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
            raise BackendRejected(f"GET /v1/models: no model in the answer: {str(data)[:200]}")
        length = data[0].get("max_model_len")
        return str(data[0]["id"]), length if isinstance(length, int) and not isinstance(length, bool) else None

    def complete(self, input_ids: list[int], request_id: str, model: str) -> dict[str, Any]:
        """The prompt and one new token; the answer names the file holding the prompt's hidden states."""
        body = {"model": model, "prompt": input_ids, "max_tokens": 1}
        answer = self._request("POST", "/v1/completions", json=body, headers={"X-Request-Id": request_id}).json()
        if not isinstance(answer, dict):
            raise BackendRejected(f"POST /v1/completions: the answer is not an object: {str(answer)[:200]}")
        return answer


def read_vllm_info(dump_root: Path) -> dict[str, Any] | None:
    """hsx-vllm.json from the dump root, or None when there is none (or it is not that format)."""
    try:
        info = json.loads((Path(dump_root) / VLLM_INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("format") == VLLM_INFO_FORMAT else None


def vllm_capture(info: dict[str, Any] | None, dump_root: Path) -> Capture:
    """The capture hsx-vllm.json describes, with the model as a manifest records it (its layer L before
    the final norm: `final_layer` pre_norm). CaptureProblem when there is no usable file."""
    if info is None:
        raise CaptureProblem(
            f"no {VLLM_INFO_FILE} in the dump root ({dump_root}): start vLLM with hsx's connector and its "
            "shared_storage_path set to the dump root (deploy/vllm/README.md)"
        )
    layers, num_layers, hidden, dtype = (info.get(k) for k in ("layers", "num_hidden_layers", "hidden_size", "dtype"))
    if not (isinstance(layers, list) and layers and all(isinstance(i, int) and i >= 0 for i in layers)):
        raise CaptureProblem(f"{VLLM_INFO_FILE} gives no layer list: {layers!r}")
    if not (isinstance(num_layers, int) and isinstance(hidden, int)) or dtype not in HIDDEN_STATE_DTYPES:
        raise CaptureProblem(f"{VLLM_INFO_FILE} does not give the model's layer count, hidden size and dtype")
    model = {"model_path": info.get("model_path"), "num_hidden_layers": num_layers, "hidden_size": hidden}
    return Capture(
        layers=sorted(set(layers)),  # vLLM writes its layers in ascending order, each once
        model={**describe_model(model, {}), "final_layer": "pre_norm"},
        layers_from=f"vLLM's hidden-states files ({VLLM_INFO_FILE})",
        hidden_size=hidden,
        dtype=dtype,
        boot_id=info.get("boot_id"),
        identity=Identity.IDS,
    )


class VLLMEngine(Engine):
    source = Source.VLLM

    def __init__(self, server: Server, capture: Capture, *, model: str):
        if capture.layers is None:
            raise ValueError("a vLLM capture needs its layers")
        super().__init__(server, capture)
        self.client = server.client(VLLMClient)
        self.root = server.root.path.resolve()
        self.layers: list[int] = capture.layers
        self.model = model  # the name requests must give

    @classmethod
    def discover(cls, look: Look) -> VLLMEngine | None:
        """What hsx's connector wrote into the dump root; with auto, None when it wrote nothing there."""
        root = look.server.root.path
        info = read_vllm_info(root)
        if look.auto and info is None:
            return None
        client = look.server.client(VLLMClient)
        client.health()
        model, _ = client.model()
        return cls(look.server, vllm_capture(read_vllm_info(root), root), model=model)

    @classmethod
    def limits(cls, server: Server) -> Limits | None:
        """Its context length less the one token each request generates, and the vocabulary of the model
        hsx-vllm.json names (from its config.json, where that is readable here); None without that file."""
        info = read_vllm_info(server.root.path)
        if info is None:
            return None
        _, context = server.client(VLLMClient).model()
        capture = vllm_capture(info, server.root.path)
        return Limits(
            vocab_size=count(capture.model.get("vocab_size")),
            max_tokens=context - 1 if context else None,
            layers=capture.layers,
            hidden_size=capture.hidden_size,
            dtype=capture.dtype,
        )

    def leftovers(self) -> list[Path]:
        return self.server.root.files("cmpl-*")

    def extract(self, input_ids: list[int], *, rid: str, staged_name: str, expect: Expectation) -> Dump:
        answer = self.client.complete(input_ids, rid, self.model)
        path = self._named_file(answer, rid)
        try:
            prompt_tokens = (answer.get("usage") or {}).get("prompt_tokens")
            if prompt_tokens != len(input_ids):
                raise DumpRejected(
                    "server_token_count", f"server reports {prompt_tokens} prompt tokens, sample has {len(input_ids)}"
                )
            with shared_lock(path, self.server.dump_wait_s):
                return self._stage(path, input_ids, rid, self.server.staging / staged_name, expect)
        finally:
            for done_with in (path, lock_path(path)):
                done_with.unlink(missing_ok=True)

    def _named_file(self, answer: dict[str, Any], rid: str) -> Path:
        """The file the answer names, which must be this request's, in the dump root."""
        params = answer.get("kv_transfer_params")
        named = params.get("hidden_states_path") if isinstance(params, dict) else None
        if not isinstance(named, str):
            raise DumpRejected(
                "no_dump",
                "the answer names no hidden-states file (kv_transfer_params.hidden_states_path): is vLLM started "
                "with --speculative-config method extract_hidden_states and hsx's connector (deploy/vllm)?",
            )
        path = Path(named)
        if path.parent.resolve() != self.root:
            raise DumpRejected("outside_root", f"the answer names {named}, which is not in the dump root {self.root}")
        # vLLM names a request's file cmpl-<X-Request-Id>-<prompt index>[-<random suffix>].safetensors
        if not (path.name.startswith(f"cmpl-{rid}-") and path.suffix == ".safetensors"):
            raise DumpRejected("not_ours", f"the answer names {path.name}, not a file of request {rid}")
        return path

    def _stage(self, path: Path, input_ids: list[int], rid: str, dest: Path, expect: Expectation) -> Dump:
        rows, dtype = read_rows(path, input_ids, self.layers)
        meta = {
            "num_tokens": len(input_ids),
            "layers": self.layers,
            "hidden_size": int(rows.shape[2]),
            "dtype": dtype,
            "rid": rid,
            "cached_tokens": 0,  # vLLM keeps the rows of cached prefixes: the file has every row
            "input_ids_sha256": ids_sha256(input_ids),
        }
        # vLLM interleaves the layers row by row: one contiguous block per layer.
        blocks = [np.ascontiguousarray(rows[:, j, :]) for j in range(rows.shape[1])]
        return stage_dump(
            dest,
            meta,
            blocks,
            Identity.IDS,
            expect_layers=expect.layers,
            expect_hidden=expect.hidden_size,
            expect_dtype=expect.dtype,
        )


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


@contextmanager
def shared_lock(path: Path, wait_s: float) -> Iterator[None]:
    """A shared flock on `<path>.lock`, which vLLM's writer holds exclusively until the file is whole;
    waits up to `wait_s` for the lock file to appear and for the writer to let go."""
    fd = _acquire(lock_path(path), time.monotonic() + wait_s, wait_s)
    try:
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _acquire(lock: Path, deadline: float, wait_s: float) -> int:
    while True:
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                os.close(fd)
        if time.monotonic() >= deadline:
            raise DumpRejected("dump_timeout", f"{lock.name} was not there and free within {wait_s:g} s")
        time.sleep(LOCK_POLL_S)


def read_rows(path: Path, input_ids: list[int], layers: list[int]) -> tuple[np.ndarray, str]:
    """The file's `hidden_states` `[tokens, layers, hidden]` as an array of its dtype's bits, and the
    dtype's name; DumpRejected unless its `token_ids` are exactly `input_ids` and its shape fits."""
    try:
        spans = read_index(path)
    except FileNotFoundError:
        raise DumpRejected("no_dump", f"{path.name} is not there") from None
    except SafetensorsFormatError as exc:
        raise DumpRejected("bad_dump", str(exc)) from None
    hidden, ids = spans.get("hidden_states"), spans.get("token_ids")
    if hidden is None or ids is None:
        raise DumpRejected("bad_dump", f"{path.name} lacks hidden_states or token_ids")
    got = _array(ids)
    if ids.dtype != "I64" or got.tolist() != list(input_ids):
        raise DumpRejected("not_ours", f"{path.name}'s token ids are not the sample's")
    dtype = DTYPES_BY_CODE[hidden.dtype].name
    if len(hidden.shape) != 3 or hidden.shape[0] != len(input_ids) or hidden.shape[1] != len(layers):
        raise DumpRejected(
            "wrong_shape",
            f"hidden_states has shape {list(hidden.shape)}, expected [{len(input_ids)}, {len(layers)}, hidden]",
        )
    if dtype not in HIDDEN_STATE_DTYPES:
        raise DumpRejected("wrong_dtype", f"hidden_states is {dtype}")
    return _array(hidden), dtype


def _array(span: TensorSpan) -> np.ndarray:
    data = np.frombuffer(span.read(), dtype=DTYPES_BY_CODE[span.dtype].numpy)
    return data.reshape(span.shape)

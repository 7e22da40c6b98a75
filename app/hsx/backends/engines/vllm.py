"""vLLM's extract_hidden_states path: one sample is one `POST /v1/completions`, its hidden states a
file vLLM writes and names in the answer.

vLLM started with `--speculative-config '{"method": "extract_hidden_states", ...}'` and a hidden-states
KV connector writes, for each request, `<dump root>/<vLLM's request id>.safetensors` with
`hidden_states` `[tokens, layers, hidden]` and the prompt's `token_ids`, and answers the path in
`kv_transfer_params.hidden_states_path`. Two connectors write these files, named and placed alike:

- vLLM's own `ExampleHiddenStatesConnector` (what vllm-project/speculators users run; it needs a CUDA
  device). Its files say nothing of the layers they hold: the operator gives them (`--capture-layers`,
  vLLM's `eagle_aux_hidden_state_layer_ids` in ascending order). The model comes from `/v1/models` and
  its config.json, and the API server's start time on `/metrics` (`process_start_time_seconds`) stands
  for a boot id: a restarted server shows a new one. Without that metric (several API server processes)
  a restart is not seen as such, though the outage around it is.
- hsx's connector (deploy/vllm: vLLM's own, made to work on a CPU-only host too), which also writes
  `hsx-vllm.json` into the root at start-up: the layers it captures, the model, and a boot id.

The answer can come before the file is whole: vLLM's writer holds `<path>.lock` while it writes, so the
file is read under a shared lock on it.

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
from hsx.backends.model import describe_model, read_model_config
from hsx.dtypes import DTYPES_BY_CODE, HIDDEN_STATE_DTYPES
from hsx.identity import Identity
from hsx.sources import Source
from hsx.storage.safetensors_raw import SafetensorsFormatError, TensorSpan, read_index

VLLM_INFO_FILE = "hsx-vllm.json"
VLLM_INFO_FORMAT = "hsx-vllm/1"
LOCK_POLL_S = 0.005


class VLLMClient(HttpBackend):
    """The part of vLLM's OpenAI-compatible server that extraction uses."""

    def card(self) -> dict[str, Any]:
        """The one model the server serves, as `/v1/models` describes it: `id` (the name requests must give),
        `root` (its path), `max_model_len`, `owned_by` ("vllm")."""
        data = self._request("GET", "/v1/models").json().get("data") or []
        if not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
            raise BackendRejected(f"GET /v1/models: no model in the answer: {str(data)[:200]}")
        return dict(data[0])

    def started_at(self) -> float | None:
        """When the API server's process started (`/metrics` `process_start_time_seconds`, Unix seconds); None
        where the metric is not served (vLLM with several API server processes aggregates across them and
        leaves it out)."""
        for line in self._request("GET", "/metrics").text.splitlines():
            name, _, value = line.partition(" ")
            if name == "process_start_time_seconds":
                try:
                    return float(value)
                except ValueError:
                    return None
        return None

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
            "shared_storage_path set to the dump root, or, with vLLM's own ExampleHiddenStatesConnector writing "
            "there, give hsx the layers it captures (--capture-layers, its eagle_aux_hidden_state_layer_ids in "
            "ascending order; deploy/vllm/README.md)"
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


def stock_capture(layers: list[int], card: dict[str, Any], started_at: float | None) -> Capture:
    """The capture of vLLM's own connector, which writes no hsx-vllm.json: the layers as --capture-layers gives
    them, the model from `/v1/models` (its `root`) and config.json there, the API server's start time as the
    boot id. CaptureProblem when the model's layer count and width cannot be read or a layer lies beyond it."""
    model_path = card.get("root") if isinstance(card.get("root"), str) else card.get("id")
    config = read_model_config(model_path) or {}
    num_layers, hidden = config.get("num_hidden_layers"), config.get("hidden_size")
    if not (isinstance(num_layers, int) and isinstance(hidden, int)):
        raise CaptureProblem(
            f"cannot tell the model's layer count and hidden size: hsx reads them from config.json in the model "
            f"path vLLM reports ({model_path!r}), which is not a checkpoint directory readable here"
        )
    if layers[-1] > num_layers:
        raise CaptureProblem(f"--capture-layers {layers} names a layer beyond the model's {num_layers}")
    return Capture(
        layers=layers,
        model={**describe_model({"model_path": model_path}, {}), "final_layer": "pre_norm"},
        layers_from="--capture-layers (vLLM's own connector says nothing of its layers)",
        layers_unverified=(
            f"--capture-layers {','.join(map(str, layers))} is the operator's word: vLLM's own connector's files do "
            "not say which layers they hold, so hsx checks only their count; a wrong list of the right length "
            "stores other layers under these numbers"
        ),
        hidden_size=hidden,
        # The files say their dtype; the server does not say it before (its --dtype may differ from the
        # checkpoint's), so each file's is checked against the job's.
        dtype=None,
        # Not the connector's: the API server's process start; a restart starts a new one.
        boot_id=f"vllm-started-{started_at!r}" if started_at is not None else None,
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
        """What hsx's connector wrote into the dump root, or with vLLM's own connector what --capture-layers
        says; with auto, None when neither is there, or when only --capture-layers is and the server does not
        say it is vLLM."""
        server = look.server
        info = read_vllm_info(server.root.path)
        if look.auto and info is None and server.capture_layers is None:
            return None
        card = _card(server, auto=look.auto and info is None)
        if card is None:
            return None
        server.client(VLLMClient).health()
        capture = _capture(server, info, card)
        return cls(server, capture, model=str(card["id"]))

    @classmethod
    def limits(cls, server: Server) -> Limits | None:
        """Its context length less the one token each request generates, and the vocabulary of the model
        (from its config.json, where that is readable here); None without hsx-vllm.json or --capture-layers."""
        info = read_vllm_info(server.root.path)
        if info is None and server.capture_layers is None:
            return None
        card = _card(server, auto=info is None)
        if card is None:
            return None
        # max_model_len: prompt and generated tokens together
        context = count(card.get("max_model_len"))
        capture = _capture(server, info, card, boot=False)
        return Limits(
            vocab_size=count(capture.model.get("vocab_size")),
            max_tokens=context - 1 if context else None,
            layers=capture.layers,
            hidden_size=capture.hidden_size,
            dtype=capture.dtype,
        )

    def leftovers(self) -> list[Path]:
        return self.server.root.files("cmpl-*")

    def probe_hint(self) -> str:
        if self.capture.layers_from.startswith("--capture-layers"):
            return (
                f"; is --capture-layers ({','.join(map(str, self.layers))}) the server's "
                "eagle_aux_hidden_state_layer_ids, and its connector's shared_storage_path this --dump-root?"
            )
        return ""

    def down_hint(self) -> str:
        if self.capture.layers_from.startswith("--capture-layers"):
            return (
                "; vLLM's own ExampleHiddenStatesConnector kills vLLM's engine at the first finished request on a "
                "host without CUDA (pin_memory=True requires a CUDA or other accelerator backend): there, run hsx's "
                "connector instead (deploy/vllm/README.md)"
            )
        return (
            "; deploy/vllm/README.md says what kills the engine of vLLM's CPU build (attention head sizes it has "
            "no kernel for, bfloat16 on a CPU with AMX)"
        )

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
            removed = "; hsx removed that file and its lock" if self._remove_elsewhere(path, rid) else ""
            raise DumpRejected(
                "outside_root",
                f"the answer names {named}, which is not in the dump root {self.root}: the server writes its files "
                f"to {path.parent} (its connector's shared_storage_path); give hsx that folder as --dump-root, or "
                f"the server this one{removed}",
            )
        # vLLM names a request's file cmpl-<X-Request-Id>-<prompt index>[-<random suffix>].safetensors
        if not (path.name.startswith(f"cmpl-{rid}-") and path.suffix == ".safetensors"):
            raise DumpRejected("not_ours", f"the answer names {path.name}, not a file of request {rid}")
        return path

    def _remove_elsewhere(self, path: Path, rid: str) -> bool:
        """Remove a file of hsx's own request `rid` (and its lock) that the server wrote outside the dump root,
        once its writer is done with it: nobody else reads it, and a writer pointed at the wrong root would
        otherwise leave one with every probe in the server's storage (often /dev/shm). Whether it removed one."""
        if not (path.name.startswith(f"cmpl-{rid}-") and path.suffix == ".safetensors"):
            return False  # not named for hsx's request: not hsx's to remove
        try:
            with shared_lock(path, self.server.dump_wait_s):
                pass
        except DumpRejected:
            pass  # never written, or its writer still busy after the wait: removed as far as it is there
        removed = False
        for leftover in (path, lock_path(path)):
            try:
                leftover.unlink()
                removed = True
            except FileNotFoundError:
                pass
            except OSError:
                return removed  # not hsx's to remove after all (a read-only place, another user's)
        return removed

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


def _card(server: Server, *, auto: bool) -> dict[str, Any] | None:
    """The server's /v1/models card; with `auto` (only --capture-layers tells of vLLM), None unless the card
    says vLLM serves it."""
    if not auto:
        return server.client(VLLMClient).card()
    try:
        card = server.client(VLLMClient).card()
    except BackendRejected:
        return None
    return card if card.get("owned_by") == "vllm" else None


def _capture(server: Server, info: dict[str, Any] | None, card: dict[str, Any], *, boot: bool = True) -> Capture:
    """From hsx-vllm.json where hsx's connector wrote one (and --capture-layers, if given too, must agree),
    else from --capture-layers; `boot`: ask /metrics for the start time that stands for a boot id."""
    said = server.capture_layers
    if info is not None or said is None:
        capture = vllm_capture(info, server.root.path)
        if said is not None and said != capture.layers:
            raise CaptureProblem(
                f"--capture-layers {said} disagrees with the {capture.layers} that {VLLM_INFO_FILE} in the dump "
                "root gives: leave --capture-layers unset with hsx's connector"
            )
        if boot:
            _refuse_stale_info(server)
        return capture
    started = _started_at(server) if boot else None
    return stock_capture(said, card, started)


# hsx's connector writes hsx-vllm.json after the API server's process starts; a file older than that start
# by more than this (room for a file system whose clock is not the server's) was left by an earlier server.
STALE_INFO_S = 60.0


def _refuse_stale_info(server: Server) -> None:
    """CaptureProblem when hsx-vllm.json predates the server now running: an earlier vLLM with hsx's connector
    left it, and this one (vLLM's own connector, say) writes none, so its layers and boot id are not this
    server's. Not checked where /metrics gives no start time."""
    started = _started_at(server)
    if started is None:
        return
    try:
        written = (server.root.path / VLLM_INFO_FILE).stat().st_mtime
    except OSError:
        return
    if written < started - STALE_INFO_S:
        raise CaptureProblem(
            f"{VLLM_INFO_FILE} in the dump root was written {started - written:.0f} s before the vLLM now running "
            "started: an earlier server with hsx's connector left it, and this one writes none. Remove it and "
            "give --capture-layers (vLLM's own connector), or start vLLM with hsx's connector"
        )


def _started_at(server: Server) -> float | None:
    try:
        return server.client(VLLMClient).started_at()
    except BackendRejected:  # /metrics off or refused: restarts then show only as outages
        return None


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

"""vLLM's hidden-states connector, made to run where the KV cache is not on a CUDA device.

vLLM's `ExampleHiddenStatesConnector` (the connector of the `extract_hidden_states` speculative
method) copies each finished request's rows out of the cache with a CUDA stream, a CUDA event and
pinned host memory, all unconditionally: on a CPU-only host the first finished request kills the
engine (`pin_memory=True requires a CUDA or other accelerator backend`). `CpuCopyConnector` changes
only that copy. Everything else stays vLLM's: the file name `{shared_storage_path}/{req_id}
.safetensors`, the `.lock` file held exclusively from scheduling until the write ends, the
background write pool, and the path returned in `kv_transfer_params["hidden_states_path"]`. It writes
exactly what vLLM's own connector writes, and nothing else.

`HiddenStatesConnector` (the one to run with hsx) is that, and also writes `hsx-vllm.json` into the
storage folder when the server starts (from its scheduler's connector, once per launch): the layers it
captures, the model's layer count, width and dtype, and a boot id new with each launch. hsx reads its
capture from there (the server's API does not say), and a new boot id tells it the server restarted.

vLLM is the server's own dependency, not this distribution's: this module is imported only by the
server, through `kv_connector_module_path`.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from functools import partial
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event vLLM keeps per request, for a copy that has already happened.

    vLLM asks it `query()` (in `get_finished`: may the request's blocks be freed?) and the write
    thread calls `synchronize()` before writing; a synchronous copy is complete before either.
    """

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


INFO_FILE = "hsx-vllm.json"
INFO_FORMAT = "hsx-vllm/1"


class CpuCopyConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` whose copy out of the cache also works off CUDA; nothing else differs."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        # On CUDA, vLLM's own asynchronous copy (side stream, pinned memory) is the fast path: keep it.
        if not self._is_tp_rank_zero or self._kv_cache is None or self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        # Anywhere else the copy is made here, synchronously: the forward pass that filled the
        # cache has ended (CPU execution is synchronous), and once `get_finished` reports the
        # request the blocks go back to the pool, so the rows must be in a tensor of our own
        # first. The gather below is that copy (advanced indexing allocates a new tensor).
        num_tokens = pending.token_ids.shape[0]
        slot_mapping = (
            torch.tensor(pending.block_ids, dtype=torch.long).reshape(-1, 1) * self._block_size
            + torch.arange(self._block_size, dtype=torch.long)
        ).flatten()[:num_tokens]
        rows = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens)
        tensors = {"hidden_states": rows.to("cpu"), "token_ids": pending.token_ids.clone()}

        # From here on, what vLLM does after its copy: the same lock handshake and background write.
        assert pending.req_id not in self._req_futures, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))


class HiddenStatesConnector(CpuCopyConnector):
    """`CpuCopyConnector` that also describes its capture in `hsx-vllm.json`, for hsx, and on a CPU with AMX
    lets the worker use AMX tiles from its first request on."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            write_info(self._storage_path, describe(vllm_config))
        elif role == KVConnectorRole.WORKER:
            allow_amx_tiles()


def allow_amx_tiles() -> None:
    """Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM) in the worker's process, on a host
    without CUDA whose CPU has AMX.

    Linux gives a process AMX tile registers only once it has asked, and an AMX instruction before that is an
    illegal instruction. vLLM 0.32's CPU build never asks: its bfloat16 attention runs AMX kernels (on a CPU
    with AMX, for cache blocks a multiple of 32), and only oneDNN asks, in the linear layers, and only for
    prompts long enough for it to pick its AMX kernels. A server whose first request is a short prompt
    (4 tokens: 5-token and longer were not tried) loses its worker to SIGILL; one whose first request is long
    works on. Asking here, before any forward pass, makes every first request work.
    """
    if torch.cuda.is_available():
        return
    init_amx = getattr(torch._C._cpu, "_init_amx", None)  # PyTorch's own way to ask; private, hence the guard
    if init_amx is not None and torch.cpu._is_amx_tile_supported():
        init_amx()


def describe(vllm_config: Any) -> dict[str, Any]:
    """What hsx needs to know of this server's capture, from the server's own configuration."""
    model = vllm_config.model_config
    spec = vllm_config.speculative_config.draft_model_config.hf_config
    return {
        "format": INFO_FORMAT,
        # vLLM writes the layers in ascending order, each once, whatever order the flag gives.
        "layers": sorted(set(getattr(spec, "eagle_aux_hidden_state_layer_ids", []))),
        "num_hidden_layers": int(model.hf_text_config.num_hidden_layers),
        "hidden_size": int(model.get_hidden_size()),
        "dtype": str(model.dtype).removeprefix("torch."),
        "model_path": str(model.model),
        "boot_id": uuid.uuid4().hex,
    }


def write_info(folder: str, info: dict[str, Any]) -> None:
    """Written whole or not at all: a reader never sees half a file."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, INFO_FILE)
    temp = f"{path}.{os.getpid()}.tmp"
    with open(temp, "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    os.replace(temp, path)

"""The hook's decisions: which requests of a prefill batch get a dump, and which rows are theirs.

Nothing here imports SGLang. `PrefillCapture` reads objects shaped like SGLang 0.5.23's:

- the batch (`ScheduleBatch`): `reqs`, each a `Req` with `rid`, `origin_input_ids`,
  `inflight_middle_chunks`, `cached_tokens`, `is_retracted` and `finished()`;
- the result (`GenerationBatchResult`): `extend_input_len_per_req` (rows per request, in batch
  order) and `logits_output` (`LogitsProcessorOutput`), whose `hidden_states` holds the aux layers
  side by side, `[tokens, K * hidden]`, and `last_hidden_states` the post-norm last layer.

Only the attention-TP rank 0 dumps; the other ranks hold the same rows.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import numpy as np

from hsx_sglang import __version__
from hsx_sglang.dumpdir import DTYPE_NAMES, DumpDirWriter, PluginInfo
from hsx_sglang.layers import CapturedLayers
from hsx_sglang.settings import SAFE_RID, PluginSettings
from hsx_sglang.writer import DumpJob, DumpWriterThread

log = logging.getLogger("hsx_sglang")


class PrefillCapture:
    def __init__(self, layers: CapturedLayers, rid_prefix: str, writer: DumpWriterThread):
        self.layers = layers
        self.rid_prefix = rid_prefix
        self.writer = writer

    def capture(self, batch: Any, result: Any, attn_tp_rank: int) -> list[str]:
        """Decide and queue the dumps of one prefill batch whose tensors are final; the rids queued."""
        jobs = self.plan(batch, result, attn_tp_rank)
        self.submit(jobs)
        return [job.rid for job in jobs]

    def plan(self, batch: Any, result: Any, attn_tp_rank: int) -> list[DumpJob]:
        """The dumps of one prefill batch, read before SGLang processes it (processing changes the
        requests' chunk counters). Takes views of the tensors, never their values."""
        if attn_tp_rank != 0:
            return []
        reqs = batch.reqs
        ours = [i for i, req in enumerate(reqs) if isinstance(req.rid, str) and req.rid.startswith(self.rid_prefix)]
        if not ours:
            return []
        problem = self._batch_problem(batch, result)
        if problem is not None:
            for i in ours:
                log.warning("hsx-sglang: no dump for rid %s: %s", reqs[i].rid, problem)
            return []
        lens = [int(n) for n in result.extend_input_len_per_req]
        bounds = [0, *itertools.accumulate(lens)]  # request i's rows: bounds[i]:bounds[i + 1]
        aux = result.logits_output.hidden_states
        last = result.logits_output.last_hidden_states
        hidden = int(last.shape[1])
        jobs = []
        for i in ours:
            req = reqs[i]
            problem = self._request_problem(req, lens[i])
            if problem is not None:
                log.warning("hsx-sglang: no dump for rid %s: %s", req.rid, problem)
                continue
            start, stop = bounds[i], bounds[i + 1]
            rows = {layer: aux[start:stop, k * hidden : (k + 1) * hidden] for k, layer in enumerate(self.layers.aux)}
            rows[self.layers.final] = last[start:stop]
            prompt = np.array(req.origin_input_ids, dtype=np.int64)
            jobs.append(DumpJob(rid=req.rid, rows=rows, prompt_ids=prompt, cached_tokens=int(req.cached_tokens)))
        return jobs

    def submit(self, jobs: list[DumpJob]) -> None:
        """Hand the dumps to the writer thread; blocks while it is `max_pending` batches behind."""
        if jobs:
            self.writer.put(jobs)

    def _batch_problem(self, batch: Any, result: Any) -> str | None:
        lens = result.extend_input_len_per_req
        if lens is None:
            return "the batch has no per-request extend lengths (send the request with return_logprob: true)"
        if len(lens) != len(batch.reqs):
            return f"{len(lens)} extend lengths for {len(batch.reqs)} requests"
        output = result.logits_output
        aux = None if output is None else output.hidden_states
        last = None if output is None else output.last_hidden_states
        if aux is None or last is None:
            return (
                "the forward kept no aux or no last hidden states "
                "(launch with --enable-return-aux-hidden-states --speculative-algorithm EAGLE3)"
            )
        return self._rows_problem(aux, last, lens)

    def _rows_problem(self, aux: Any, last: Any, lens: Any) -> str | None:
        """The captured rows against the batch: 2-D, a row per extend token, the aux layers side by side."""
        if aux.dim() != 2 or last.dim() != 2:
            return f"hidden states of shapes {list(aux.shape)} and {list(last.shape)}, expected 2-D"
        tokens = sum(int(n) for n in lens)
        if aux.shape[0] != tokens or last.shape[0] != tokens:
            return f"{aux.shape[0]} aux and {last.shape[0]} last rows for {tokens} extend tokens (not a full capture)"
        k, hidden = len(self.layers.aux), int(last.shape[1])
        if aux.shape[1] != k * hidden:
            return f"aux hidden states are {aux.shape[1]} wide, expected {k} layers x {hidden}"
        if aux.dtype != last.dtype or aux.dtype not in DTYPE_NAMES:
            return f"hidden states of dtype {aux.dtype} / {last.dtype}"
        return None

    def _request_problem(self, req: Any, extend_len: int) -> str | None:
        if not SAFE_RID.fullmatch(req.rid):
            return "the rid cannot name a directory"
        if req.is_retracted or req.finished():
            return "the request finished or was retracted before its prefill result"
        if req.inflight_middle_chunks > 0:
            return "chunked prefill: this pass is a middle chunk of the prompt (launch with --chunked-prefill-size -1)"
        prompt_len, cached = len(req.origin_input_ids), int(req.cached_tokens)
        if extend_len + cached != prompt_len:
            return (
                f"this pass covers {extend_len} of {prompt_len} prompt tokens with {cached} from the prefix cache "
                "(a chunked or re-run prefill)"
            )
        return None


PLUGIN_INFO_FORMAT = "hsx-plugin/1"
DUMP_PROTOCOL = 1


def plugin_info(
    settings: PluginSettings, *, layers: CapturedLayers, boot_id: str, hidden_size: int, dtype: str, sglang_version: str
) -> PluginInfo:
    """What the service needs to know about this server's dumps (`hsx-plugin.json`, README.md)."""
    return {
        "format": PLUGIN_INFO_FORMAT,
        "plugin": "hsx-sglang",
        "plugin_version": __version__,
        "sglang_version": sglang_version,
        "protocol": DUMP_PROTOCOL,
        "dump_root": str(settings.dump_root),
        "name_by": "rid",
        "rid_prefix": settings.rid_prefix,
        "layers": layers.all,
        "hidden_size": hidden_size,
        "dtype": dtype,
        "boot_id": boot_id,
    }


def start_capture(
    settings: PluginSettings,
    *,
    layers: CapturedLayers,
    boot_id: str,
    attn_tp_rank: int,
    hidden_size: int,
    dtype: str,
    sglang_version: str,
) -> PrefillCapture:
    """The capture of one scheduler process. Rank 0 clears the temporary directories of earlier
    launches and tells the service what it writes (hsx-plugin.json)."""
    dirs = DumpDirWriter(settings.dump_root, boot_id)
    if attn_tp_rank == 0:
        dirs.remove_stale_temp_dirs()
        info = plugin_info(
            settings,
            layers=layers,
            boot_id=boot_id,
            hidden_size=hidden_size,
            dtype=dtype,
            sglang_version=sglang_version,
        )
        dirs.write_plugin_info(info)
    return PrefillCapture(layers, settings.rid_prefix, DumpWriterThread(dirs, settings.max_pending))

"""Synthetic mode (`--synthetic`): no model, realistic shapes, content that anyone can recompute.

The reference server normally runs a real causal LM. For benchmarks of the extraction service that
is both too slow (CPU) and too small (the embedded model has hidden size 64); synthetic mode instead
serves a model of any shape (default: a Llama-7B-like 32 layers, hidden 4096, vocab 32000, bfloat16)
whose hidden states cost almost nothing to produce:

    synthetic_hidden_states(input_ids, layers, hidden_size, dtype, seed)[layer][t]
        = TABLE[row(t, layer)]
    TABLE   = torch.rand(2048, hidden_size, generator=torch.Generator().manual_seed(seed)) * 2 - 1,
              in float32, then cast to dtype (built once per (hidden_size, dtype, seed) and cached)
    row     = fmix32((a + b + c + d) mod 2^32) % 2048, fmix32 being MurmurHash3's 32-bit finaliser,
              a = (input_ids[t] * 0x9E3779B1) mod 2^32
              b = ((input_ids[t-1] + 1 if t > 0 else 0) * 0x85EBCA77) mod 2^32
              c = (t * 0xC2B2AE3D) mod 2^32
              d = (layer * 0x27D4EB2F + seed * 0x165667B1) mod 2^32

so a row depends on the token, the token before it, its position and the layer: a pure,
deterministic function of (input_ids, layer) that is also causal (rows of a prefix do not depend on
later tokens, so a chunk or a cache-trimmed dump is a row slice of the full prompt's tensors). Values
are finite, uniform in [-1, 1) before the cast (which may round some to 1).

Producing a sample is a hash per token and a row gather per layer. The server does not even gather:
its runner hands the dumper lazy RowGather objects, and the dumper streams the table's rows
straight into the file with os.writev, so a 2,000-token, 4-layer, hidden-4096 sample (64 MB) costs
little more than the write itself.

Timing is simulated: a prompt of T tokens "runs" for T * --prefill-us-per-token plus
--per-request-us microseconds. With --max-batch > 1 in rid mode, requests that are waiting together
are run as one batch (up to --max-batch of them) that costs the time of its longest prompt plus
--per-request-us per request, so concurrent clients get more throughput, as on a GPU.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Sequence
from typing import TypedDict

import torch

from hsx.reference.common import DTYPES, ForwardResult, dtype_name

SYNTHETIC_MODEL_PATH = "hsx-synthetic"
TABLE_ROWS = 2048  # a power of two: row = hash & (TABLE_ROWS - 1)
_M32 = 0xFFFFFFFF


class _Table:
    """TABLE for one (hidden_size, dtype, seed), plus a memoryview of each row's bytes for writev."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, seed: int):
        generator = torch.Generator().manual_seed(seed)
        # Uniform floats from a seeded CPU generator are exact (k / 2**24), so *2-1 and the cast are too.
        table = torch.rand(TABLE_ROWS, hidden_size, generator=generator, dtype=torch.float32)
        self.tensor = table.mul_(2).sub_(1).to(dtype).contiguous()
        raw = self.tensor.view(torch.uint8).numpy()
        self.row_bytes = [memoryview(raw[r]) for r in range(TABLE_ROWS)]


@functools.lru_cache(maxsize=8)
def _table(hidden_size: int, dtype: torch.dtype, seed: int) -> _Table:
    return _Table(hidden_size, dtype, seed)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for 0 <= h < 2**32, without int64 overflow: multiply by c's two 16-bit halves."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def synthetic_rows(input_ids: Sequence[int], layers: Sequence[int], seed: int = 0) -> dict[int, torch.Tensor]:
    """{layer: the TABLE row index of every position} (int64 [len(input_ids)]), as the docstring defines."""
    ids = torch.tensor(list(input_ids), dtype=torch.int64) & _M32
    prev = torch.zeros_like(ids)
    prev[1:] = (ids[:-1] + 1) & _M32
    positions = torch.arange(ids.numel(), dtype=torch.int64)
    base = _mul32(ids, 0x9E3779B1) + _mul32(prev, 0x85EBCA77) + _mul32(positions, 0xC2B2AE3D)
    out: dict[int, torch.Tensor] = {}
    for layer in layers:
        salt = (layer * 0x27D4EB2F + seed * 0x165667B1) & _M32
        out[layer] = _fmix32((base + salt) & _M32) & (TABLE_ROWS - 1)
    return out


def synthetic_hidden_states(
    input_ids: Sequence[int],
    layers: Sequence[int],
    hidden_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> dict[int, torch.Tensor]:
    """{layer: [len(input_ids), hidden_size] tensor of `dtype`} as the module docstring defines it.

    The tensors are fresh (not views of the cached table), so callers may modify them.
    """
    if hidden_size <= 0:
        raise ValueError(f"hidden_size must be positive, got {hidden_size}")
    table = _table(hidden_size, dtype, seed).tensor
    return {layer: table.index_select(0, rows) for layer, rows in synthetic_rows(input_ids, layers, seed).items()}


class RowGather:
    """A [len(rows), hidden] tensor that is TABLE[rows], not yet gathered: what the server dumps.

    The dumper streams TABLE's rows straight into the file (buffers(), one os.writev per 1024
    rows), which skips building 64 MB of tensors for a 2,000-token sample of 4 layers at hidden 4096
    and roughly halves the time to dump it. Row slices (chunks, cache trims) stay lazy; anything else
    calls materialize().
    """

    def __init__(self, table: _Table, rows: torch.Tensor):
        self._table = table
        self.rows = rows
        self.dtype = table.tensor.dtype
        self.shape = torch.Size([rows.numel(), table.tensor.shape[1]])

    def __getitem__(self, index: slice) -> RowGather:
        if not isinstance(index, slice):
            raise TypeError("a RowGather only takes row slices; materialize() it for anything else")
        return RowGather(self._table, self.rows[index])

    def materialize(self) -> torch.Tensor:
        return self._table.tensor.index_select(0, self.rows)

    def buffers(self) -> list[memoryview]:
        """The tensor's bytes, row-major, as memoryviews of TABLE's rows."""
        row_bytes = self._table.row_bytes
        return [row_bytes[r] for r in self.rows.tolist()]


def synthetic_output_ids(input_ids: Sequence[int], max_new_tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    """A deterministic "greedy decode": each new token hashes the previous one and its position."""
    out: list[int] = []
    last = input_ids[-1] if input_ids else 0
    for k in range(max_new_tokens):
        h = (last * 0x9E3779B1 + (len(input_ids) + k) * 0xC2B2AE3D + seed) & _M32
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & _M32
        h ^= h >> 13
        last = (h * 0xC2B2AE35 & _M32) % vocab_size
        out.append(last)
    return out


class BatcherStats(TypedDict):
    batches: int
    requests: int
    largest_batch: int


class Batcher:
    """Simulated GPU time with batching: callers queue, one thread runs what is waiting as one batch.

    A batch of prompts T_1..T_n sleeps max(T_i) * us_per_token + n * per_request_us microseconds; every
    caller in it returns when it ends. Requests that arrive while a batch runs form the next batch.
    """

    def __init__(self, max_batch: int, us_per_token: float, per_request_us: float):
        self.max_batch = max_batch
        self.us_per_token = us_per_token
        self.per_request_us = per_request_us
        self.batches = 0
        self.requests = 0
        self.largest_batch = 0
        self._queue: queue.SimpleQueue[tuple[int, threading.Event]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="synthetic-batcher", daemon=True).start()

    def run(self, num_tokens: int) -> None:
        finished = threading.Event()
        self._queue.put((num_tokens, finished))
        finished.wait()

    def stats(self) -> BatcherStats:
        return {"batches": self.batches, "requests": self.requests, "largest_batch": self.largest_batch}

    def _loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            cost_us = max(n for n, _ in batch) * self.us_per_token + len(batch) * self.per_request_us
            if cost_us > 0:
                time.sleep(cost_us / 1e6)
            self.batches += 1
            self.requests += len(batch)
            self.largest_batch = max(self.largest_batch, len(batch))
            for _, finished in batch:
                finished.set()


class SyntheticInfo(TypedDict):
    """What the server's info shows of a synthetic model (`synthetic`)."""

    seed: int
    prefill_us_per_token: float
    per_request_us: float
    max_batch: int
    batching: bool
    stats: BatcherStats | None


class SyntheticRunner:
    """The ModelRunner interface (run, layers, shapes) over synthetic_hidden_states and simulated time."""

    model_path = SYNTHETIC_MODEL_PATH

    def __init__(
        self,
        *,
        hidden_size: int = 4096,
        num_layers: int = 32,
        vocab_size: int = 32000,
        dtype: str = "bfloat16",
        layers: Sequence[int],
        context_length: int = 131072,
        seed: int = 0,
        prefill_us_per_token: float = 0.0,
        per_request_us: float = 0.0,
        max_batch: int = 1,
        batching: bool = False,
    ):
        for name, value in (
            ("hidden_size", hidden_size),
            ("num_layers", num_layers),
            ("vocab_size", vocab_size),
            ("context_length", context_length),
            ("max_batch", max_batch),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if prefill_us_per_token < 0 or per_request_us < 0:
            raise ValueError("simulated times must be >= 0")
        bad = [i for i in layers if not 0 <= i <= num_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range 0..{num_layers}")
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_layers
        self.vocab_size = vocab_size
        self.max_position_embeddings = context_length
        self.dtype = DTYPES[dtype]
        self.dtype_name = dtype_name(self.dtype)
        self.layers = sorted(set(layers))
        self.seed = seed
        self.prefill_us_per_token = prefill_us_per_token
        self.per_request_us = per_request_us
        self.max_batch = max_batch
        self.batcher = Batcher(max_batch, prefill_us_per_token, per_request_us) if batching else None
        self._table = _table(hidden_size, self.dtype, seed)  # built now rather than in the first request

    def info(self) -> SyntheticInfo:
        return {
            "seed": self.seed,
            "prefill_us_per_token": self.prefill_us_per_token,
            "per_request_us": self.per_request_us,
            "max_batch": self.max_batch,
            "batching": self.batcher is not None,
            "stats": self.batcher.stats() if self.batcher else None,
        }

    def hidden_states(self, input_ids: Sequence[int], layers: Sequence[int]) -> dict[int, RowGather]:
        """synthetic_hidden_states(), lazily: RowGather.materialize() gives the same tensors."""
        rows = synthetic_rows(input_ids, layers, self.seed)
        return {layer: RowGather(self._table, r) for layer, r in rows.items()}

    def run(self, input_ids: list[int], max_new_tokens: int) -> ForwardResult:
        if self.batcher is not None:
            self.batcher.run(len(input_ids))
        else:
            cost_us = len(input_ids) * self.prefill_us_per_token + self.per_request_us
            if cost_us > 0:
                time.sleep(cost_us / 1e6)
        hidden = self.hidden_states(input_ids, self.layers)
        last = self.num_hidden_layers

        def final_hidden() -> torch.Tensor:  # only computed when a reply needs it
            return self.hidden_states(input_ids, [last])[last].materialize()

        return ForwardResult(
            hidden_states=hidden,
            final_hidden=None,
            final_hidden_fn=final_hidden,
            output_ids=synthetic_output_ids(input_ids, max_new_tokens, self.vocab_size, self.seed),
        )

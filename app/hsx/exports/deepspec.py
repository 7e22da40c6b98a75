"""DeepSpec's target cache (deepseek-ai/DeepSpec), version 2: what its DFlash, DSpark and EAGLE-3 trainers
read offline (`deepspec/data/target_cache_dataset.py`: `CacheDataset`, `load_target_cache_manifest`).

Layout:

    <out>/shard-<k>.bin     raw bytes, per sample one after the other:
                              input_ids                  int32 [T]
                              attention_mask             uint8 [T]  (ones)
                              loss_mask                  uint8 [T]
                              target_hidden_states       bfloat16 [T, n * H]   the taps side by side
                              target_last_hidden_states  bfloat16 [T, H]       L after the final norm
    <out>/samples.idx       one record per sample, sample_id 0, 1, ... in order: little-endian
                            <QIIQQQQQ> sample_id, shard_id, seq_len, and the five tensors' byte offsets
                            in the shard
    <out>/manifest.json     version 2, num_samples, num_shards, target_layer_ids, hidden_dtype bfloat16,
                            token_dtype int32, mask_dtype uint8, index_record_size 56, hidden_size,
                            shards [{shard_id, file_name}], target_model_name_or_path

DeepSpec hooks decoder layer outputs counting from 0 (its -1 is the embeddings): its target layer k is
hsx's layer k + 1, and `target_layer_ids` lists the taps so, ascending. The taps are a layer set's (dflash by
default, `--layer-set` or `--aux-layers` for others), the last hidden state is layer L after the final norm
(DeepSpec takes its backbone's `last_hidden_state`). Values are stored in bfloat16 (DeepSpec's
hidden_dtype): a bfloat16 job's bytes as they are, a float32 or float16 one's rounded to nearest, ties to
even, as torch's `.to(torch.bfloat16)` does; a lossless or fp8 job's decoded first.

One DeepSpec shard per hsx shard, written whole by one worker a block of rows at a time (memory: a block,
not a shard), so a rerun skips the shards already complete; the index and the manifest, which the rows'
sizes alone determine, are written last. Samples are numbered shard by shard in the manifest's shard order,
by their place in the shard; `hsx_samples.jsonl` maps each sample_id to hsx's sample id.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from hsx.dtypes import DTYPES, DType
from hsx.exports.base import (
    Exporter,
    ExportRefused,
    PlannedFile,
    layer_set_aux,
    require_layers,
    require_num_layers,
    require_post_norm_last,
)
from hsx.exports.rows import SampleRows, fill_side_by_side
from hsx.layers import layer_key
from hsx.manifest import ManifestSample
from hsx.storage.atomic import atomic_file
from hsx.storage.floats import from_float32, to_float32
from hsx.training.reader import ShardReader, StoredJob

VERSION = 2
INDEX_RECORD = struct.Struct("<QIIQQQQQ")
INDEX_NAME = "samples.idx"
MANIFEST_NAME = "manifest.json"
SAMPLES_NAME = "hsx_samples.jsonl"
DEFAULT_LAYER_SET = "dflash"
BFLOAT16 = DTYPES["bfloat16"]
# A sample's rows are converted and written this many bytes at a time.
BLOCK_BYTES = 8 * 1024 * 1024


def shard_file(number: int) -> str:
    return f"shard-{number:05d}.bin"


class DeepSpecExporter(Exporter):
    target = "deepspec"

    def __init__(
        self,
        job: StoredJob,
        *,
        num_layers: int | None = None,
        aux_layers: list[int] | None = None,
        layer_set: str | None = None,
        target_model: str | None = None,
    ):
        super().__init__(job)
        self.num_layers = require_num_layers(job, num_layers)
        if aux_layers is None and layer_set is None:
            layer_set = DEFAULT_LAYER_SET
        taps = layer_set_aux(job, self.target, layer_set, aux_layers, self.num_layers)
        self.taps = sorted(set(taps or []))
        if not self.taps or any(not 0 <= i < self.num_layers for i in self.taps):
            raise ExportRefused(f"taps {taps} must be distinct layers in 0..{self.num_layers - 1}")
        require_layers(
            job,
            self.target,
            [*self.taps, self.num_layers],
            f"target_layer_ids {self.target_layer_ids} (DeepSpec counts decoder layer outputs from 0: hsx's "
            f"layer k is its k - 1), plus {self.num_layers} = the last hidden state after the final norm",
        )
        require_post_norm_last(job, self.target, self.num_layers)
        path = (job.manifest.model or {}).get("model_path")
        self.target_model = target_model or (str(path) if path else None)
        if self.target_model is None:
            raise ExportRefused("the manifest records no model path: name the target model with --target-model")
        self.dtype = DTYPES[str(job.manifest.dtype)]
        # DeepSpec's sample ids: shard by shard in the manifest's shard order, by place in the shard.
        position = {s.name: k for k, s in enumerate(job.manifest.shards)}
        order = sorted(range(len(job.samples)), key=lambda i: (position[job.samples[i].shard], job.samples[i].offset))
        self.order = order
        self.by_shard: dict[str, list[ManifestSample]] = {}
        for i in order:
            self.by_shard.setdefault(job.samples[i].shard, []).append(job.samples[i])
        self.shard_ids = {name: k for k, name in enumerate(self.by_shard)}

    @property
    def target_layer_ids(self) -> list[int]:
        return [i - 1 for i in self.taps]

    def plan(self) -> list[PlannedFile]:
        """One file per hsx shard holding samples, named after its first sample (the one planned)."""
        index = {id(s): i for i, s in enumerate(self.job.samples)}
        return [
            PlannedFile(shard_file(self.shard_ids[name]), index[id(samples[0])], samples[0].id)
            for name, samples in self.by_shard.items()
        ]

    def settings(self) -> dict[str, Any]:
        return {
            "target_layer_ids": self.target_layer_ids,
            "last_layer": self.num_layers,
            "hidden_dtype": "bfloat16",
            "target_model_name_or_path": self.target_model,
        }

    def notes(self) -> list[str]:
        return [
            f"target_hidden_states = hsx layers {self.taps} (DeepSpec target_layer_ids {self.target_layer_ids}: "
            "set model.target_layer_ids to this); target_last_hidden_states = hsx layer "
            f"{self.num_layers} (after the final norm)",
            f"point data.target_cache_path at the output folder; target_model_name_or_path is {self.target_model}",
        ]

    def _sizes(self, num_tokens: int) -> list[int]:
        """Bytes of each of a sample's five tensors, in the shard's order."""
        hidden = self.job.hidden_size * BFLOAT16.itemsize
        return [4 * num_tokens, num_tokens, num_tokens, len(self.taps) * hidden * num_tokens, hidden * num_tokens]

    def encode(self, f: BinaryIO, rows: SampleRows, entry: ManifestSample, planned: PlannedFile) -> None:
        """The DeepSpec shard of `entry`'s hsx shard: each of its samples' tensors, one after the other."""
        for sample in self.by_shard[entry.shard]:
            self._write_sample(f, SampleRows(rows.shard, sample))

    def _write_sample(self, f: BinaryIO, rows: SampleRows) -> None:
        t = rows.num_tokens
        f.write(rows.tensor("input_ids").numpy().astype("<i4").tobytes())
        f.write(np.ones(t, dtype=np.uint8).tobytes())
        f.write(rows.tensor("loss_mask").numpy().astype(np.uint8).tobytes())
        taps = [layer_key(i) for i in self.taps]
        width = self.job.hidden_size * self.dtype.itemsize
        step = max(1, BLOCK_BYTES // (len(taps) * width))
        block = np.empty((min(step, t), len(taps) * width), dtype=np.uint8)
        for start in range(0, t, step):
            stop = min(start + step, t)
            out = block[: stop - start]
            fill_side_by_side(out, [rows.raw(k, start, stop) for k in taps])
            f.write(_bfloat16(out, self.dtype).reshape(-1).data)
        last = layer_key(self.num_layers)
        step = max(1, BLOCK_BYTES // width)
        for start in range(0, t, step):
            f.write(_bfloat16(rows.raw(last, start, min(start + step, t)), self.dtype).reshape(-1).data)

    def finalize(self, out_dir: Path, reader: ShardReader, changed: bool) -> list[str]:
        """The index and the manifest, from the samples' sizes alone; and which hsx sample each record is."""
        names = [INDEX_NAME, MANIFEST_NAME, SAMPLES_NAME]
        if not changed and all((out_dir / name).exists() for name in names):
            return names
        with atomic_file(out_dir / INDEX_NAME) as f:
            sample_id = 0
            for shard, samples in self.by_shard.items():
                offset = 0
                for sample in samples:
                    offsets = []
                    for size in self._sizes(sample.num_tokens):
                        offsets.append(offset)
                        offset += size
                    f.write(INDEX_RECORD.pack(sample_id, self.shard_ids[shard], sample.num_tokens, *offsets))
                    sample_id += 1
        with atomic_file(out_dir / SAMPLES_NAME) as f:
            for sample_id, i in enumerate(self.order):
                line = {"sample_id": sample_id, "id": self.job.samples[i].id, "index": i}
                f.write(json.dumps(line, separators=(",", ":")).encode() + b"\n")
        manifest = {
            "version": VERSION,
            "num_samples": len(self.order),
            "num_shards": len(self.by_shard),
            "target_layer_ids": self.target_layer_ids,
            "hidden_dtype": "bfloat16",
            "token_dtype": "int32",
            "mask_dtype": "uint8",
            "index_record_size": INDEX_RECORD.size,
            "hidden_size": self.job.hidden_size,
            "shards": [{"shard_id": k, "file_name": shard_file(k)} for k in range(len(self.by_shard))],
            "target_model_name_or_path": self.target_model,
            "hsx_job_id": self.job.job_id,
        }
        with atomic_file(out_dir / MANIFEST_NAME) as f:
            f.write(json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n")
        return names


def _bfloat16(raw: np.ndarray, dtype: DType) -> np.ndarray:
    """Raw rows of `dtype` as raw bfloat16 rows: as they are, or rounded to nearest, ties to even."""
    if dtype.name == "bfloat16":
        return raw
    return from_float32(to_float32(raw, dtype), BFLOAT16)

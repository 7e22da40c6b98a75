"""vLLM speculators offline data (vllm-project/speculators).

Layout, as `scripts/data_generation_offline.py` leaves it and `ArrowDataset` (`src/speculators/train/data.py`,
through `hs_connectors.FileTransfer`) reads it:

    <out>/hidden_states/hs_<idx>.safetensors     idx = the sample's row in the training dataset
        hidden_states  [T, n_layers, H]   target_layer_ids in order: the aux layers, then the last layer
        token_ids      int64 [T]

The trainer takes `hidden_states[:, :-1].flatten(1)` as the drafter input ([T, 3H]) and
`hidden_states[:, -1]` as `verifier_last_hidden_states`, to which it applies the verifier's own final
norm (`verifier_norm`) before its lm_head: speculators stores the last layer *before* the final norm
(vLLM's extract_hidden_states with layer id L). Its `loss_mask` and `seq_len` come from the
preprocessed (Arrow) dataset, row idx; this export writes them to `<out>/hsx_samples.jsonl`.

hsx's layer L is *after* the final norm (the manifest's `post_norm_layers` says so; an older manifest
that does not follows hsx's numbering), and the pre-norm output of the last decoder layer has no layer
number, so this export refuses unless it is given the final norm's weight (`final_norm_weight`): it
then stores L / (weight + offset), which the trainer's RMS norm turns back into L. The offset is 1 for
the Gemma-style norms that scale by 1 + weight, known from the manifest's `model.model_type`, else 0.
Every row is checked to have RMS 1 after the division (what an RMS-normed row divided by its scale
must have), so a wrong weight or norm convention is refused rather than exported. A manifest whose
`post_norm_layers` leave L out holds it before the norm already: it is stored as it is.

A job stored in fp8 (hsx.storage.encoding) is exported decoded, in the job's dtype, unless `fp8` is
asked for: then the files carry the stored codes as speculators' own FP8 backend (hs_connectors'
FP8HiddenStatesConnector) writes them, `hidden_states` float8_e4m3fn [T, n_layers, H] with
`hidden_states_scales` float32, which its reader (FP8Transfer) multiplies in on load. speculators' writer
keeps one scale per token, [T, 1, 1]; these files keep hsx's one per token and layer, [T, n_layers, 1],
which the same multiplication broadcasts, so no layer is quantized twice, except a last layer whose
norm's scale is divided out: that one is quantized anew (a scale per row) from its decoded values, and
each file's safetensors metadata records the error that adds (FP8_REQUANTIZED_ERROR). Only a reader that
multiplies the scales in reads these files right: hs-connectors' fp8 backend, first released with
speculators 0.9.0 (`--hidden-states-backend fp8`). speculators' default file backend, and any release
before 0.9.0, loads the codes without their scales; such a reader ignores metadata, so nothing in the file
can stop it: the metadata's FP8_LAYOUT names the layout and the reader for whoever looks, and the docs
and `hsx export --help` say it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors import safe_open

from hsx.exports.base import (
    Exporter,
    ExportRefused,
    PlannedFile,
    layer_set_aux,
    require_layers,
    require_num_layers,
)
from hsx.exports.rows import SampleRows, fill_side_by_side
from hsx.layers import eagle3_aux_layers, layer_key
from hsx.manifest import ManifestSample
from hsx.storage import fp8
from hsx.storage.atomic import atomic_file
from hsx.storage.checkpoint import NORM_KEYS
from hsx.storage.encoding import encoding_of
from hsx.storage.safetensors_raw import encode_header
from hsx.training.reader import ShardReader, StoredJob

SAMPLES_NAME = "hsx_samples.jsonl"
RMS_TOLERANCE = 0.02
# transformers model types whose RMS norm scales by 1 + weight (their weights are stored centred on 0).
ONE_PLUS_WEIGHT_NORMS = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_next"})
# A file's hidden_states are put together and written this many bytes of rows at a time.
BLOCK_BYTES = 8 * 1024 * 1024
# The speculators release whose hidden-states reader (hs-connectors' fp8 backend) multiplies the scales in.
FP8_READER = "speculators>=0.9.0 (hs-connectors>=0.9.0), trained with --hidden-states-backend fp8"
# Each --fp8 file's safetensors metadata: what the layout is and who reads it...
FP8_LAYOUT = "hsx_fp8_layout"
FP8_LAYOUT_VALUE = (
    "hidden_states float8_e4m3fn [T, n_layers, H] times hidden_states_scales float32 [T, n_layers, 1]; "
    f"read with {FP8_READER}; a reader that ignores the scales reads wrong values"
)
# ...and, where the last layer was quantized anew, the largest error that added: each value's distance from
# the decoded, unnormed row it was quantized from, relative to that row's largest magnitude.
FP8_REQUANTIZED_ERROR = "hsx_last_layer_requantized_max_error"


def default_norm_offset(model_type: str | None) -> float:
    """The final norm's offset (it scales by weight + offset) for a model type: 1 or 0."""
    return 1.0 if model_type in ONE_PLUS_WEIGHT_NORMS else 0.0


def load_final_norm_weight(path: str | Path, key: str | None = None) -> tuple[torch.Tensor, str]:
    """The final norm's weight from a checkpoint folder (safetensors) or one .safetensors file."""
    path = Path(path)
    candidates = (key,) if key else NORM_KEYS
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        files = sorted(path.glob("*.safetensors"))
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = [path / weight_map[k] for k in candidates if k in weight_map] or files
    elif path.is_file() and path.suffix == ".safetensors":
        files = [path]
    else:
        raise ExportRefused(f"--final-norm-weight {path}: not a checkpoint folder or a .safetensors file")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
            for k in candidates:
                if k in names:
                    return f.get_tensor(k), f"{file.name}:{k}"
    raise ExportRefused(
        f"--final-norm-weight {path}: no tensor named {' or '.join(candidates)}; name it with --final-norm-key"
    )


def norm_refusal(hidden_size: int) -> str:
    return (
        "speculators stores the last layer before the final norm and its trainer applies the verifier's "
        "norm to it; this job's last layer is after the final norm (hsx numbering), so exported as is the "
        "norm would be applied twice. Pass --final-norm-weight <checkpoint> (the target model's final norm, "
        f"{hidden_size} values) to store it with the norm's scale divided out, or use the specforge or "
        "modelopt export, which take the post-norm layer"
    )


class SpeculatorsExporter(Exporter):
    target = "speculators"

    def __init__(
        self,
        job: StoredJob,
        *,
        num_layers: int | None = None,
        aux_layers: list[int] | None = None,
        layer_set: str | None = None,
        final_norm_weight: str | Path | None = None,
        final_norm_key: str | None = None,
        final_norm_offset: float | None = None,
        fp8: bool = False,
    ):
        super().__init__(job)
        if fp8 and not encoding_of(job.manifest.encoding).fp8_codes:
            raise ExportRefused(
                f"fp8 carries the codes an fp8 job stored; this job's encoding is {job.manifest.encoding}: "
                "export it without --fp8"
            )
        self.fp8 = fp8
        # The largest error quantizing the last layer anew added, over the files written or found
        # (finalize); None where nothing was quantized anew.
        self.requantized_error: float | None = None
        self.num_layers = require_num_layers(job, num_layers)
        aux_layers = layer_set_aux(job, self.target, layer_set, aux_layers, self.num_layers)
        self.aux_layers = list(aux_layers) if aux_layers is not None else eagle3_aux_layers(self.num_layers)
        aux = self.aux_layers
        if not aux or self.num_layers in aux or len(set(aux)) != len(aux):
            raise ExportRefused(
                f"aux layers {self.aux_layers} must be distinct and exclude the last layer {self.num_layers}"
            )
        require_layers(
            job,
            self.target,
            [*self.aux_layers, self.num_layers],
            f"target_layer_ids {[*self.aux_layers, self.num_layers]}: the aux layers, then the last layer",
        )
        self.final_norm_offset = (
            float(final_norm_offset) if final_norm_offset is not None else default_norm_offset(job.model_type)
        )
        # The scale the last layer is divided by; None when the manifest says it is before the norm already.
        self.scale: torch.Tensor | None = None
        self.norm_source = ""
        if job.manifest.post_norm(self.num_layers) is not False:
            self._load_scale(final_norm_weight, final_norm_key)

    def _load_scale(self, final_norm_weight: str | Path | None, final_norm_key: str | None) -> None:
        job = self.job
        if final_norm_weight is None:
            raise ExportRefused(norm_refusal(job.hidden_size))
        weight, self.norm_source = load_final_norm_weight(final_norm_weight, final_norm_key)
        if tuple(weight.shape) != (job.hidden_size,):
            raise ExportRefused(
                f"final norm weight {self.norm_source} has shape {tuple(weight.shape)}, "
                f"the job's hidden size is {job.hidden_size}"
            )
        self.scale = weight.to(torch.float32) + self.final_norm_offset
        if bool((self.scale.abs() < 1e-12).any()) or not bool(torch.isfinite(self.scale).all()):
            raise ExportRefused(
                f"final norm scale from {self.norm_source} has zero or non-finite entries; the norm cannot be undone"
            )

    @property
    def target_layer_ids(self) -> list[int]:
        return [*self.aux_layers, self.num_layers]

    def plan(self) -> list[PlannedFile]:
        return [PlannedFile(f"hidden_states/hs_{i}.safetensors", i, s.id) for i, s in enumerate(self.job.samples)]

    def settings(self) -> dict[str, Any]:
        final_norm = None
        if self.scale is not None:
            scale_sha256 = hashlib.sha256(self.scale.numpy().tobytes()).hexdigest()
            final_norm = {"scale_sha256": scale_sha256, "offset": self.final_norm_offset}
        # fp8 only where asked for: a rerun of an earlier export finds the settings it recorded
        return {
            "target_layer_ids": self.target_layer_ids,
            "final_norm": final_norm,
            **({"fp8": True} if self.fp8 else {}),
        }

    def notes(self) -> list[str]:
        last = (
            f"with the final norm's scale ({self.norm_source}, offset {self.final_norm_offset:g}) divided out"
            if self.scale is not None
            else "as the manifest records it, before the final norm"
        )
        return [
            f"hidden_states[:, k] = hsx layers {self.target_layer_ids} (launch_vllm --target-layer-ids "
            f"{' '.join(map(str, self.aux_layers))}); the last one is layer {self.num_layers} {last}",
            *(
                [
                    "hidden_states float8_e4m3fn with hidden_states_scales [T, n_layers, 1]: read them with "
                    f"{FP8_READER}, which multiplies the scales in; speculators' default file backend and "
                    "releases before 0.9.0 read the codes without their scales, wrong values with no error"
                ]
                if self.fp8
                else []
            ),
            *(
                [
                    f"the last layer was quantized anew after the norm's scale was divided out: up to "
                    f"{self.requantized_error:.4g} of each row's largest magnitude from its decoded values, on "
                    "top of the job's own fp8 error (the manifest's max_error); each file's metadata has its "
                    f"own ({FP8_REQUANTIZED_ERROR})"
                ]
                if self.requantized_error is not None
                else []
            ),
            f"{SAMPLES_NAME}: one row per hs_<index> with input_ids, loss_mask and seq_len; build the "
            "training dataset from it: datasets.Dataset.from_json(...).select_columns(['input_ids', "
            "'loss_mask', 'seq_len']).with_format('torch').save_to_disk(DATA), then train with --data-path DATA "
            "--hidden-states-path <out>/hidden_states",
        ]

    def unnormed_last(self, last: torch.Tensor, sample_id: object, first_row: int = 0) -> torch.Tensor:
        """Rows of the last layer (the sample's from `first_row` on) with the final norm's scale divided
        out, in float32, each checked to have RMS 1; `last` itself when there is no scale."""
        if self.scale is None:
            return last
        x = last.to(torch.float32) / self.scale
        rms = x.pow(2).mean(dim=-1).sqrt()
        worst = (rms - 1).abs()
        if worst.numel() and float(worst.max()) > RMS_TOLERANCE:
            row = int(worst.argmax())
            raise ExportRefused(
                f"sample {sample_id!r} row {first_row + row}: layer {self.num_layers} divided by the final norm's "
                f"scale ({self.norm_source} + {self.final_norm_offset}) has RMS {float(rms[row]):.4f}, "
                "not 1: the weight is not this model's, or its norm is not x / rms(x) * (weight + "
                "offset) (Gemma-style norms use offset 1)"
            )
        return x

    def preflight(self, reader: ShardReader) -> None:
        if self.job.samples:
            entry = self.job.samples[0]
            rows = reader.sample(entry, [layer_key(self.num_layers)])
            self.unnormed_last(rows[layer_key(self.num_layers)], entry.id)

    def encode(self, f: BinaryIO, rows: SampleRows, entry: ManifestSample, planned: PlannedFile) -> None:
        """The file safetensors.torch.save would write for {hidden_states, token_ids} (with fp8, and
        hidden_states_scales), byte for byte, written a block of rows at a time: hidden_states is the
        layers side by side, row by row."""
        if self.fp8:
            self._encode_fp8(f, rows, entry)
            return
        keys = [layer_key(i) for i in self.target_layer_ids]
        layout = rows.shard.layout(keys[0])
        t, n, width = rows.num_tokens, len(keys), layout.row_bytes
        token_ids = rows.tensor("input_ids", torch.int64)
        # safetensors' own order: the 8-byte ids, then the states
        shapes = [("token_ids", "I64", (t,)), ("hidden_states", layout.dtype, (t, n, *layout.shape[1:]))]
        f.write(encode_header(shapes, None))
        f.write(token_ids.numpy().data.cast("B"))
        step = max(1, BLOCK_BYTES // (n * width))
        block = np.empty((min(step, t), n * width), dtype=np.uint8)
        copied = keys if self.scale is None else keys[:-1]  # a scaled last layer is written by torch below
        for start in range(0, t, step):
            stop = min(start + step, t)
            out = block[: stop - start]
            fill_side_by_side(out, [rows.raw(k, start, stop) for k in copied])
            if self.scale is not None:
                last = rows.as_tensor(keys[-1], rows.raw(keys[-1], start, stop))
                states = torch.from_numpy(out).view(last.dtype).view(stop - start, n, -1)
                states[:, -1].copy_(self.unnormed_last(last, entry.id, start))
            f.write(out.reshape(-1).data)

    def _fp8_rows(
        self, rows: SampleRows, key: str, start: int, stop: int
    ) -> tuple[np.ndarray, np.ndarray, float | None]:
        """A layer's codes and scales of the sample's rows start..stop, and the error quantizing added:
        as stored (None), or for a last layer whose norm's scale is divided out, its decoded rows divided
        and quantized anew."""
        if self.scale is None or key != layer_key(self.num_layers):
            return (*rows.fp8(key, start, stop), None)
        last = rows.as_tensor(key, rows.raw(key, start, stop))
        quantized = fp8.quantize(self.unnormed_last(last, rows.entry.id, start).numpy())
        return quantized.codes, quantized.scales, quantized.max_error

    def _encode_fp8(self, f: BinaryIO, rows: SampleRows, entry: ManifestSample) -> None:
        keys = [layer_key(i) for i in self.target_layer_ids]
        t, n, hidden = rows.num_tokens, len(keys), self.job.hidden_size
        step = max(1, BLOCK_BYTES // (n * hidden))
        scales = np.empty((t, n), dtype="<f4")
        added: float | None = None
        for start in range(0, t, step):
            stop = min(start + step, t)
            for j, key in enumerate(keys):
                _, scales[start:stop, j], error = self._fp8_rows(rows, key, start, stop)
                if error is not None:
                    added = max(added or 0.0, error)
        metadata = {FP8_LAYOUT: FP8_LAYOUT_VALUE}
        if added is not None:
            metadata[FP8_REQUANTIZED_ERROR] = repr(added)
        # safetensors' own order: by dtype, widest first (the 8-byte ids, the scales, the codes)
        f.write(
            encode_header(
                [
                    ("token_ids", "I64", (t,)),
                    ("hidden_states_scales", "F32", (t, n, 1)),
                    ("hidden_states", "F8_E4M3", (t, n, hidden)),
                ],
                metadata,
            )
        )
        f.write(rows.tensor("input_ids", torch.int64).numpy().data.cast("B"))
        f.write(scales.reshape(-1).data.cast("B"))
        block = np.empty((min(step, t), n * hidden), dtype=np.uint8)
        for start in range(0, t, step):
            stop = min(start + step, t)
            out = block[: stop - start]
            fill_side_by_side(out, [self._fp8_rows(rows, key, start, stop)[0] for key in keys])
            f.write(out.reshape(-1).data)

    def finalize(self, out_dir: Path, reader: ShardReader, changed: bool) -> list[str]:
        if self.fp8 and self.scale is not None:
            self.requantized_error = self._largest_requantized_error(out_dir)
        path = out_dir / SAMPLES_NAME
        if changed or not path.exists():
            with atomic_file(path) as f:
                for i, entry in enumerate(self.job.samples):
                    rows = reader.sample(entry, ["input_ids", "loss_mask"])
                    line = {
                        "index": i,
                        "id": entry.id,
                        "input_ids": rows["input_ids"].tolist(),
                        "loss_mask": rows["loss_mask"].tolist(),
                        "seq_len": entry.num_tokens,
                    }
                    f.write(json.dumps(line, separators=(",", ":")).encode() + b"\n")
        return [SAMPLES_NAME]

    def _largest_requantized_error(self, out_dir: Path) -> float:
        """The largest FP8_REQUANTIZED_ERROR of the files' metadata (their headers only)."""
        largest = 0.0
        for planned in self.plan():
            with safe_open(str(out_dir / planned.rel_path), framework="pt") as f:
                said = (f.metadata() or {}).get(FP8_REQUANTIZED_ERROR)
            if said is not None:
                largest = max(largest, float(said))
        return largest

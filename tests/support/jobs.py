"""Real job folders built in a test: shards written by hsx's own shard writer plus a manifest.

`make_job` writes samples (random, or given tensors) into shards with `hsx.storage.shards.write_shard`
and an `hsx.manifest.Manifest` written by `write_manifest`, so the Dataset, the exports and verify
read exactly what the service writes. `llama_hidden_states` runs a tiny random Llama to get real
hidden states in hsx's layer numbering.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hsx.dtypes import DTYPES
from hsx.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestSample,
    ManifestShard,
    encoded_layers,
    shard_layout,
    write_manifest,
)
from hsx.states import JobState
from hsx.storage.safetensors_raw import read_index
from hsx.storage.shards import ShardSample, shard_name, write_shard


@dataclass
class Sample:
    id: str
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int64 [T]
    layers: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, H]


@dataclass
class JobFixture:
    job_dir: Path
    manifest: Manifest
    samples: list[Sample]

    @property
    def manifest_path(self) -> Path:
        return self.job_dir / MANIFEST_NAME

    def by_id(self, sample_id: str) -> Sample:
        return next(s for s in self.samples if s.id == sample_id)

    def rewrite_manifest(self) -> None:
        write_manifest(self.job_dir, self.manifest)

    def set_value(self, sample_id: str, layer: int, row: int, col: int, value: float) -> None:
        """Change one stored value in place and record the shard's new hash: a value that was
        already wrong when its shard was written (the shard writer itself refuses NaN and Inf)."""
        entry = self.manifest.sample(sample_id)
        path = self.job_dir / entry.shard
        span = read_index(path)[f"layer_{layer}"]
        width = span.nbytes // span.shape[0]
        item = width // span.shape[1]
        data = torch.tensor([value], dtype=DTYPES[str(self.manifest.dtype)].torch).view(torch.uint8).numpy().tobytes()
        with open(path, "r+b") as f:
            f.seek(span.start + (entry.offset + row) * width + col * item)
            f.write(data)
        self.manifest.shard(entry.shard).sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        self.rewrite_manifest()


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def random_samples(
    n: int,
    layers: list[int],
    hidden: int,
    dtype: str,
    *,
    seed: int = 0,
    lengths: list[int] | None = None,
    vocab: int = 1000,
    ids: list[str] | None = None,
) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or [int(x) for x in torch.randint(3, 12, (n,), generator=g)]
    ids = ids or [f"s-{k}" for k in range(n)]
    out = []
    for k, (sid, t) in enumerate(zip(ids, lengths)):
        out.append(
            Sample(
                sid,
                torch.randint(0, vocab, (t,), generator=g, dtype=torch.int64),
                torch.tensor([(k + j) % 3 != 0 for j in range(t)], dtype=torch.int64),
                # distinct offsets per layer make a layer mix-up visible in any comparison
                {i: (torch.randn(t, hidden, generator=g) + 10 * i).to(DTYPES[dtype].torch) for i in layers},
            )
        )
    return out


def make_job(
    root: Path,
    *,
    layers: list[int] = (2, 4, 5, 8),
    hidden: int = 16,
    dtype: str = "bfloat16",
    num_samples: int = 5,
    samples_per_shard: int = 2,
    num_hidden_layers: int | None = 8,
    samples: list[Sample] | None = None,
    job_id: str = "job_test",
    vocab: int = 1000,
    seed: int = 0,
    lengths: list[int] | None = None,
    ids: list[str] | None = None,
    model: dict | None = None,
    post_norm_layers: list[int] | None = None,
    encoding: str = "raw",
) -> JobFixture:
    """`model` adds to (or replaces) the manifest's model fields; without it and `post_norm_layers`
    the manifest says what older hsx versions wrote. `encoding`: how the shards store the layers, and
    the manifest records it (with each layer's stats added up, as the service's manifest has them)."""
    layers = list(layers)
    job_dir = Path(root) / job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    if samples is None:
        samples = random_samples(num_samples, layers, hidden, dtype, seed=seed, lengths=lengths, vocab=vocab, ids=ids)
    shards, entries, stats = [], [], []
    for number, start in enumerate(range(0, len(samples), samples_per_shard)):
        group = samples[start : start + samples_per_shard]
        info = write_shard(
            job_dir / shard_name(number),
            [
                ShardSample(
                    s.id,
                    s.input_ids.numpy().astype(np.int64),
                    s.loss_mask.numpy().astype(np.int64),
                    {i: raw_bytes(s.layers[i]) for i in layers},
                )
                for s in group
            ],
            layers,
            dtype,
            hidden,
            encoding,
        )
        stats.append(None if info.layer_stats is None else {str(i): v.to_json() for i, v in info.layer_stats.items()})
        shards.append(
            ManifestShard(
                name=info.name,
                bytes=info.bytes,
                sha256=info.sha256,
                num_samples=info.num_samples,
                num_tokens=info.num_tokens,
            )
        )
        entries += [
            ManifestSample(id=s.id, shard=info.name, offset=off, num_tokens=int(s.input_ids.shape[0]))
            for s, off in zip(group, info.offsets)
        ]
    manifest = Manifest(
        job_id=job_id,
        name="test",
        state=JobState.SUCCEEDED,
        model={"model_path": "tiny", "num_hidden_layers": num_hidden_layers, "vocab_size": vocab, **(model or {})},
        layers=layers,
        post_norm_layers=post_norm_layers,
        hidden_size=hidden,
        dtype=dtype,
        encoding=encoding,
        encoded_layers=None if encoding == "raw" else encoded_layers(layers, stats),
        shard_layout=shard_layout(encoding),
        num_samples=len(samples),
        num_stored=len(samples),
        shards=shards,
        samples=entries,
    )
    fixture = JobFixture(job_dir, manifest, samples)
    fixture.rewrite_manifest()
    return fixture


# A tiny random Llama: 8 decoder layers make EAGLE-3's [2, L//2, L-3, L] four distinct layers.
LLAMA_LAYERS = 8
LLAMA_HIDDEN = 32
LLAMA_VOCAB = 128


def tiny_llama(seed: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=LLAMA_VOCAB,
        hidden_size=LLAMA_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LLAMA_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        # residual-stream magnitudes like a trained model's (mean square >> the norm's eps)
        initializer_range=0.2,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        # a final norm weight of all ones would hide a missing or doubled norm; make it matter
        with torch.no_grad():
            model.model.norm.weight.copy_(torch.rand(LLAMA_HIDDEN) + 0.5)
    return model


def llama_hidden_states(model, ids: list[list[int]]) -> list[tuple[torch.Tensor, ...]]:
    """transformers' output_hidden_states per sequence: (embeddings, layer 1, ..., layer L after the norm)."""
    out = []
    with torch.inference_mode():
        for seq in ids:
            hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
            out.append(tuple(h[0].clone() for h in hs))
    return out


def llama_job(
    root: Path,
    llama,
    *,
    layers: list[int] = (2, 4, 5, 8),
    lengths: tuple[int, ...] = (5, 9, 3),
    seed: int = 0,
    **manifest,
) -> tuple[JobFixture, list[tuple[torch.Tensor, ...]]]:
    """A float32 job holding the tiny Llama's real hidden states for a few random sequences;
    `manifest` goes to make_job (model=, post_norm_layers=)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, LLAMA_VOCAB, (n,), generator=g).tolist() for n in lengths]
    hidden = llama_hidden_states(llama, ids)
    samples = [
        Sample(
            f"conv-{k}",
            torch.tensor(seq, dtype=torch.int64),
            torch.ones(len(seq), dtype=torch.int64),
            {i: hs[i].to(torch.float32).contiguous() for i in layers},
        )
        for k, (seq, hs) in enumerate(zip(ids, hidden))
    ]
    job = make_job(
        root,
        layers=list(layers),
        hidden=LLAMA_HIDDEN,
        dtype="float32",
        samples=samples,
        num_hidden_layers=LLAMA_LAYERS,
        vocab=LLAMA_VOCAB,
        job_id="job_llama",
        **manifest,
    )
    return job, hidden

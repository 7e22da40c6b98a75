"""The final norm hsx applies to a pre-norm layer L: the weight read from the checkpoint (that tensor only),
the values as transformers' own norm module computes them, the refusals with their reasons."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hsx.backends.dumps import write_dump
from hsx.backends.final_norm import FinalNorm, NormUnavailable, load_final_norm
from hsx.dtypes import DTYPES
from hsx.storage.checkpoint import CheckpointUnreadable, read_tensor
from hsx.storage.safetensors_raw import read_index

HIDDEN = 64
EPS = 1e-6


def norm_module(dtype: torch.dtype, seed: int = 0) -> LlamaRMSNorm:
    g = torch.Generator().manual_seed(seed)
    module = LlamaRMSNorm(HIDDEN, eps=EPS)
    with torch.no_grad():
        module.weight.copy_(torch.randn(HIDDEN, generator=g) * 0.3 + 1)
    return module.to(dtype)


def raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(t.shape[0], -1)


def as_tensor(rows: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(rows.copy()).view(dtype).reshape(rows.shape[0], HIDDEN)


def checkpoint(folder, weight: torch.Tensor, *, model_type: str = "llama", sharded: bool = False, **config):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": model_type, "hidden_size": HIDDEN, "rms_norm_eps": EPS, **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    other = {"model.embed_tokens.weight": torch.zeros(8, HIDDEN, dtype=weight.dtype)}
    if sharded:
        save_file({"model.norm.weight": weight}, str(folder / "model-00002-of-00002.safetensors"))
        # The other shard is not even a safetensors file: only the norm's file is ever opened.
        (folder / "model-00001-of-00002.safetensors").write_bytes(b"not read")
        weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}
        weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file({**other, "model.norm.weight": weight}, str(folder / "model.safetensors"))
    return {"model_path": str(folder), "model_type": model_type, "hidden_size": HIDDEN, "rms_norm_eps": EPS}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_norm_is_the_models_own_norm_module(dtype):
    """bfloat16 and float16 within one unit in the last place of transformers' LlamaRMSNorm (they differ
    only where the float32 mean is summed in another order), float32 within 1e-6."""
    module = norm_module(dtype)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(500, HIDDEN, generator=g) * 4 + 1).to(dtype)
    norm = FinalNorm("ckpt", "f", "model.norm.weight", "sha", EPS, module.weight.detach().float().numpy())
    got = as_tensor(norm.apply(raw(x), DTYPES[str(dtype).removeprefix("torch.")]), dtype)
    want = module(x).detach()
    if dtype == torch.float32:
        assert float((got - want).abs().max()) <= 1e-6
    else:
        ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert bool(((got.float() - want.float()).abs() <= ulp).all())
        assert float((got == want).float().mean()) > 0.99


@pytest.mark.parametrize("sharded", [False, True], ids=["model.safetensors", "sharded"])
def test_the_weight_is_read_from_the_checkpoint_that_tensor_only(tmp_path, sharded):
    weight = torch.linspace(0.5, 1.5, HIDDEN).to(torch.bfloat16)
    model = checkpoint(tmp_path / "ckpt", weight, sharded=sharded)
    norm = load_final_norm(model)
    assert np.array_equal(norm.weight, weight.float().numpy()) and norm.eps == EPS
    described = norm.describe()
    assert described["applied_by"] == "hsx" and described["checkpoint"] == str(tmp_path / "ckpt")
    assert described["tensor"] == "model.norm.weight"
    assert described["sha256"] == hashlib.sha256(raw(weight[None, :]).tobytes()).hexdigest()


def test_a_staged_layer_is_normed_in_place(tmp_path):
    """The staged dump's layer L is rewritten where it lies: same dtype and size, the other layers untouched."""
    module = norm_module(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    aux, last = (torch.randn(9, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(2))
    meta = {"num_tokens": 9, "layers": [2, 8], "hidden_size": HIDDEN, "dtype": "bfloat16"}
    write_dump(tmp_path / "d", meta, [aux.view(torch.uint16).numpy(), last.view(torch.uint16).numpy()])
    before = (tmp_path / "d" / "hidden_states.safetensors").stat().st_size
    spans = read_index(tmp_path / "d" / "hidden_states.safetensors")
    FinalNorm("c", "f", "t", "s", EPS, module.weight.detach().float().numpy()).apply_in_place(spans["layer_8"])
    stored = load_file(str(tmp_path / "d" / "hidden_states.safetensors"))
    assert torch.equal(stored["layer_2"], aux) and torch.equal(stored["layer_8"], module(last).detach())
    assert (tmp_path / "d" / "hidden_states.safetensors").stat().st_size == before


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gemma"}, "only where it is transformers' Llama-style RMSNorm"),
        ({"model_type": "olmo2"}, "this model's type is olmo2"),
        ({"model_path": "/nowhere/model"}, "is not a folder readable where this worker runs"),
        ({"rms_norm_eps": None}, "gives no rms_norm_eps"),
        ({"hidden_size": HIDDEN * 2}, "not a float vector of the hidden size 128"),
    ],
)
def test_a_norm_hsx_cannot_apply_is_refused_with_the_reason(tmp_path, change, message):
    model = checkpoint(tmp_path / "ckpt", torch.ones(HIDDEN))
    with pytest.raises(NormUnavailable) as refused:
        load_final_norm({**model, **change})
    assert message in str(refused.value)


def test_a_checkpoint_without_the_norm_says_what_it_lacks(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"lm_head.weight": torch.ones(2, 2)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointUnreadable, match=r"holds none of model\.norm\.weight"):
        read_tensor(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointUnreadable, match=r"has neither model\.safetensors nor"):
        read_tensor(folder)
    model = {"model_path": str(folder), "model_type": "llama", "hidden_size": 2, "rms_norm_eps": 1e-5}
    with pytest.raises(NormUnavailable, match="make the checkpoint readable where this worker runs"):
        load_final_norm(model)

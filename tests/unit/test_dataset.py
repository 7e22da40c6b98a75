"""HiddenStateDataset: items built from shard rows, layer choice, per-worker handle cache, real HF layers."""

from __future__ import annotations

import pickle

import pytest
import safetensors.torch
import torch
from torch.utils.data import DataLoader

from hsx.layers import eagle3_capture_layers, select_layers
from hsx.training.dataset import HiddenStateDataset
from tests.support.jobs import LLAMA_LAYERS, llama_job, make_job, tiny_llama


@pytest.fixture
def job(tmp_path):
    return make_job(tmp_path, layers=[2, 4, 5, 8], hidden=16, dtype="bfloat16", num_samples=7, samples_per_shard=3)


def test_items_are_the_stored_rows_of_each_sample(job):
    ds = HiddenStateDataset(job.job_dir)
    assert len(ds) == 7 and ds.sample_ids == [s.id for s in job.samples]
    assert ds.aux_layers == [2, 4, 5] and ds.last_layer == 8
    assert ds.lengths == [int(s.input_ids.shape[0]) for s in job.samples]
    for k, s in enumerate(job.samples):
        item = ds[k]
        t = s.input_ids.shape[0]
        assert item["id"] == s.id
        assert item["input_ids"].dtype == torch.int64 and torch.equal(item["input_ids"], s.input_ids)
        assert item["loss_mask"].dtype == torch.int64 and torch.equal(item["loss_mask"], s.loss_mask)
        assert item["aux_hidden_state"].shape == (t, 3 * 16) and item["aux_hidden_state"].dtype == torch.bfloat16
        assert torch.equal(item["aux_hidden_state"], torch.cat([s.layers[2], s.layers[4], s.layers[5]], dim=-1))
        assert item["hidden_state"].shape == (t, 16) and torch.equal(item["hidden_state"], s.layers[8])
    assert ds[-1]["id"] == job.samples[-1].id
    with pytest.raises(IndexError):
        ds[7]


def test_manifest_path_layer_choice_and_dtype(job):
    ds = HiddenStateDataset(job.manifest_path, aux_layers=[5, 2], last_layer=4, dtype="float32")
    s = job.samples[3]
    item = ds[3]
    assert item["aux_hidden_state"].dtype == torch.float32 and item["hidden_state"].dtype == torch.float32
    assert torch.equal(item["aux_hidden_state"], torch.cat([s.layers[5], s.layers[2]], dim=-1).float())
    assert torch.equal(item["hidden_state"], s.layers[4].float())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"aux_layers": [2, 3, 5]}, r"aux layers \[3\] are not in the job's captured layers \[2, 4, 5, 8\]"),
        ({"last_layer": 7}, r"last layer 7 is not in the job's captured layers"),
        ({"aux_layers": [2, 4, 8]}, r"layer 8 is both an aux layer and the last layer"),
        ({"aux_layers": [2, 2, 4]}, r"repeats a layer"),
    ],
)
def test_layer_choice_errors(job, kwargs, message):
    with pytest.raises(ValueError, match=message):
        HiddenStateDataset(job.job_dir, **kwargs)


def test_other_last_layer_keeps_the_rest_as_aux(job):
    ds = HiddenStateDataset(job.job_dir, last_layer=5)
    assert ds.aux_layers == [2, 4, 8]
    assert torch.equal(ds[0]["hidden_state"], job.samples[0].layers[5])


def test_default_aux_needs_three_layers(tmp_path):
    job = make_job(tmp_path, layers=[2, 8], num_samples=2)
    with pytest.raises(ValueError, match="EAGLE-3 needs 3; choose them with aux_layers"):
        HiddenStateDataset(job.job_dir)
    ds = HiddenStateDataset(job.job_dir, aux_layers=[2])
    assert ds[0]["aux_hidden_state"].shape == (job.samples[0].input_ids.shape[0], 16)


def test_missing_manifest_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"no manifest\.json"):
        HiddenStateDataset(tmp_path)


def test_reads_slices_never_whole_shards(job, monkeypatch):
    """Every read goes through get_slice: the shard handles are replaced by ones that offer nothing else."""

    class SliceOnly:
        def __init__(self, inner):
            self._inner = inner

        def get_slice(self, key):
            calls.append(key)
            return self._inner.get_slice(key)

    calls: list[str] = []
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("a shard was loaded whole"))
    ds = HiddenStateDataset(job.job_dir)
    real_handle = ds.reader.handle
    monkeypatch.setattr(ds.reader, "handle", lambda shard: SliceOnly(real_handle(shard)))
    assert [ds[k]["id"] for k in range(len(ds))] == ds.sample_ids
    assert calls[:5] == ["input_ids", "loss_mask", "layer_2", "layer_4", "layer_5"]


def test_handle_cache_is_small_and_per_process(job):
    ds = HiddenStateDataset(job.job_dir, max_open_shards=2)
    for k in range(len(ds)):
        ds[k]
    assert ds.reader.open_shards() == ["shard-000001.safetensors", "shard-000002.safetensors"]
    clone = pickle.loads(pickle.dumps(ds))  # what a spawned DataLoader worker receives
    assert clone.reader.open_shards() == []
    assert torch.equal(clone[4]["hidden_state"], ds[4]["hidden_state"])


def test_dataloader_with_forked_workers(job):
    ds = HiddenStateDataset(job.job_dir)
    ds[0]  # the parent holds a handle before the workers fork
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    seen = {item["id"]: item for item in loader}
    assert sorted(seen) == sorted(ds.sample_ids)
    for s in job.samples:
        assert torch.equal(seen[s.id]["hidden_state"], s.layers[8])


def test_real_model_layers_map_to_hf_hidden_states(tmp_path):
    """hsx layer k is transformers' hidden_states[k]; the last one is the decoder output after the final norm."""
    model = tiny_llama()
    job, hidden = llama_job(tmp_path, model, layers=eagle3_capture_layers(LLAMA_LAYERS))
    assert job.manifest.layers == [2, 4, 5, 8]
    ds = HiddenStateDataset(job.job_dir)
    pre_norm = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda mod, args, out: pre_norm.__setitem__("x", out[0] if isinstance(out, tuple) else out)
    )
    try:
        for k, hs in enumerate(hidden):
            item = ds[k]
            assert torch.equal(item["aux_hidden_state"], torch.cat([hs[2], hs[4], hs[5]], dim=-1))
            assert torch.equal(item["hidden_state"], hs[LLAMA_LAYERS])
            with torch.inference_mode():
                model(item["input_ids"][None])
            x = pre_norm["x"][0]
            assert torch.allclose(model.model.norm(x), item["hidden_state"], atol=1e-6)
            assert not torch.allclose(x, item["hidden_state"], atol=1e-2)
    finally:
        hook.remove()


def test_select_layers_helper():
    assert select_layers([8, 2, 5, 4]) == ([2, 4, 5], 8)
    assert eagle3_capture_layers(32) == [2, 16, 29, 32]

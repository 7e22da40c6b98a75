"""Exports read back the way each target's own reader reads them.

The `read_*` helpers below follow the targets' loading code (at the commits named in each):
SpecForge's `list_local_files` + `OfflineEagle3Dataset` (specforge/data/preprocessing.py), Model
Optimizer's offline loader (examples/speculative_decoding/eagle_utils.py rglob("*.pt") +
`OfflineSupervisedDataset`, modelopt/torch/speculative/eagle/utils.py), and speculators'
`FileTransfer.get_cached` (hs_connectors/transfer.py) + `ArrowDataset._get_raw_data`
(src/speculators/train/data.py).
"""

from __future__ import annotations

import inspect
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from safetensors.torch import save as safetensors_save

from hsx.cli import main as hsx
from hsx.exports import TARGETS, export_job, exporter_class, speculators
from hsx.exports.base import RECORD_NAME, ExportRefused
from tests.support.jobs import LLAMA_LAYERS, llama_job, make_job, tiny_llama

L = LLAMA_LAYERS


# --- the targets' readers -------------------------------------------------------------------------


def read_specforge(root: Path, max_len: int = 2048) -> dict[int, dict]:
    """SpecForge: walk for *.ckpt, sort the paths, torch.load each (mmap) and squeeze the batch dim."""
    paths = sorted(
        os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith((".ckpt", ".ckpt.gz"))
    )
    out = {}
    for path in paths:
        data = torch.load(path, weights_only=True, mmap=True)  # weights_only: plain tensors only
        assert set(data) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        item = {
            "raw": data,
            "hidden_state": data["aux_hidden_state"].squeeze(0)[:max_len][None, :],  # the drafter's input
            "target": data["hidden_state"].squeeze(0)[:max_len][None, :],
            "input_ids": data["input_ids"][:max_len][None, :],
            "loss_mask": data["loss_mask"][:max_len][None, :].clone(),
        }
        out[int(re.fullmatch(r"data_(\d+)\.ckpt", os.path.basename(path)).group(1))] = item
    return out


def read_modelopt(root: Path) -> dict[str, dict]:
    """Model Optimizer: every **/*.pt, torch.load(weights_only=True), answer-only-loss mask from the file."""
    out = {}
    for path in [str(p) for p in Path(root).rglob("*.pt")]:
        data = torch.load(path, weights_only=True)
        labels = torch.full_like(data["input_ids"], -100)
        labels[..., :-1] = data["input_ids"][..., 1:]
        out[data["conversation_id"]] = {
            "path": path,
            "raw": data,
            "input_ids": data["input_ids"],
            "base_model_hidden_states": data["hidden_states"],
            "aux_hidden_states": data["aux_hidden_states"],
            "loss_mask": data["loss_mask"].to(data["input_ids"].dtype),
            "labels": labels,
            "base_hidden_prenorm": bool(data.get("hidden_states_prenorm", False)),
        }
    return out


def read_speculators(root: Path) -> dict[int, dict]:
    """speculators: hs_<idx>.safetensors by dataset row; loss_mask from the dataset row (hsx_samples.jsonl)."""
    rows = [json.loads(line) for line in (root / "hsx_samples.jsonl").read_text().splitlines()]
    indices = sorted(
        int(p.stem[3:])
        for p in (root / "hidden_states").iterdir()
        if p.name.startswith("hs_") and p.name.endswith(".safetensors")
    )
    assert indices == [r["index"] for r in rows] == list(range(len(rows)))
    out = {}
    for idx in indices:
        loaded = load_file(root / "hidden_states" / f"hs_{idx}.safetensors")
        assert set(loaded) == {"hidden_states", "token_ids"}
        row = rows[idx]
        assert torch.equal(loaded["token_ids"], torch.tensor(row["input_ids"]))
        assert loaded["hidden_states"].shape[0] == row["seq_len"] == len(row["loss_mask"])
        out[idx] = {
            "raw": loaded,
            "id": row["id"],
            "hidden_states": loaded["hidden_states"][:, :-1].flatten(1),
            "input_ids": loaded["token_ids"],
            "verifier_last_hidden_states": loaded["hidden_states"][:, -1],
            "loss_mask": torch.tensor(row["loss_mask"]),
        }
    return out


def mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
def job(tmp_path):
    return make_job(tmp_path, layers=[2, 4, 5, 8], hidden=16, dtype="bfloat16", num_samples=5, samples_per_shard=2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    model = tiny_llama()
    model.save_pretrained(root / "checkpoint")
    job, hidden = llama_job(root, model)
    return model, root / "checkpoint", job, hidden


# --- SpecForge -------------------------------------------------------------------------------------


def test_specforge_layout_and_values(job, tmp_path):
    out = tmp_path / "sf"
    result = export_job("specforge", job.job_dir, out, group_size=2)
    assert (result.written, result.skipped, result.total) == (5, 0, 5)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["rows_0-2", "rows_2-4", "rows_4-6"]
    assert sorted(p.name for p in (out / "rows_2-4").iterdir()) == ["data_2.ckpt", "data_3.ckpt"]
    items = read_specforge(out)
    assert sorted(items) == list(range(5))
    for idx, s in enumerate(job.samples):
        raw, t = items[idx]["raw"], s.input_ids.shape[0]
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.int64
        assert raw["input_ids"].shape == raw["loss_mask"].shape == (t,)
        assert raw["hidden_state"].shape == (1, t, 16) and raw["hidden_state"].dtype == torch.bfloat16
        assert raw["aux_hidden_state"].shape == (1, t, 48) and raw["aux_hidden_state"].dtype == torch.bfloat16
        assert torch.equal(items[idx]["input_ids"][0], s.input_ids)
        assert torch.equal(items[idx]["loss_mask"][0], s.loss_mask)
        assert torch.equal(items[idx]["target"][0], s.layers[8])
        assert torch.equal(items[idx]["hidden_state"][0], torch.cat([s.layers[2], s.layers[4], s.layers[5]], -1))
        # a saved view would carry its whole storage: each file holds just its sample
        assert raw["aux_hidden_state"].untyped_storage().nbytes() == t * 48 * 2


def test_specforge_real_model_is_post_norm_last_layer(llama, tmp_path):
    model, _, job, hidden = llama
    result = export_job("specforge", job.job_dir, tmp_path / "sf")
    assert any("aux_hidden_state_layer_ids [1, 3, 4], its default" in n for n in result.notes)
    assert sorted(p.name for p in (tmp_path / "sf").iterdir() if p.is_dir()) == ["rows_0-2000"]
    items = read_specforge(tmp_path / "sf")
    for idx, hs in enumerate(hidden):
        # SpecForge's target: the final hidden state after the norm = transformers' hidden_states[-1]
        assert torch.equal(items[idx]["target"][0], hs[-1])
        # its aux layers [1, L//2-1, L-4] are decoder outputs = hidden_states[lid + 1]
        aux = torch.cat([hs[lid + 1] for lid in (1, L // 2 - 1, L - 4)], dim=-1)
        assert torch.equal(items[idx]["hidden_state"][0], aux)
        with torch.inference_mode():
            logits = model(items[idx]["input_ids"]).logits[0]
        assert torch.allclose(model.lm_head(items[idx]["target"][0]), logits, atol=1e-5)


# --- Model Optimizer --------------------------------------------------------------------------------


def test_modelopt_layout_and_values(tmp_path):
    job = make_job(tmp_path, num_samples=3, ids=["conv-1", "a/b c", "../x"], dtype="float16")
    out = tmp_path / "mo"
    export_job("modelopt", job.job_dir, out)
    names = sorted(p.name for p in out.glob("*.pt"))
    assert "conv-1.pt" in names and all("/" not in n and not n.startswith(".") for n in names) and len(names) == 3
    items = read_modelopt(out)
    assert sorted(items) == sorted(s.id for s in job.samples)
    for s in job.samples:
        it, t = items[s.id], s.input_ids.shape[0]
        assert set(it["raw"]) == {
            "input_ids",
            "hidden_states",
            "aux_hidden_states",
            "loss_mask",
            "conversation_id",
            "hidden_states_prenorm",
        }
        assert it["input_ids"].dtype == torch.int64 and torch.equal(it["input_ids"], s.input_ids)
        assert torch.equal(it["loss_mask"], s.loss_mask)
        assert it["base_model_hidden_states"].shape == (t, 16) and it["base_model_hidden_states"].dtype == torch.float16
        assert torch.equal(it["base_model_hidden_states"], s.layers[8])
        assert torch.equal(it["aux_hidden_states"], torch.cat([s.layers[2], s.layers[4], s.layers[5]], -1))
        assert it["base_hidden_prenorm"] is False
        assert torch.equal(it["labels"][:-1], s.input_ids[1:])


def test_modelopt_real_model_aux_convention(llama, tmp_path):
    _, _, job, hidden = llama
    export_job("modelopt", job.job_dir, tmp_path / "mo")
    items = read_modelopt(tmp_path / "mo")
    aux_ids = sorted({1, max(0, L // 2 - 1), max(0, L - 4)})  # Model Optimizer's default, read as [lid + 1]
    for k, hs in enumerate(hidden):
        it = items[f"conv-{k}"]
        assert torch.equal(it["base_model_hidden_states"], hs[-1])
        assert torch.equal(it["aux_hidden_states"], torch.cat([hs[lid + 1] for lid in aux_ids], dim=-1))


# --- speculators ------------------------------------------------------------------------------------


def test_speculators_refuses_a_post_norm_last_layer(job, tmp_path):
    with pytest.raises(ExportRefused, match="norm would be applied twice"):
        export_job("speculators", job.job_dir, tmp_path / "sp")
    assert not (tmp_path / "sp").exists()


def test_speculators_real_model_with_final_norm_undone(llama, tmp_path):
    model, checkpoint, job, hidden = llama
    out = tmp_path / "sp"
    export_job("speculators", job.job_dir, out, final_norm_weight=checkpoint)
    items = read_speculators(out)
    for idx, hs in enumerate(hidden):
        it = items[idx]
        assert it["id"] == f"conv-{idx}"
        assert it["raw"]["hidden_states"].shape == (hs[0].shape[0], 4, 32)
        assert it["raw"]["token_ids"].dtype == torch.int64
        assert torch.equal(it["hidden_states"], torch.cat([hs[2], hs[4], hs[5]], dim=-1))
        # the trainer applies the verifier's final norm itself: that must give hidden_states[-1] back
        with torch.no_grad():
            renormed = model.model.norm(it["verifier_last_hidden_states"])
        assert torch.allclose(renormed, hs[-1], atol=1e-5)
        assert torch.equal(it["loss_mask"], job.samples[idx].loss_mask)


def test_speculators_refuses_a_norm_that_does_not_fit(llama, tmp_path):
    _, checkpoint, job, _ = llama
    with pytest.raises(ExportRefused, match=r"has RMS .* not 1"):
        export_job("speculators", job.job_dir, tmp_path / "sp", final_norm_weight=checkpoint, final_norm_offset=1.0)
    assert not (tmp_path / "sp").exists()  # refused on the first sample's rows, before anything was written
    with pytest.raises(ExportRefused, match="no tensor named nope"):
        export_job("speculators", job.job_dir, tmp_path / "sp2", final_norm_weight=checkpoint, final_norm_key="nope")


# --- what the manifest says about the model -------------------------------------------------------------


def test_an_older_manifest_without_the_model_conventions_still_exports(job, tmp_path):
    doc = json.loads(job.manifest_path.read_text())
    del doc["post_norm_layers"]
    doc["model"] = {"model_path": "tiny", "num_hidden_layers": 8, "vocab_size": 1000}  # what hsx wrote before
    job.manifest_path.write_text(json.dumps(doc))
    # hsx's numbering then says which layer is after the final norm: L
    assert export_job("specforge", job.job_dir, tmp_path / "sf").written == 5
    assert export_job("modelopt", job.job_dir, tmp_path / "mo").written == 5
    with pytest.raises(ExportRefused, match="norm would be applied twice"):
        export_job("speculators", job.job_dir, tmp_path / "sp")


def test_exports_take_the_post_norm_layers_from_the_manifest(tmp_path):
    # A manifest saying that layer L was taken before the final norm.
    job = make_job(tmp_path, num_samples=3, model={"model_type": "llama"}, post_norm_layers=[])
    for target in ("specforge", "modelopt"):
        with pytest.raises(ExportRefused, match=r"post_norm_layers \[\] say it is not"):
            export_job(target, job.job_dir, tmp_path / target)
    # speculators wants L before the norm: stored as it is, no final norm weight needed
    result = export_job("speculators", job.job_dir, tmp_path / "sp")
    assert any("before the final norm" in n for n in result.notes)
    for idx, s in enumerate(job.samples):
        assert torch.equal(read_speculators(tmp_path / "sp")[idx]["verifier_last_hidden_states"], s.layers[8])


def test_speculators_takes_the_norm_offset_from_the_model_type(tmp_path):
    model = tiny_llama()
    weight = model.model.norm.weight.detach().clone()
    # A Gemma-style checkpoint stores the norm weight centred on 0 and scales by 1 + weight.
    centred = tmp_path / "centred-norm.safetensors"
    save_file({"model.norm.weight": weight - 1}, centred)
    gemma, hidden = llama_job(tmp_path / "gemma", model, model={"model_type": "gemma2"}, post_norm_layers=[8])
    result = export_job("speculators", gemma.job_dir, tmp_path / "sp", final_norm_weight=centred)
    assert any("offset 1" in n for n in result.notes)
    for idx, hs in enumerate(hidden):
        last = read_speculators(tmp_path / "sp")[idx]["verifier_last_hidden_states"]
        with torch.no_grad():
            renormed = last / last.pow(2).mean(-1, keepdim=True).add(model.config.rms_norm_eps).sqrt() * weight
        assert torch.allclose(renormed, hs[-1], atol=1e-5)
    # the same weights for a model type with a plain norm: the offset is 0, and the rows say it is wrong
    plain, _ = llama_job(tmp_path / "plain", model, model={"model_type": "llama"}, post_norm_layers=[8])
    with pytest.raises(ExportRefused, match=r"has RMS .* not 1"):
        export_job("speculators", plain.job_dir, tmp_path / "sp2", final_norm_weight=centred)
    # an explicit offset wins over the model type's
    assert export_job("speculators", plain.job_dir, tmp_path / "sp3", final_norm_weight=centred, final_norm_offset=1)


# --- resume, atomicity, refusal ---------------------------------------------------------------------


@pytest.mark.parametrize("target", ["specforge", "modelopt"])
def test_rerun_rewrites_nothing_and_fills_gaps(job, tmp_path, target):
    out = tmp_path / target
    export_job(target, job.job_dir, out)
    before = mtimes(out)
    again = export_job(target, job.job_dir, out)
    assert (again.written, again.skipped) == (0, 5)
    assert mtimes(out) == before
    # an interrupted run: one file missing, one temporary file left behind
    victim = next(p for p in out.rglob("*") if p.suffix in (".ckpt", ".pt"))
    victim.unlink()
    stale = victim.with_name(f".{victim.name}.tmp-12345-67890")  # a process's and a thread's id
    older = victim.with_name(f".{victim.name}.tmp-12345")  # as earlier versions named them
    stale.write_bytes(b"partial")
    older.write_bytes(b"partial")
    third = export_job(target, job.job_dir, out)
    assert (third.written, third.skipped) == (1, 4)
    assert not stale.exists() and not older.exists() and victim.exists()
    after = mtimes(out)
    assert {k for k in after if after[k] != before.get(k)} == {str(victim.relative_to(out))}
    record = json.loads((out / RECORD_NAME).read_text())
    assert record["complete"] is True and record["job_id"] == job.manifest.job_id and len(record["files"]) == 5


@pytest.mark.parametrize(
    "target, layers, options, message",
    [
        ("specforge", [3, 4, 5, 8], {}, r"needs layers \[2, 4, 5, 8\].*captured \[3, 4, 5, 8\], without \[2\]"),
        ("modelopt", [2, 4, 5], {}, r"without \[8\]"),
        ("modelopt", [2, 4, 5, 7], {}, r"without \[8\]"),  # the highest captured layer is not L
        ("specforge", [2, 4, 5, 8], {"aux_layers": [2, 4]}, r"exactly three distinct aux layers"),
        ("specforge", [2, 4, 5, 8], {"num_layers": 7}, r"contradicts the manifest's model.num_hidden_layers 8"),
        ("speculators", [2, 4, 6, 8], {}, r"without \[5\]"),
    ],
)
def test_refuses_layers_that_do_not_fit(tmp_path, target, layers, options, message):
    job = make_job(tmp_path, layers=layers, num_samples=2)
    with pytest.raises(ExportRefused, match=message):
        export_job(target, job.job_dir, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_number_of_layers_from_the_flag_when_the_manifest_lacks_it(tmp_path):
    job = make_job(tmp_path, num_hidden_layers=None, num_samples=2)
    with pytest.raises(ExportRefused, match="pass --num-layers"):
        export_job("specforge", job.job_dir, tmp_path / "a")
    assert export_job("specforge", job.job_dir, tmp_path / "a", num_layers=8).written == 2


def test_custom_aux_layers(tmp_path):
    job = make_job(tmp_path, layers=[3, 4, 6, 8], num_samples=2)
    with pytest.raises(ExportRefused):
        export_job("specforge", job.job_dir, tmp_path / "sf")
    result = export_job("specforge", job.job_dir, tmp_path / "sf", aux_layers=[3, 4, 6])
    assert any("aux_hidden_state_layer_ids [2, 3, 5]; set" in n for n in result.notes)
    s = job.samples[1]
    assert torch.equal(
        read_specforge(tmp_path / "sf")[1]["hidden_state"][0], torch.cat([s.layers[3], s.layers[4], s.layers[6]], -1)
    )


def test_output_folder_must_be_empty_or_the_same_export(job, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data_0.ckpt").write_bytes(b"not ours")
    with pytest.raises(ExportRefused, match="not empty"):
        export_job("specforge", job.job_dir, foreign)
    out = tmp_path / "out"
    export_job("specforge", job.job_dir, out)
    with pytest.raises(ExportRefused, match="other settings"):
        export_job("specforge", job.job_dir, out, group_size=3)
    with pytest.raises(ExportRefused, match="holds a specforge export of job job_test"):
        export_job("modelopt", job.job_dir, out)
    with pytest.raises(ExportRefused, match="job folder"):
        export_job("modelopt", job.job_dir, job.job_dir)


# --- the bytes: as the targets' own writers write them, whatever the workers ---------------------------


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def saved(obj: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_files_are_what_torch_save_and_safetensors_write(tmp_path):
    """Each file, byte for byte, is what the target's own writer makes of the plain tensors (a cat, a
    stack, a clone: what the exports wrote before they wrote from the mapped shards)."""
    job = make_job(tmp_path, layers=[2, 4, 5, 8], dtype="float16", num_samples=5, samples_per_shard=2)
    export_job("specforge", job.job_dir, tmp_path / "sf", group_size=2)
    export_job("modelopt", job.job_dir, tmp_path / "mo", aux_layers=[4])
    for idx, s in enumerate(job.samples):
        specforge = {
            "input_ids": s.input_ids.clone(),
            "loss_mask": s.loss_mask.clone(),
            "aux_hidden_state": torch.cat([s.layers[2], s.layers[4], s.layers[5]], -1).unsqueeze(0),
            "hidden_state": s.layers[8].clone().unsqueeze(0),
        }
        assert (tmp_path / "sf" / f"rows_{idx // 2 * 2}-{idx // 2 * 2 + 2}" / f"data_{idx}.ckpt").read_bytes() == saved(
            specforge
        )
        modelopt = {
            "input_ids": s.input_ids.clone(),
            "hidden_states": s.layers[8].clone(),
            "aux_hidden_states": s.layers[4].clone(),  # one aux layer: itself, no concatenation
            "loss_mask": s.loss_mask.clone(),
            "conversation_id": s.id,
            "hidden_states_prenorm": False,
        }
        assert (tmp_path / "mo" / f"{s.id}.pt").read_bytes() == saved(modelopt)
    prenorm = make_job(tmp_path / "pre", num_samples=3, model={"model_type": "llama"}, post_norm_layers=[])
    export_job("speculators", prenorm.job_dir, tmp_path / "sp")
    for idx, s in enumerate(prenorm.samples):
        expected = {"hidden_states": torch.stack([s.layers[i] for i in (2, 4, 5, 8)], 1), "token_ids": s.input_ids}
        assert (tmp_path / "sp" / "hidden_states" / f"hs_{idx}.safetensors").read_bytes() == safetensors_save(expected)


def test_speculators_scaled_last_layer_is_what_safetensors_writes(llama, tmp_path, monkeypatch):
    model, checkpoint, job, _ = llama
    # blocks of 2 rows: a sample's hidden_states are put together in several pieces
    monkeypatch.setattr(speculators, "BLOCK_BYTES", 2 * 4 * 32 * 4)
    export_job("speculators", job.job_dir, tmp_path / "sp", final_norm_weight=checkpoint)
    scale = model.model.norm.weight.detach().to(torch.float32)
    for idx, s in enumerate(job.samples):
        last = (s.layers[8].to(torch.float32) / scale).to(s.layers[8].dtype)
        expected = {
            "hidden_states": torch.stack([s.layers[2], s.layers[4], s.layers[5], last], 1),
            "token_ids": s.input_ids,
        }
        assert (tmp_path / "sp" / "hidden_states" / f"hs_{idx}.safetensors").read_bytes() == safetensors_save(expected)


@pytest.mark.parametrize("target", ["specforge", "modelopt", "speculators"])
def test_workers_write_the_same_files_byte_for_byte(tmp_path, target):
    job = make_job(tmp_path, num_samples=9, samples_per_shard=2, model={"model_type": "llama"}, post_norm_layers=[8])
    options = {"final_norm_weight": tmp_path / "norm.safetensors"} if target == "speculators" else {}
    if target == "speculators":
        # a final norm that the stored last layer fits: its rows divided by it have RMS 1
        save_file({"model.norm.weight": rms_scale(job)}, tmp_path / "norm.safetensors")
    seen: list[tuple[int, int]] = []
    one = export_job(target, job.job_dir, tmp_path / "one", workers=1, **options)
    three = export_job(
        target, job.job_dir, tmp_path / "three", workers=3, progress=lambda *a: seen.append(a), **options
    )
    assert (one.written, three.written) == (9, 9)
    one_files, three_files = files(tmp_path / "one"), files(tmp_path / "three")
    assert len(one_files) >= 10 and one_files == three_files  # the record too: same job, same settings
    # one call per chunk (one shard's samples), counts rising to the total
    assert [total for _, total in seen] == [9] * 5
    assert [done for done, _ in seen] == sorted(done for done, _ in seen) and seen[-1] == (9, 9)
    assert not list((tmp_path / "three").rglob(".*.tmp-*"))


def test_workers_resume_where_a_run_stopped(job, tmp_path):
    out = tmp_path / "sf"
    export_job("specforge", job.job_dir, out, workers=2)
    gone = sorted(out.rglob("data_*.ckpt"))[1:4]
    for p in gone:
        p.unlink()
    seen: list[tuple[int, int]] = []
    again = export_job("specforge", job.job_dir, out, workers=2, progress=lambda *a: seen.append(a))
    assert (again.written, again.skipped) == (3, 2)
    assert seen[-1] == (5, 5) and all(done > 2 for done, _ in seen)
    assert all(p.exists() for p in gone) and len(read_specforge(out)) == 5


def rms_scale(job) -> torch.Tensor:
    """A final norm weight under which every stored row of layer 8 has RMS 1 once divided by it: the
    rows' RMS is about that of the random data, so scale all of them to RMS 1 by a common weight."""
    rows = torch.cat([s.layers[8].to(torch.float32) for s in job.samples])
    return rows.pow(2).mean().sqrt() * torch.ones(rows.shape[1])


def test_a_refusal_in_a_worker_stops_the_export(llama, tmp_path):
    model, checkpoint, _, _ = llama
    job, _ = llama_job(tmp_path / "job", model)
    # the last sample's layer 8 no longer fits the final norm: the refusal comes from the worker that
    # writes it (the check before anything is written looks at the first sample only)
    job.set_value(job.samples[-1].id, 8, 1, 0, 1000.0)
    out = tmp_path / "sp"
    with pytest.raises(ExportRefused, match=r"sample 'conv-2' row 1: .* has RMS"):
        export_job("speculators", job.job_dir, out, final_norm_weight=checkpoint, workers=2)
    assert not list(out.rglob(".*.tmp-*"))
    assert not (out / "hidden_states" / "hs_2.safetensors").exists()
    assert json.loads((out / RECORD_NAME).read_text())["complete"] is False
    assert hsx(["export", "speculators", str(job.job_dir), str(out), "--final-norm-weight", str(checkpoint)]) == 1


# --- command line ------------------------------------------------------------------------------------


def test_cli_export_and_refusal(job, tmp_path, capsys):
    assert hsx(["export", "modelopt", str(job.manifest_path), str(tmp_path / "mo"), "--workers", "2"]) == 0
    assert "5 files written" in capsys.readouterr().out
    assert len(read_modelopt(tmp_path / "mo")) == 5
    with pytest.raises(SystemExit) as exc:
        hsx(["export", "modelopt", str(job.manifest_path), str(tmp_path / "mo0"), "--workers", "0"])
    assert exc.value.code == 2 and "must be at least 1" in capsys.readouterr().err
    assert hsx(["export", "speculators", str(job.job_dir), str(tmp_path / "sp")]) == 1
    assert "refused" in capsys.readouterr().err
    assert hsx(["export", "specforge", str(tmp_path / "nowhere"), str(tmp_path / "sf")]) == 1
    assert "no manifest.json" in capsys.readouterr().err


def test_cli_progress_with_workers_counts_every_file(tmp_path, capsys, monkeypatch):
    job = make_job(tmp_path, num_samples=9, samples_per_shard=2)
    monkeypatch.setenv("HSX_PROGRESS_INTERVAL_S", "0.001")  # a log line at once (stderr is not a terminal)
    assert hsx(["export", "specforge", str(job.job_dir), str(tmp_path / "sf"), "--workers", "3"]) == 0
    err = capsys.readouterr().err.splitlines()
    counts = [int(m.group(1)) for line in err if (m := re.match(r"hsx export specforge: (\d+)/9 files", line))]
    assert counts and counts == sorted(counts) and counts[-1] == 9 and "(100%)" in err[-1]


def test_cli_speculators_with_checkpoint(llama, tmp_path, capsys):
    _, checkpoint, job, hidden = llama
    args = ["export", "speculators", str(job.job_dir), str(tmp_path / "sp"), "--final-norm-weight", str(checkpoint)]
    assert hsx(args) == 0
    assert "3 files written" in capsys.readouterr().out
    assert len(read_speculators(tmp_path / "sp")) == len(hidden)
    assert hsx(args) == 0
    assert "0 files written, 3 already complete" in capsys.readouterr().out


def test_cli_modules_stay_light():
    code = "import sys, hsx.cli.export, hsx.cli.verify; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_each_targets_options_are_its_exporters_keyword_arguments(name):
    """`hsx export` builds its flags from TARGETS: each option is a keyword argument of the target's exporter,
    with the same default, and the exporter takes no other."""
    exporter = exporter_class(name)
    assert exporter.target == name
    taken = {
        p.name: p.default
        for p in inspect.signature(exporter.__init__).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert taken == {o.name: o.default for o in TARGETS[name].all_options}
    flags = {a.dest for a in _export_parser(name)._actions}
    assert {o.name for o in TARGETS[name].all_options} <= flags


def _export_parser(name: str):
    """The parser of `hsx export NAME`, as hsx builds it."""
    import argparse

    from hsx.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    targets = next(a for a in commands.choices["export"]._actions if isinstance(a, argparse._SubParsersAction))
    return targets.choices[name]

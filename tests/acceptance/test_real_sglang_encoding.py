"""A job's encoding against a real SGLang 0.5.23 in plugin mode, a bfloat16 checkpoint served in
bfloat16: the same samples stored raw, lossless and fp8 by one service, one request in flight (so the
server computes each sample the same way every time). The lossless job's tensors, as every reader
decodes them (the Dataset, the tensor route, verify), are the raw job's bit for bit in fewer bytes;
the fp8 job's lie within the bound its manifest records. And a training loop that follows a job from its
first shard reads each sample once, before the job ends, as stored."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from hsx.manifest import load_manifest
from hsx.sdk import HsxClient
from hsx.training import HiddenStateDataset, HiddenStateStream
from hsx.verify import verify_job
from tests.support.real_sglang import AUX, PLUGIN_FLAGS, SGLang, check_stored, make_items, sglang_python
from tests.support.stack import start_service
from tests.support.tiny_llama import NUM_LAYERS, make_model

pytestmark = pytest.mark.slow  # one real SGLang for the module: 30-95 s to start

LAYERS = [*AUX, NUM_LAYERS]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("model")
    return path, make_model(path, "bfloat16")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model: tuple[Path, torch.nn.Module]) -> Iterator[SGLang]:
    tmp = tmp_path_factory.mktemp("sglang")
    env = {"SGLANG_PLUGINS": "hsx_dump", "HSX_DUMP_ROOT": str(tmp / "dumps")}
    s = SGLang(sglang_python(), tmp, model[0], PLUGIN_FLAGS, env, dtype="bfloat16").start()
    yield s
    s.stop()


def test_a_lossless_job_reads_back_as_the_raw_job_bit_for_bit(tmp_path, server, model):
    svc = start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=server.url,
        dump_root=Path(server.env["HSX_DUMP_ROOT"]),
        extra=["--max-in-flight", "1"],
    )
    items = make_items(16, seed=5)
    try:
        jobs = {}
        for encoding in ("raw", "lossless", "fp8"):
            body = {"samples": items} | ({} if encoding == "raw" else {"encoding": encoding})
            created = svc.post_job(body).json()
            assert created["options"]["encoding"] == encoding
            jobs[encoding] = svc.wait_job(created["id"], timeout=600)
        # the raw job is the model's own hidden states (bfloat16 arithmetic: within its rounding)
        check_stored(svc, model[1], jobs["raw"], items, LAYERS, "bfloat16")
        folders = {enc: svc.output_root / job["id"] for enc, job in jobs.items()}
        manifests = {enc: load_manifest(folder) for enc, folder in folders.items()}
        sizes = {enc: sum(s.bytes for s in m.shards) for enc, m in manifests.items()}
        ratios = {enc: round(sizes[enc] / sizes["raw"], 3) for enc in ("lossless", "fp8")}
        print(f"shard bytes: {sizes}, of the raw job's: {ratios}")
        assert sizes["lossless"] < sizes["raw"] and sizes["fp8"] < sizes["raw"]
        for enc in ("lossless", "fp8"):
            assert manifests[enc].encoding == enc and manifests[enc].dtype == "bfloat16"
            assert [e.layer for e in manifests[enc].encoded_layers] == LAYERS
            report = verify_job(folders[enc])
            assert report.ok and report.summary["samples_read"] == len(items), report.to_dict()

        raw, lossless, fp8 = (HiddenStateDataset(folders[enc]) for enc in ("raw", "lossless", "fp8"))
        assert raw.sample_ids == lossless.sample_ids == fp8.sample_ids == [s["id"] for s in items]
        for a, b, c in zip(raw, lossless, fp8):
            for key in ("input_ids", "loss_mask"):
                assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key])
            for key in ("aux_hidden_state", "hidden_state"):
                assert torch.equal(a[key].view(torch.int16), b[key].view(torch.int16)), (a["id"], key)
                assert c[key].dtype == torch.bfloat16
        for e in manifests["fp8"].encoded_layers:
            assert 0 < e.mean_error < e.max_error <= 1 / 28 + 2**-7
        for s in items[:4]:
            got = {}
            for enc in ("raw", "lossless"):
                answer = svc.get(f"/v1/jobs/{jobs[enc]['id']}/tensors/{s['id']}")
                assert answer.status_code == 200
                got[enc] = load(answer.content)
            assert (
                got["raw"].keys()
                == got["lossless"].keys()
                == {"input_ids", "loss_mask"} | {f"layer_{i}" for i in LAYERS}
            )
            for key, tensor in got["raw"].items():
                assert torch.equal(tensor.view(torch.uint8), got["lossless"][key].view(torch.uint8)), key
    finally:
        svc.stop()


def test_a_trainer_follows_a_real_sglang_job_from_its_first_shard(tmp_path, server, model):
    """A small training loop (a linear layer from the aux hidden states to the last one) started with the
    job reads each sample once, its first batch before the job ends, every item the tensor the job
    stored, which is the model's own (bfloat16 arithmetic: within its rounding)."""
    sample_bytes = 80 * (len(LAYERS) * 256 * 2 + 16)  # the longest sample: four bf16 layers of hidden 256
    svc = start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=server.url,
        dump_root=Path(server.env["HSX_DUMP_ROOT"]),
        extra=["--shard-max-bytes", str(3 * sample_bytes), "--shard-max-wait-s", "1"],
    )
    items = make_items(24, seed=8)
    try:
        with HsxClient(svc.url) as hsx:
            job = hsx.create_job(items, options={"consumers": ["fit"]})
            stream = HiddenStateStream(hsx, job.id, consumer="fit", expect={"layers": "eagle3"}, wait_s=5)
            torch.manual_seed(0)
            fit = torch.nn.Linear(3 * 256, 256)
            optimizer = torch.optim.SGD(fit.parameters(), lr=1e-2)
            seen, losses, first_at = [], [], None
            for step, item in enumerate(stream, start=1):
                first_at = first_at or datetime.now(timezone.utc)
                loss = torch.nn.functional.mse_loss(fit(item["aux_hidden_state"].float()), item["hidden_state"].float())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                seen.append(item)
                losses.append(loss.item())
                if step % 6 == 0:
                    stream.ack()
            stream.ack()
            done = hsx.get_job(job)
            assert hsx.consumer(job, "fit").read_seq == hsx.list_shards(job).committed > 1
        assert done.state == "succeeded" and first_at < done.finished_at  # it trained before the job ended
        assert sorted(it["id"] for it in seen) == sorted(s["id"] for s in items)
        assert all(torch.isfinite(torch.tensor(losses))), losses
        check_stored(svc, model[1], svc.get(f"/v1/jobs/{job.id}").json(), items, LAYERS, "bfloat16")
        stored = {it["id"]: it for it in HiddenStateDataset(svc.output_root / job.id)}
        for it in seen:
            for key in ("input_ids", "aux_hidden_state", "hidden_state"):
                assert torch.equal(it[key], stored[it["id"]][key]), (it["id"], key)
    finally:
        svc.stop()

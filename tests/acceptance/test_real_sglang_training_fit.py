"""Training data fit for its trainer, against a real SGLang 0.5.23 (CPU engine) serving a float32 tiny Llama
whose folder carries a byte-level BPE tokenizer and a Llama-3-style chat template, its LM head changed so that
answers often end by themselves:

- regenerated answers are the model's own token ids, id for id its greedy continuation of exactly the ids
  stored before them (transformers' generate as the check), never their text encoded again;
- a seeded sampling job is refused on a server that would ignore the seed (this engine cannot run
  --enable-deterministic-inference on the CPU, which a test shows);
- the plugin misspelt in SGLANG_PLUGINS, or the aux flags left out: a job that names no layers is never
  attempted, and says what to fix, as read from the server."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hsx.chat import ChatTemplate
from hsx.chat.regenerate import cut_at_stop
from hsx.manifest import load_manifest, read_sample
from tests.support import chat
from tests.support.real_sglang import AUX, PLUGIN_FLAGS, SGLang, sglang_python, truth
from tests.support.stack import Service, start_service
from tests.support.tiny_llama import NUM_LAYERS, make_chat_model

pytestmark = pytest.mark.slow  # real SGLang servers: 30-95 s each to start

WORDS = ["hello", "there", "how", "are", "you", "what", "is", "the", "answer", "model", "quick", "fox"]
MAX_NEW = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    m, folder = make_chat_model(tmp_path_factory.mktemp("chat-model"), chat.LLAMA3)
    return folder, m


def launch(tmp: Path, model: Path, flags: list[str], plugins: str | None) -> SGLang:
    env = {"HSX_DUMP_ROOT": str(tmp / "dumps")}
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins
    return SGLang(sglang_python(), tmp, model, flags, env).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model) -> Iterator[SGLang]:
    """As deploy/sglang/README.md launches it: the plugin, the aux flags."""
    s = launch(tmp_path_factory.mktemp("sglang"), model[0], PLUGIN_FLAGS, "hsx_dump")
    yield s
    s.stop()


def service(tmp_path: Path, server: SGLang, *extra: str) -> Service:
    svc = start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=server.url,
        dump_root=Path(server.env["HSX_DUMP_ROOT"]),
        extra=list(extra),
    )
    svc.proc.wait_http(svc.url + "/healthz", ok=lambda r: (r.json().get("writer") or {}).get("state") == "ready")
    return svc


def conversations(n: int) -> list[dict]:
    out = []
    for i in range(n):
        turns = []
        for k in range(2):
            question = " ".join(WORDS[(i * 3 + k * 5 + j) % len(WORDS)] for j in range(3 + k))
            turns += [{"role": "user", "content": question}, {"role": "assistant", "content": "the dataset's"}]
        out.append({"id": f"c{i}", "messages": turns})
    return out


def answer_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s: one per answer."""
    runs, start = [], None
    for k, m in enumerate([*mask, 0]):
        if m and start is None:
            start = k
        elif not m and start is not None:
            runs.append((start, k))
            start = None
    return runs


def test_regenerated_answers_are_the_models_own_ids(tmp_path, server, model):
    folder, m = model
    assert "hsx-sglang: active" in server.log(), "the plugin says it is active at start"
    svc = service(tmp_path, server)
    try:
        items = conversations(8)
        body = {"samples": items, "regenerate": {"max_new_tokens": MAX_NEW}}
        job = svc.wait_job(svc.post_job(body).json()["id"], timeout=900)
        assert job["state"] == "succeeded", job
        template = ChatTemplate.load(folder)
        tokenizer = chat.reference_tokenizer(folder)
        job_dir = svc.output_root / job["id"]
        manifest = load_manifest(job_dir)
        finishes, round_trips = [], []
        for item in items:
            stored = read_sample(job_dir, manifest, item["id"])
            ids, mask = stored["input_ids"].tolist(), stored["loss_mask"].tolist()
            messages = svc.get(f"/v1/jobs/{job['id']}/samples/{item['id']}").json()["messages"]
            answers = [x for x in messages if x["role"] == "assistant"]
            runs = answer_runs(mask)
            assert len(runs) == len(answers) == 2, (runs, messages)
            first = chat.apply_chat_template_ids(tokenizer, item["messages"][:1], add_generation_prompt=True)
            assert ids[: runs[0][0]] == first
            for (start, end), answer in zip(runs, answers):
                with torch.inference_mode():
                    out = m.generate(torch.tensor([ids[:start]]), max_new_tokens=MAX_NEW, do_sample=False)
                generated = cut_at_stop(out[0, start:].tolist(), template.eos_ids)
                assert ids[start:end] == generated, item["id"]
                stopped = generated[-1] in template.eos_ids
                assert answer["finish"] == ("stop" if stopped else "length")
                finishes.append(answer["finish"])
                body_ids = generated[:-1] if stopped else generated
                text = tokenizer.decode(body_ids, skip_special_tokens=True)
                round_trips.append(tokenizer(text, add_special_tokens=False)["input_ids"] == body_ids)
            for layer, want in truth(m, ids, [*AUX, NUM_LAYERS]).items():
                assert (stored[f"layer_{layer}"] - want).abs().max().item() <= 1e-4, (item["id"], layer)
        assert set(finishes) == {"stop", "length"}, "answers that end by themselves and answers cut short"
        assert not all(round_trips), "some answers' text encodes to other ids: only the ids are the model's"
    finally:
        svc.stop()


def test_a_seeded_sampling_job_is_refused_on_a_server_that_ignores_seeds(tmp_path, server):
    svc = service(tmp_path, server)
    try:
        assert svc.get("/healthz").json()["writer"]["server"]["applies_seed"] is False
        body = {"samples": conversations(1), "regenerate": {"max_new_tokens": 2, "temperature": 1.0, "seed": 7}}
        refused = svc.post_job(body)
        assert refused.status_code == 422, refused.text
        error = refused.json()["errors"][0]
        assert error["field"] == "regenerate.seed" and "--enable-deterministic-inference" in error["message"]
        assert "its CPU engine refuses that flag" in error["message"], "what the test below shows, said"
        # greedy needs no seed, and sampling without one is taken
        for regenerate in ({"max_new_tokens": 2, "seed": 7}, {"max_new_tokens": 2, "temperature": 1.0}):
            created = svc.post_job({"samples": conversations(1), "regenerate": regenerate})
            assert created.status_code == 202, created.text
    finally:
        svc.stop()


def test_this_cpu_engine_cannot_apply_seeds(tmp_path, model):
    """Why the test above tests the refusal: SGLang's CPU engine refuses --enable-deterministic-inference."""
    s = SGLang(sglang_python(), tmp_path, model[0], ["--enable-deterministic-inference"], {})
    args, env = s.command()
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert done.returncode != 0
    assert "attention backends are supported for deterministic inference" in done.stderr + done.stdout


def test_a_misspelt_plugin_is_caught_before_any_attempt(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("misspelt")
    misspelt = launch(tmp, model[0], PLUGIN_FLAGS, "hsx-dump")  # a hyphen: SGLang loads no plugin, says nothing
    try:
        assert "hsx-sglang: active" not in misspelt.log()
        svc = service(tmp, misspelt)
        try:
            job = svc.post_job({"samples": [{"id": "a", "input_ids": [1, 2, 3, 4, 5]}]}).json()
            assert job["layers"] == "eagle3"
            shown = svc.get(f"/v1/jobs/{job['id']}").json()
            reason = shown["waiting_reason"] or ""
            assert "layers eagle3" in reason and "gives layers [2, 4, 5]" in reason, reason
            assert "the plugin did not load" in reason and "SGLANG_PLUGINS" in reason, reason
            assert shown["counts"]["queued"] == 1 and shown["attempts"]["total"] == 0
            server = svc.get("/healthz").json()["writer"]["server"]
            assert "SGLANG_PLUGINS" in server["layers_hint"]
        finally:
            svc.stop()
    finally:
        misspelt.stop()


def test_the_aux_flags_left_out_are_named(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("no-aux")
    plain = launch(tmp, model[0], [], "hsx_dump")  # the plugin loads, but captures nothing without the flags
    try:
        svc = start_service(
            tmp,
            f"sqlite:///{tmp / 'hsx.db'}",
            backend_url=plain.url,
            dump_root=Path(plain.env["HSX_DUMP_ROOT"]),
            extra=["--dump-wait-s", "3"],
        )
        try:
            svc.proc.wait_http(
                svc.url + "/healthz", ok=lambda r: (r.json().get("writer") or {}).get("state") == "refusing"
            )
            reason = svc.get("/healthz").json()["writer"]["reason"]
            assert "both hidden-state options are off" in reason, reason
            assert "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3" in reason, reason
            job = svc.post_job({"samples": [{"id": "a", "input_ids": [1, 2, 3]}]}).json()
            shown = svc.get(f"/v1/jobs/{job['id']}").json()
            assert "--enable-return-aux-hidden-states" in (shown["waiting_reason"] or "")
            assert shown["attempts"]["total"] == 0
        finally:
            svc.stop()
    finally:
        plain.stop()

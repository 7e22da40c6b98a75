"""Jobs end to end against stock SGLang 0.5.23's behaviour (the reference server's --stock-sglang), on
SQLite and Postgres: through the hsx-sglang plugin's dumps, and through the answers of a server without
the plugin. Every stored tensor must equal what transformers computes, bit for bit.

The prefix cache stays on (SGLang's default) and some prompts extend others, so a request that did not
carry its own `extra_key` would be served partly from the cache and rejected."""

from __future__ import annotations

import json
import time

from tests.support.samples import assert_stored_exactly, make_samples
from tests.support.stack import NUM_LAYERS, start_service, start_stock_sglang, stop_stack

AUX = [2, NUM_LAYERS // 2, NUM_LAYERS - 3]
AUX_FLAGS = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]


def samples_sharing_prefixes(n: int, seed: int) -> list[dict]:
    samples = make_samples(n, seed=seed)
    for i, base in enumerate(samples[:3]):
        samples.append({"id": f"longer-{seed}-{i}", "input_ids": base["input_ids"] + [7, 8, 9]})
    return samples


def attempts(svc, job: dict, samples: list[dict]) -> list[dict]:
    return [svc.get(f"/v1/jobs/{job['id']}/samples/{s['id']}").json()["attempt_log"] for s in samples]


def test_plugin_dumps_end_to_end(tmp_path, database_url, checkpoint, recompute):
    dump_root = tmp_path / "dumps"
    ref = start_stock_sglang(tmp_path, checkpoint, dump_root=dump_root, flags=AUX_FLAGS)
    svc = start_service(tmp_path, database_url, backend_url=ref.url, dump_root=dump_root)
    try:
        samples = samples_sharing_prefixes(9, seed=31)
        job = svc.wait_job(svc.post_job({"samples": samples}).json()["id"])
        assert_stored_exactly(svc, job, samples, recompute)
        logs = attempts(svc, job, samples)
        assert all(log[-1]["dump"].startswith(f"req_hsx-{job['id']}-") for log in logs), logs
        assert all(len(log) == 1 for log in logs), "no attempt was served from the prefix cache"
        server = svc.get("/healthz").json()["writer"]["server"]
        assert server["source"] == "dumps" and server["name_by"] == "rid" and server["layers"] == [*AUX, NUM_LAYERS]
    finally:
        stop_stack(svc, ref)


def test_answers_without_the_plugin_end_to_end(tmp_path, database_url, checkpoint, recompute):
    ref = start_stock_sglang(tmp_path, checkpoint, flags=AUX_FLAGS)
    svc = start_service(tmp_path, database_url, backend_url=ref.url, dump_root=tmp_path / "dumps")
    try:
        samples = samples_sharing_prefixes(7, seed=32)
        job = svc.wait_job(svc.post_job({"samples": samples, "layers": AUX}).json()["id"])
        manifest = assert_stored_exactly(svc, job, samples, recompute, layers=AUX)
        assert all(len(log) == 1 for log in attempts(svc, job, samples))
        # Stock SGLang names the model type; the layer count comes from the checkpoint's config.json.
        assert (manifest.model["model_type"], manifest.model["num_hidden_layers"]) == ("llama", NUM_LAYERS)
        assert manifest.post_norm_layers == [], "the aux layers are all taken before the final norm"
        server = svc.get("/healthz").json()["writer"]["server"]
        assert server["source"] == "response" and server["layers"] == AUX

        # Layer L does not come with aux capture's answers: the job waits for a worker that gives it
        # and says why; none of its samples is tried.
        wrong = svc.post_job({"samples": make_samples(2, seed=33), "layers": [*AUX, 8]}).json()["id"]
        shown = svc.get(f"/v1/jobs/{wrong}").json()
        assert shown["state"] == "queued" and shown["counts"]["queued"] == 2, shown
        reason = shown["waiting_reason"] or ""
        assert "no live worker serves this job" in reason and "aux capture gives only the three aux layers" in reason
        # A job that names no layers asks for EAGLE-3's four, which this server cannot give: it waits too, the
        # reason naming the likely cause, read from the server (its aux capture on, but no plugin's dumps).
        default = svc.post_job({"samples": make_samples(2, seed=37)}).json()
        assert default["layers"] == "eagle3"
        reason = svc.get(f"/v1/jobs/{default['id']}").json()["waiting_reason"] or ""
        assert "layers eagle3" in reason and "the plugin did not load" in reason and "SGLANG_PLUGINS" in reason
    finally:
        stop_stack(svc, ref)


def test_last_layer_from_the_answers_of_a_server_without_aux_capture(tmp_path, checkpoint, recompute):
    ref = start_stock_sglang(tmp_path, checkpoint, flags=["--enable-return-hidden-states"])
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=ref.url, dump_root=tmp_path / "d")
    try:
        samples = make_samples(4, seed=34)
        job = svc.wait_job(svc.post_job({"samples": samples, "layers": "last"}).json()["id"])
        assert_stored_exactly(svc, job, samples, recompute, layers=[NUM_LAYERS])
    finally:
        stop_stack(svc, ref)


def test_a_server_without_hidden_states_or_plugin_is_waited_on_with_the_reason(tmp_path, checkpoint):
    ref = start_stock_sglang(tmp_path, checkpoint, flags=["--skip-server-warmup"])
    svc = start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=ref.url,
        dump_root=tmp_path / "d",
        extra=["--source", "response"],
    )
    try:
        job = svc.post_job({"samples": make_samples(1, seed=35)}).json()
        deadline = time.monotonic() + 60
        while not job["waiting_reason"] and time.monotonic() < deadline:
            time.sleep(0.2)
            job = svc.get(f"/v1/jobs/{job['id']}").json()
        assert "--enable-return-hidden-states" in job["waiting_reason"], job
        assert job["counts"]["queued"] == 1
        assert svc.get("/healthz").json()["writer"]["state"] == "refusing"
    finally:
        stop_stack(svc, ref)


def test_a_stale_plugin_file_in_front_of_a_server_without_the_plugin_is_refused_before_any_attempt(
    tmp_path, checkpoint
):
    """hsx-plugin.json left by an earlier launch, the server now running without the plugin: the probe at
    start finds no dump, so the writer refuses with the reason and no sample is spent."""
    dump_root = tmp_path / "dumps"
    dump_root.mkdir()
    stale = {"format": "hsx-plugin/1", "name_by": "rid", "layers": [*AUX, NUM_LAYERS], "rid_prefix": "hsx-"}
    (dump_root / "hsx-plugin.json").write_text(json.dumps(stale | {"boot_id": "an-earlier-launch"}))
    ref = start_stock_sglang(tmp_path, checkpoint, flags=[*AUX_FLAGS, "--skip-server-warmup"])
    svc = start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=ref.url,
        dump_root=dump_root,
        extra=["--dump-wait-s", "2"],
    )
    try:
        job = svc.post_job({"samples": make_samples(2, seed=36)}).json()
        deadline = time.monotonic() + 60
        while "probe" not in (job["waiting_reason"] or "") and time.monotonic() < deadline:
            time.sleep(0.2)
            job = svc.get(f"/v1/jobs/{job['id']}").json()
        assert "did not dump the probe" in (job["waiting_reason"] or ""), job
        assert job["counts"]["queued"] == 2
        assert all(s["attempts"] == 0 for s in svc.get(f"/v1/jobs/{job['id']}/samples").json()["data"])
        assert svc.get("/healthz").json()["writer"]["state"] == "refusing"
    finally:
        stop_stack(svc, ref)

"""deploy/compose.yaml's services started for real, as processes (no container engine here): the API,
the reference model server and the worker run the file's own commands with its own environment, the
Postgres service is the machine's server (a fresh database), volumes are folders, ports free loopback
ports. A job submitted through the API is extracted by the worker and served back by the API."""

from __future__ import annotations

import time

import httpx
import torch

from hsx.manifest import load_manifest, read_sample
from hsx.reference.synthetic import synthetic_hidden_states
from hsx.states import TERMINAL_JOB_STATES
from tests.support.compose import LocalCompose
from tests.support.deploy import DEPLOY


def wait_for(what, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.3)
    raise TimeoutError(f"{what} never held")


def test_the_compose_services_run_a_job_end_to_end(tmp_path, postgres_url):
    stack = LocalCompose(DEPLOY / "compose.yaml", tmp_path, provided={"postgres": postgres_url})
    try:
        stack.up(["api", "model-server", "worker"])
        api = stack.url("api", 8000)
        ready = wait_for(lambda: [w for w in httpx.get(api + "/v1/workers").json()["data"] if w["state"] == "ready"])
        assert len(ready) == 1
        worker = ready[0]
        # The worker reads the dump root the model server writes: the `dumps` volume, as both mount it.
        assert worker["identity"].endswith(str(stack.volume("dumps") / "dumps"))

        samples = [{"id": f"s{i}", "input_ids": [(7 * i + 3 * j) % 32000 for j in range(20 + i)]} for i in range(4)]
        job_id = httpx.post(api + "/v1/jobs", json={"name": "compose", "samples": samples}, timeout=30).json()["id"]
        job = wait_for(lambda: (j := httpx.get(f"{api}/v1/jobs/{job_id}").json())["state"] in TERMINAL_JOB_STATES and j)
        assert job["state"] == "succeeded", job

        # The worker wrote the shards into the `output` volume, and the API serves them from there.
        folder = stack.volume("output") / job_id
        manifest = load_manifest(folder)
        served = httpx.get(f"{api}/v1/jobs/{job_id}/manifest").json()
        assert [s["sha256"] for s in served["shards"]] == [s.sha256 for s in manifest.shards]
        for s in samples:
            got = read_sample(folder, manifest, s["id"])
            truth = synthetic_hidden_states(s["input_ids"], worker["layers"], got["layer_2"].shape[1], torch.bfloat16)
            for layer in worker["layers"]:
                assert torch.equal(got[f"layer_{layer}"], truth[layer]), (s["id"], layer)
        # Each healthcheck of the file passes against what runs.
        assert stack.healthy("api") and stack.healthy("model-server") and stack.healthy("worker")
    finally:
        stack.down()

"""Several workers on one Postgres queue, each beside its own model server: a worker that dies for good
or stalls past its lease loses its samples to the others, and a stalled one that wakes up records
nothing of what it held. Real processes: the API (`hsx serve --no-writer`), three `hsx worker`s and
three synthetic reference servers; every stored tensor is checked against the synthetic model's own
recomputation."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import httpx
import torch
from sqlalchemy.engine import make_url

from hsx.manifest import load_manifest, read_sample
from hsx.reference.synthetic import synthetic_hidden_states
from hsx.sdk import HsxClient
from tests.support.procs import Process, free_port, hsx_command, synthetic_server_args
from tests.support.tcp_proxy import TcpProxy

HIDDEN, NUM_LAYERS, VOCAB = 64, 8, 1000
LAYERS = [2, 4, 5, 8]
LEASE_S = 3.0


def start_synthetic(tmp: Path, name: str, hidden: int = HIDDEN, extra: tuple[str, ...] = ()) -> tuple[Process, str]:
    port = free_port()
    args = synthetic_server_args(
        hidden=hidden,
        num_layers=NUM_LAYERS,
        vocab=VOCAB,
        dump_root=tmp / name / "dumps",
        port=port,
        extra=["--name-by", "rid", "--prefill-us-per-token", "4000", *extra],
    )
    proc = Process(args, tmp / f"{name}-server.log")
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/health")
    return proc, url


def start_worker(tmp: Path, name: str, backend: str, database_url: str) -> Process:
    args = hsx_command() + [
        "worker",
        "--backend-url",
        backend,
        "--dump-root",
        str(tmp / name / "dumps"),
        "--output-root",
        str(tmp / "output"),
        "--database-url",
        database_url,
        "--lease-s",
        str(LEASE_S),
        "--shard-max-bytes",
        "300000",
        "--flushers",
        "2",
    ]
    return Process(args, tmp / f"{name}-worker.log")


def start_api(tmp: Path, database_url: str, parts: list[Process]) -> str:
    """The API alone (`hsx serve --no-writer`) on the shared output root; its URL."""
    port = free_port()
    proc = Process(
        hsx_command()
        + ["serve", "--no-writer", "--database-url", database_url, "--output-root", str(tmp / "output")]
        + ["--port", str(port), "--input-root", str(tmp)],
        tmp / "api.log",
    )
    parts.append(proc)
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/healthz")
    return url


def workers(api: str) -> dict[str, dict]:
    return {w["identity"].rsplit("/", 2)[-2]: w for w in httpx.get(api + "/v1/workers").json()["data"]}


def wait_for(what, timeout: float = 60.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"{what} never held")


def random_samples(prefix: str, n: int, rng: random.Random, lo: int = 20, hi: int = 60) -> list[dict]:
    return [
        {"id": f"{prefix}{i}", "input_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]}
        for i in range(n)
    ]


def assert_stored_once(folder: Path, samples: list[dict], layers: list[int], hidden: int) -> None:
    """Every sample stored exactly once, in order, in shards the manifest names (no stray one), each
    tensor equal to the synthetic model's own recomputation."""
    manifest = load_manifest(folder)
    assert [s.id for s in manifest.samples] == [s["id"] for s in samples], "every sample stored exactly once"
    assert {p.name for p in folder.glob("*.safetensors")} == {sh.name for sh in manifest.shards}, "no stray shard"
    assert (manifest.layers, manifest.hidden_size) == (layers, hidden)
    for s in samples:
        got = read_sample(folder, manifest, s["id"])
        truth = synthetic_hidden_states(s["input_ids"], layers, hidden, torch.bfloat16)
        assert got["input_ids"].tolist() == s["input_ids"]
        for layer in layers:
            assert torch.equal(got[f"layer_{layer}"], truth[layer]), (s["id"], layer)


def test_a_dead_and_a_stalled_worker_lose_their_samples_and_record_nothing_stale(tmp_path, postgres_url):
    parts: list[Process] = []
    try:
        api = start_api(tmp_path, postgres_url, parts)
        procs = {}
        for name in ("a", "b", "c"):
            server, url = start_synthetic(tmp_path, name)
            parts.append(server)
            procs[name] = start_worker(tmp_path, name, url, postgres_url)
            parts.append(procs[name])
        wait_for(lambda: {k for k, w in workers(api).items() if w["state"] == "ready"} == {"a", "b", "c"})

        samples = random_samples("w", 90, random.Random(4))
        job_id = httpx.post(api + "/v1/jobs", json={"samples": samples}, timeout=30).json()["id"]

        def job() -> dict:
            return httpx.get(f"{api}/v1/jobs/{job_id}").json()

        wait_for(lambda: job()["counts"]["succeeded"] >= 10)
        procs["a"].kill()  # dies for good, holding whatever it ran and staged
        os.killpg(procs["b"].proc.pid, signal.SIGSTOP)  # stalls past its lease
        lost = wait_for(lambda: {k for k, w in workers(api).items() if w["state"] == "lost"} >= {"a", "b"} or None)
        assert lost
        stalled_lease = workers(api)["b"]["lease"]
        time.sleep(LEASE_S)
        os.killpg(procs["b"].proc.pid, signal.SIGCONT)

        final = wait_for(lambda: job() if job()["state"] in ("succeeded", "partial", "failed") else None, timeout=240)
        assert final["state"] == "succeeded", final
        assert_stored_once(tmp_path / "output" / job_id, samples, LAYERS, HIDDEN)

        # The woken worker found its lease gone, dropped what it held and registered again.
        assert "lease" in procs["b"].log() and "registering again" in procs["b"].log()
        after = workers(api)
        assert after["b"]["lease"] > stalled_lease and after["b"]["state"] != "lost"
        assert after["a"]["state"] == "lost"
        expired = [
            a
            for s in samples
            for a in httpx.get(f"{api}/v1/jobs/{job_id}/samples/{s['id']}").json()["attempt_log"]
            if a["outcome"] == "interrupted" and "lease" in (a["reason"] or "")
        ]
        assert expired, "the dead and stalled workers' attempts were given back, unspent"

        with HsxClient(api) as hsx:
            listed = {w.identity: w for w in hsx.workers()}
        assert {i.rsplit("/", 2)[-2] for i in listed} == {"a", "b", "c"}
        assert all(w.layers == LAYERS and w.source == "dumps" for w in listed.values())
        shown = subprocess.run(
            hsx_command() + ["workers", "--url", api, "--json"], capture_output=True, text=True, check=True
        )
        assert {w["identity"] for w in json.loads(shown.stdout)} == set(listed)
    finally:
        for p in reversed(parts):
            if p.proc.poll() is None:
                os.killpg(p.proc.pid, signal.SIGCONT)
            p.stop()


def test_a_worker_cut_off_from_the_database_past_its_lease_records_nothing_stale(tmp_path, postgres_url):
    """One worker reaches Postgres through a line that is cut for twice its lease while it works;
    the other takes its samples over. After the line is back the cut-off worker registers again
    and the job ends with every sample stored once, exactly."""
    url = make_url(postgres_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    behind_proxy = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    parts: list[Process] = []
    try:
        api = start_api(tmp_path, postgres_url, parts)
        procs = {}
        for name, db in (("a", behind_proxy), ("b", postgres_url)):
            server, backend = start_synthetic(tmp_path, name)
            parts.append(server)
            procs[name] = start_worker(tmp_path, name, backend, db)
            parts.append(procs[name])
        wait_for(lambda: {k for k, w in workers(api).items() if w["state"] == "ready"} == {"a", "b"})

        samples = random_samples("p", 60, random.Random(5))
        job_id = httpx.post(api + "/v1/jobs", json={"samples": samples}, timeout=30).json()["id"]

        def job() -> dict:
            return httpx.get(f"{api}/v1/jobs/{job_id}").json()

        wait_for(lambda: job()["counts"]["succeeded"] >= 8)
        proxy.cut()
        wait_for(lambda: workers(api)["a"]["state"] == "lost")
        time.sleep(LEASE_S)
        proxy.restore()

        final = wait_for(lambda: job() if job()["state"] in ("succeeded", "partial", "failed") else None, timeout=240)
        assert final["state"] == "succeeded", final
        assert_stored_once(tmp_path / "output" / job_id, samples, LAYERS, HIDDEN)
        wait_for(lambda: "registering again" in procs["a"].log())
        wait_for(lambda: workers(api)["a"]["state"] == "ready")
    finally:
        proxy.close()
        for p in reversed(parts):
            p.stop()


def test_a_job_runs_only_on_workers_of_its_model_and_layers(tmp_path, postgres_url):
    """Worker a serves EAGLE-3's layers of one model, worker b two other layers of a wider model. A
    job asking for a's layers runs on a only, one asking for b's on b only; a job asking for none
    runs on whichever worker stores its first sample, and only there; a job nobody serves waits and
    says why, instead of failing."""
    parts: list[Process] = []
    try:
        api = start_api(tmp_path, postgres_url, parts)
        shapes = {"a": (HIDDEN, LAYERS), "b": (2 * HIDDEN, [1, 3])}
        for name, (hidden, layers) in shapes.items():
            server, url = start_synthetic(tmp_path, name, hidden, ("--layers", ",".join(map(str, layers))))
            parts += [server, start_worker(tmp_path, name, url, postgres_url)]
        wait_for(lambda: {k for k, w in workers(api).items() if w["state"] == "ready"} == {"a", "b"})
        listed = workers(api)
        assert listed["a"]["model_key"] != listed["b"]["model_key"], "different shapes are different models"
        table = subprocess.run(hsx_command() + ["workers", "--url", api], capture_output=True, text=True, check=True)
        rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:]}
        for w in listed.values():  # each row names its worker's own model key, so two models tell apart
            assert f"({w['model_key'][:12]})" in rows[w["identity"]], table.stdout

        rng = random.Random(6)
        jobs = {
            "a": (random_samples("a", 12, rng, 10, 40), LAYERS),
            "b": (random_samples("b", 12, rng, 10, 40), [1, 3]),
            "any": (random_samples("n", 12, rng, 10, 40), "any"),
            "none": (random_samples("x", 3, rng, 10, 40), [6]),
        }
        ids = {
            k: httpx.post(api + "/v1/jobs", json={"samples": ss, **({"layers": ls} if ls else {})}, timeout=30).json()[
                "id"
            ]
            for k, (ss, ls) in jobs.items()
        }

        def job(key: str) -> dict:
            return httpx.get(f"{api}/v1/jobs/{ids[key]}").json()

        for key in ("a", "b", "any"):
            final = wait_for(
                lambda k=key: job(k) if job(k)["state"] in ("succeeded", "partial", "failed") else None, timeout=120
            )
            assert final["state"] == "succeeded", final

        def ran_on(key: str) -> set[str]:
            """The workers whose attempts stored the job's samples; no attempt of the job failed."""
            names = set()
            for s in jobs[key][0]:
                log = httpx.get(f"{api}/v1/jobs/{ids[key]}/samples/{s['id']}").json()["attempt_log"]
                assert all(a["outcome"] in ("ok", "interrupted") for a in log), log
                names |= {a["worker"].split("#")[0].rsplit("/", 2)[-2] for a in log if a["outcome"] == "ok"}
            return names

        assert ran_on("a") == {"a"} and ran_on("b") == {"b"}
        pinned = ran_on("any")
        assert len(pinned) == 1, f"a job's samples come from one model: {pinned}"
        stored_by = {"a": "a", "b": "b", "any": pinned.pop()}
        for key, worker in stored_by.items():
            hidden, layers = shapes[worker]
            assert_stored_once(tmp_path / "output" / ids[key], jobs[key][0], layers, hidden)

        waiting = job("none")
        assert waiting["state"] == "queued" and waiting["counts"]["queued"] == 3, waiting
        reason = waiting["waiting_reason"] or ""
        assert "no live worker serves this job" in reason and "layers [6]" in reason, reason
        assert f"gives layers {LAYERS}" in reason and "gives layers [1, 3]" in reason, reason
    finally:
        for p in reversed(parts):
            p.stop()

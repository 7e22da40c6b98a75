"""The soak run: one job extracted from a synthetic reference server while a chaos loop injects
faults of every kind at random and kills and restarts both processes; then every stored sample is
checked against an independent recomputation. `python -m benchmarks.soak` and tests/acceptance/test_soak.py
drive it."""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections import Counter
from pathlib import Path

import httpx
import torch

from hsx.manifest import load_manifest, read_rows
from hsx.reference.faults import BAD_DUMP_KINDS
from hsx.reference.synthetic import synthetic_hidden_states
from hsx.states import TERMINAL_JOB_STATES
from tests.support.procs import Process, free_port, hsx_command, synthetic_server_args

HIDDEN = 64
NUM_LAYERS = 8
VOCAB = 1000


class Soak:
    def __init__(self, work: Path, database_url: str, seed: int, prefill_us_per_token: float = 0.0):
        self.work = work
        # Simulated prefill time: a short run needs to last long enough for a few dozen disturbances.
        self.prefill_us_per_token = prefill_us_per_token
        self.database_url = database_url
        self.rng = random.Random(seed)
        self.ref_port, self.svc_port = free_port(), free_port()
        self.dump_root = work / "dumps"
        self.output_root = work / "output"
        self.ref: Process | None = None
        self.svc: Process | None = None
        self.injected: Counter[str] = Counter()
        self.actions: Counter[str] = Counter()
        self.http = httpx.Client(timeout=30)

    @property
    def ref_url(self) -> str:
        return f"http://127.0.0.1:{self.ref_port}"

    @property
    def svc_url(self) -> str:
        return f"http://127.0.0.1:{self.svc_port}"

    def start_reference(self) -> None:
        args = synthetic_server_args(
            hidden=HIDDEN,
            num_layers=NUM_LAYERS,
            vocab=VOCAB,
            dump_root=self.dump_root,
            port=self.ref_port,
            extra=["--enable-fault-injection", "--prefill-us-per-token", str(self.prefill_us_per_token)],
        )
        self.ref = Process(args, self.work / "reference.log")
        self.ref.wait_http(self.ref_url + "/health")

    def start_service(self) -> None:
        args = hsx_command() + [
            "serve",
            "--backend-url",
            self.ref_url,
            "--dump-root",
            str(self.dump_root),
            "--output-root",
            str(self.output_root),
            "--input-root",
            str(self.work),
            "--database-url",
            self.database_url,
            "--port",
            str(self.svc_port),
            "--dump-wait-s",
            "2",
            "--max-attempts",
            "6",
            "--shard-max-bytes",
            "400000",
            "--request-timeout-s",
            "5",
        ]
        self.svc = Process(args, self.work / "service.log")
        self.svc.wait_http(self.svc_url + "/healthz")

    def faults(self, patch: dict) -> None:
        with contextlib.suppress(httpx.HTTPError):
            self.http.post(self.ref_url + "/admin/faults", json=patch)

    def collect_injected(self) -> None:
        """Counters live in the server process: read them before it goes away."""
        try:
            counts = self.http.get(self.ref_url + "/admin/faults").json()["injected"]
            self.http.delete(self.ref_url + "/admin/faults")
        except httpx.HTTPError:
            return
        self.injected.update(counts)

    def chaos(self) -> None:
        """One random disturbance, most of them through the server's fault switches."""
        r = self.rng.random()
        kinds = self.rng.sample(BAD_DUMP_KINDS, k=self.rng.randint(1, 4))
        if r < 0.35:
            self.actions["fault_mix"] += 1
            self.faults(
                {
                    "foreign_dumps": {
                        "probability": 0.15,
                        "before": self.rng.randint(0, 2),
                        "after": self.rng.randint(0, 2),
                        "health_like": self.rng.random() < 0.5,
                    },
                    "bad_dumps": {"probability": 0.08, "kind": kinds},
                    "late_done": {"probability": 0.05, "seconds": 0.3, "never": False},
                }
            )
        elif r < 0.45:
            self.actions["never_done"] += 1
            self.faults({"late_done": {"count": 1, "never": True}})
        elif r < 0.55:
            self.actions["unavailable"] += 1
            self.faults({"unavailable": {"seconds": self.rng.uniform(1, 4)}})
        elif r < 0.62:
            self.actions["delay_past_timeout"] += 1
            self.faults({"delay": {"count": 1, "seconds": 6}})
        elif r < 0.75:
            self.actions["server_crash"] += 1
            self.collect_injected()
            self.faults({"crash": {"count": 1}})
        elif r < 0.85:
            self.actions["server_restart"] += 1
            self.collect_injected()
            self.ref.kill()
            time.sleep(self.rng.uniform(0.5, 3))
            self.start_reference()
        else:
            self.actions["service_sigkill"] += 1
            self.svc.kill()
            self.start_service()
        if self.ref.proc.poll() is not None:  # crashed on purpose: bring it back, as an operator would
            self.start_reference()

    def run(self, n: int, deadline_s: float) -> dict:
        self.start_reference()
        self.start_service()
        samples = [
            {"id": f"s{i}", "input_ids": [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(4, 160))]}
            for i in range(n)
        ]
        body = "".join(json.dumps(s) + "\n" for s in samples).encode()
        job = self.http.post(
            self.svc_url + "/v1/jobs",
            content=body,
            headers={"content-type": "application/x-ndjson"},
            params={"name": "soak"},
        ).json()
        job_id = job["id"]
        start = time.monotonic()
        while time.monotonic() - start < deadline_s:
            time.sleep(self.rng.uniform(0.5, 2.0))
            state = self._job(job_id)
            if state and state["state"] in TERMINAL_JOB_STATES:
                break
            self.chaos()
        self.faults(
            {"seed": None, "foreign_dumps": None, "bad_dumps": None, "late_done": None, "delay": None, "crash": None}
        )
        final = self._wait(job_id, deadline_s)
        self.collect_injected()
        report = self.check(job_id, samples, final)
        report["elapsed_s"] = round(time.monotonic() - start, 1)
        self.svc.stop()
        self.ref.stop()
        return report

    def _job(self, job_id: str) -> dict | None:
        try:
            return self.http.get(f"{self.svc_url}/v1/jobs/{job_id}").json()
        except (httpx.HTTPError, ValueError):
            return None

    def _wait(self, job_id: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self._job(job_id)
            if job and job["state"] in TERMINAL_JOB_STATES:
                return job
            if self.ref.proc.poll() is not None:
                self.start_reference()
            time.sleep(0.5)
        raise TimeoutError(f"soak job {job_id} did not finish within {timeout}s")

    def check(self, job_id: str, samples: list[dict], job: dict) -> dict:
        job_dir = self.output_root / job_id
        manifest = load_manifest(job_dir)
        placed = Counter(s.id for s in manifest.samples)
        by_id = {s.id: s for s in manifest.samples}
        failed = {}
        after = None
        while True:
            params = {"state": "failed", "limit": 1000, **({"after": after} if after else {})}
            page = self.http.get(f"{self.svc_url}/v1/jobs/{job_id}/samples", params=params).json()
            failed.update({s["id"]: s["last_error"] for s in page["data"]})
            if not page["has_more"]:
                break
            after = page["next_after"]
        wrong = 0
        for s in samples:
            entry = by_id.get(s["id"])
            if entry is None:
                continue
            layers = manifest.layers or []
            rows = read_rows(job_dir / entry.shard, entry.offset, entry.num_tokens, layers)
            truth = synthetic_hidden_states(s["input_ids"], layers, HIDDEN, torch.bfloat16)
            ok = rows["input_ids"].tolist() == s["input_ids"] and all(
                torch.equal(rows[f"layer_{i}"], truth[i]) for i in layers
            )
            wrong += not ok
        stored = len(by_id)
        return {
            "job_state": job["state"],
            "samples": len(samples),
            "stored": stored,
            "failed": len(failed),
            "stored_but_wrong": wrong,
            "stored_twice": sum(c - 1 for c in placed.values() if c > 1)
            + (sum(sh.num_samples for sh in manifest.shards) - stored),
            "lost": len(samples) - stored - len(failed),
            "failed_reasons": Counter(r.split(":", 1)[0] for r in failed.values()),
            "injected": dict(sorted(self.injected.items())),
            "actions": dict(sorted(self.actions.items())),
        }


def print_report(report: dict) -> None:
    print(f"soak: {report['samples']} samples, job {report['job_state']} in {report['elapsed_s']} s")
    print(f"  {'fault kind':<28}{'injected':>9}")
    for kind, n in {**report["injected"], **{f"action.{k}": v for k, v in report["actions"].items()}}.items():
        print(f"  {kind:<28}{n:>9}")
    for key in ("stored", "failed", "stored_but_wrong", "stored_twice", "lost"):
        print(f"  {key:<28}{report[key]:>9}")
    if report["failed_reasons"]:
        print("  failed by reason: " + ", ".join(f"{k} {v}" for k, v in report["failed_reasons"].items()))

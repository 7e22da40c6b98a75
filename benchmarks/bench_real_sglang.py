"""The service against a bare loop of the same requests, on a real SGLang 0.5.23 (its CPU engine).

    python -m benchmarks.bench_real_sglang                      # 60 samples of 100-400 tokens
    python -m benchmarks.bench_real_sglang --samples 200 --hidden 512

For each capture mode, one real server (tests/support/real_sglang.py; a tiny random Llama made
here, float32) and, against it, one sample at a time unless said:
  sglang alone    the same prompts with no hidden states asked for (the model server's own pace)
  bare loop       what a script does by hand: plugin mode, POST (return_logprob), wait for the dump's
                  `done`, load its safetensors, save them; plugin-free, POST (return_hidden_states),
                  parse the whole JSON answer, save the rows. No database, no checks, no shards
  service         `hsx serve` (SQLite) running the same prompts as one job, --max-in-flight 1 and 4,
                  timed from POST /v1/jobs to the job's success; CPU is the service's process tree
Prints seconds per sample, tokens/s and CPU seconds per sample; the date heads the table.
"""

from __future__ import annotations

import argparse
import random
import resource
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load_file, save_file

from tests.support import tiny_llama
from tests.support.procs import proc_tree_cpu
from tests.support.real_sglang import PLUGIN_FLAGS, SGLang, sglang_python
from tests.support.stack import start_service
from tests.support.tiny_llama import make_model

Row = dict[str, Any]


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(tiny_llama.VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def timed(name: str, samples: list[list[int]], run: Any) -> Row:
    r0, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    run()
    wall = time.perf_counter() - start
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return row(name, samples, wall, cpu)


def row(name: str, samples: list[list[int]], wall: float, cpu: float) -> Row:
    tokens = sum(len(s) for s in samples)
    return {"name": name, "s_per_sample": wall / len(samples), "tok_s": tokens / wall, "cpu": cpu / len(samples)}


def sglang_alone(url: str, samples: list[list[int]]) -> None:
    with httpx.Client(timeout=600) as c:
        for i, ids in enumerate(samples):
            body = {"input_ids": ids, "rid": f"alone-{i}", "extra_key": f"alone-{i}"}
            c.post(url + "/generate", json=body | {"sampling_params": {"max_new_tokens": 1}}).raise_for_status()


def bare_plugin(url: str, dumps: Path, out: Path, samples: list[list[int]]) -> None:
    with httpx.Client(timeout=600) as c:
        for i, ids in enumerate(samples):
            rid = f"hsx-bare-{i}"
            body = {"input_ids": ids, "rid": rid, "extra_key": rid, "return_logprob": True}
            c.post(url + "/generate", json=body | {"sampling_params": {"max_new_tokens": 1}}).raise_for_status()
            dump = dumps / f"req_{rid}"
            while not (dump / "done").exists():
                time.sleep(0.001)
            save_file(load_file(dump / "hidden_states.safetensors"), out / f"{i}.safetensors")
            shutil.rmtree(dump)


def bare_answers(url: str, out: Path, samples: list[list[int]]) -> None:
    with httpx.Client(timeout=600) as c:
        for i, ids in enumerate(samples):
            rid = f"bare-{i}"
            body = {"input_ids": ids, "rid": rid, "extra_key": rid, "return_hidden_states": True}
            resp = c.post(url + "/generate", json=body | {"sampling_params": {"max_new_tokens": 1}})
            rows = resp.json()["meta_info"]["hidden_states"][0]
            save_file({"hidden_states": torch.tensor(rows[: len(ids)])}, out / f"{i}.safetensors")


def service(work: Path, url: str, dumps: Path, samples: list[list[int]], in_flight: int) -> Row:
    tmp = work / f"service-{in_flight}-{time.monotonic_ns()}"
    tmp.mkdir()
    svc = start_service(
        tmp, f"sqlite:///{tmp / 'hsx.db'}", backend_url=url, dump_root=dumps, extra=["--max-in-flight", str(in_flight)]
    )
    try:
        warm = svc.wait_job(svc.post_job({"samples": [{"id": "warm", "input_ids": samples[0]}]}).json()["id"])
        assert warm["state"] == "succeeded", warm
        cpu0, start = proc_tree_cpu(svc.proc.proc.pid), time.perf_counter()
        items = [{"id": f"s{i}", "input_ids": ids} for i, ids in enumerate(samples)]
        job = svc.wait_job(svc.post_job({"samples": items}).json()["id"], timeout=3600)
        wall = time.perf_counter() - start
        assert job["state"] == "succeeded", job
        return row(f"service, {in_flight} in flight", samples, wall, proc_tree_cpu(svc.proc.proc.pid) - cpu0)
    finally:
        svc.stop()


def mode_rows(args: argparse.Namespace, work: Path, model: Path, plugin: bool) -> list[Row]:
    dumps = work / ("dumps" if plugin else "unused-dumps")
    env = {"SGLANG_PLUGINS": "hsx_dump", "HSX_DUMP_ROOT": str(dumps)} if plugin else {}
    flags = PLUGIN_FLAGS if plugin else [*PLUGIN_FLAGS, "--enable-return-hidden-states"]
    server = SGLang(sglang_python(), work, model, flags, env).start()
    samples = prompts(args.samples, args.min_tokens, args.max_tokens)
    out = work / f"bare-{plugin}"
    out.mkdir()
    try:
        sglang_alone(server.url, samples[:3])  # warm
        rows = [timed("sglang alone", samples, lambda: sglang_alone(server.url, samples))]
        if plugin:
            rows.append(timed("bare loop", samples, lambda: bare_plugin(server.url, dumps, out, samples)))
        else:
            rows.append(timed("bare loop", samples, lambda: bare_answers(server.url, out, samples)))
        rows += [service(work, server.url, dumps, samples, n) for n in (1, 4)]
        return rows
    finally:
        server.stop()


def print_table(title: str, rows: list[Row]) -> None:
    print(f"\n{title}\n")
    print("| run | s/sample | tokens/s | CPU s/sample (client or service) | x the server alone |")
    print("|---|---|---|---|---|")
    alone = rows[0]["s_per_sample"]
    for r in rows:
        ratio = r["s_per_sample"] / alone
        print(f"| {r['name']} | {r['s_per_sample']:.4f} | {r['tok_s']:.0f} | {r['cpu']:.4f} | {ratio:.2f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--min-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--hidden", type=int, default=tiny_llama.HIDDEN)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hsx-bench-real-") as d:
        work = Path(d)
        make_model(work / "model", hidden=args.hidden)
        print(f"{datetime.now(timezone.utc):%Y-%m-%d}: real SGLang 0.5.23, CPU engine, tiny Llama float32")
        print(f"(hidden {args.hidden}, 8 layers), {args.samples} samples of {args.min_tokens}-{args.max_tokens} tokens")
        print_table("plugin mode (aux layers + layer L, dumps)", mode_rows(args, work, work / "model", plugin=True))
        print_table("plugin-free (aux layers in the answers)", mode_rows(args, work, work / "model", plugin=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())

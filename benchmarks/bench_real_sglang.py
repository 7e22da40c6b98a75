"""The service against the model server alone and a bare loop, at the same number of requests in flight, on a
real SGLang 0.5.23 (its CPU engine).

    python -m benchmarks.bench_real_sglang                      # 3 rounds of 24 samples, 1 and 4 in flight
    python -m benchmarks.bench_real_sglang --rounds 5 --samples 40 --in-flight 1 2 4

For each capture mode, one real server (tests/support/real_sglang.py; a tiny random Llama made here,
float32) and, against it, at each number in flight N:
  sglang alone    the prompts with no hidden states asked for, N at a time (the model server's own pace)
  bare loop       what a script does by hand, N at a time: plugin mode, POST (return_logprob), wait for the
                  dump's `done`, load its safetensors, save them; plugin-free, POST (return_hidden_states),
                  parse the whole JSON answer, save the rows. No database, no checks, no shards
  service         `hsx serve` (SQLite, --max-in-flight N) running the prompts as one job, timed from
                  POST /v1/jobs to the job's success; CPU is the service's process tree
A round runs every kind at every N, each on prompts of its own (fresh token ids, so no run is served from
a cache another one filled), in an order that turns by one kind each round, so that a machine whose pace
drifts during the run slows every kind alike. Prints, per kind and N, seconds per sample, tokens/s and CPU
seconds per sample over all rounds, the ratio to the server alone at the same N, and that ratio's range
over the rounds; the date heads the output.
"""

from __future__ import annotations

import argparse
import itertools
import random
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from tests.support import tiny_llama
from tests.support.procs import proc_tree_cpu
from tests.support.real_sglang import PLUGIN_FLAGS, SGLang, sglang_python
from tests.support.stack import start_service
from tests.support.tiny_llama import make_model

ALONE, BARE, SERVICE = "alone", "bare loop", "service"
# One request: (client, a name unique in the whole run, the prompt).
Send = Callable[[httpx.Client, str, list[int]], None]

_fresh = itertools.count()


def prompts(n: int, lo: int, hi: int) -> list[list[int]]:
    """`n` prompts of random ids that no earlier call of this run gave (a seed of their own each call)."""
    rng = random.Random(next(_fresh))
    return [[rng.randrange(tiny_llama.VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@dataclass
class Figures:
    """One kind at one number in flight, summed over the rounds."""

    samples: int = 0
    tokens: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    walls: list[float] = field(default_factory=list)  # seconds per sample, round by round

    def add(self, samples: list[list[int]], wall: float, cpu: float) -> None:
        self.samples += len(samples)
        self.tokens += sum(len(s) for s in samples)
        self.wall += wall
        self.cpu += cpu
        self.walls.append(wall / len(samples))


def in_parallel(url: str, samples: list[list[int]], in_flight: int, tag: str, send: Send) -> None:
    """Every prompt sent by `in_flight` threads on one client, so that `in_flight` requests are open at once."""
    with httpx.Client(base_url=url, timeout=600) as c, ThreadPoolExecutor(in_flight) as pool:
        list(pool.map(lambda item: send(c, f"{tag}-{item[0]}", item[1]), enumerate(samples)))


def timed_client(url: str, samples: list[list[int]], in_flight: int, tag: str, send: Send) -> tuple[float, float]:
    """Wall and CPU seconds of this process (its threads included) while `in_parallel` sends the prompts."""
    r0, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    in_parallel(url, samples, in_flight, tag, send)
    wall = time.perf_counter() - start
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def service(
    work: Path,
    url: str,
    dumps: Path,
    samples: list[list[int]],
    warm: list[int],
    in_flight: int,
    *,
    layers: str,
    extra: list[str],
) -> tuple[float, float]:
    """`hsx serve --max-in-flight N` on its own database: one warm-up sample, then the prompts as one job
    asking for `layers`. Returns its wall seconds and the service's CPU seconds for that job."""
    tmp = work / f"service-{in_flight}-{time.monotonic_ns()}"
    tmp.mkdir()
    args = ["--max-in-flight", str(in_flight), *extra]
    svc = start_service(tmp, f"sqlite:///{tmp / 'hsx.db'}", backend_url=url, dump_root=dumps, extra=args)
    try:
        first = svc.post_job({"layers": layers, "samples": [{"id": "warm", "input_ids": warm}]}).json()
        job = svc.wait_job(first["id"])
        assert job["state"] == "succeeded", job
        cpu0, start = proc_tree_cpu(svc.proc.proc.pid), time.perf_counter()
        items = [{"id": f"s{i}", "input_ids": ids} for i, ids in enumerate(samples)]
        job = svc.wait_job(svc.post_job({"layers": layers, "samples": items}).json()["id"], timeout=3600)
        wall = time.perf_counter() - start
        assert job["state"] == "succeeded", job
        return wall, proc_tree_cpu(svc.proc.proc.pid) - cpu0
    finally:
        svc.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def measure(
    args: argparse.Namespace,
    url: str,
    clients: dict[str, Send],
    run_service: Callable[[list[list[int]], list[int], int], tuple[float, float]],
) -> dict[tuple[str, int], Figures]:
    """`args.rounds` rounds of every kind at every number in flight, fresh prompts for each run."""
    kinds = [*clients, SERVICE]
    figures = {(k, n): Figures() for k in kinds for n in args.in_flight}
    for k, send in clients.items():  # one request of each kind before any is timed
        in_parallel(url, prompts(2, args.min_tokens, args.max_tokens), 1, f"warm-{k.replace(' ', '-')}", send)
    for r in range(args.rounds):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        for n in args.in_flight:
            for kind in order:
                samples = prompts(args.samples, args.min_tokens, args.max_tokens)
                if kind == SERVICE:
                    wall, cpu = run_service(samples, prompts(1, args.min_tokens, args.max_tokens)[0], n)
                else:
                    tag = f"{kind.replace(' ', '-')}-{r}-{n}"
                    wall, cpu = timed_client(url, samples, n, tag, clients[kind])
                figures[kind, n].add(samples, wall, cpu)
                print(f"  round {r + 1}, {n} in flight, {kind}: {wall / len(samples):.4f} s/sample", flush=True)
    return figures


def print_table(title: str, engine: str, figures: dict[tuple[str, int], Figures]) -> None:
    print(f"\n{title}\n")
    print(f"| run | in flight | s/sample | tokens/s | CPU s/sample | x {engine} alone | range over rounds |")
    print("|---|---|---|---|---|---|---|")
    for n in sorted({n for _, n in figures}):
        alone = figures[ALONE, n]
        for (kind, m), f in figures.items():
            if m != n:
                continue
            name = f"{engine} alone" if kind == ALONE else kind
            whose = "service" if kind == SERVICE else "client"
            ratio = (f.wall / f.samples) / (alone.wall / alone.samples)
            per_round = [w / a for w, a in zip(f.walls, alone.walls, strict=True)]
            print(
                f"| {name} | {n} | {f.wall / f.samples:.4f} | {f.tokens / f.wall:,.0f} | {f.cpu / f.samples:.4f} "
                f"({whose}) | {ratio:.2f} | {min(per_round):.2f}-{max(per_round):.2f} |"
            )


def arguments(argv: list[str] | None, doc: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.split("\n", maxsplit=1)[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples", type=int, default=24, help="samples of each kind at each number in flight, per round")
    p.add_argument("--in-flight", type=int, nargs="+", default=[1, 4])
    p.add_argument("--min-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--hidden", type=int, default=tiny_llama.HIDDEN)
    return p.parse_args(argv)


def one_token(body: dict) -> dict:
    return body | {"sampling_params": {"max_new_tokens": 1}}


def alone(c: httpx.Client, rid: str, ids: list[int]) -> None:
    c.post("/generate", json=one_token({"input_ids": ids, "rid": rid, "extra_key": rid})).raise_for_status()


def bare_plugin(dumps: Path, out: Path) -> Send:
    def send(c: httpx.Client, name: str, ids: list[int]) -> None:
        rid = f"hsx-{name}"  # the plugin dumps requests whose rid starts with hsx-
        body = {"input_ids": ids, "rid": rid, "extra_key": rid, "return_logprob": True}
        c.post("/generate", json=one_token(body)).raise_for_status()
        dump = dumps / f"req_{rid}"
        while not (dump / "done").exists():
            time.sleep(0.001)
        save_file(load_file(dump / "hidden_states.safetensors"), out / f"{name}.safetensors")
        shutil.rmtree(dump)

    return send


def bare_answers(out: Path) -> Send:
    def send(c: httpx.Client, name: str, ids: list[int]) -> None:
        body = {"input_ids": ids, "rid": name, "extra_key": name, "return_hidden_states": True}
        rows = c.post("/generate", json=one_token(body)).raise_for_status().json()["meta_info"]["hidden_states"][0]
        save_file({"hidden_states": torch.tensor(rows[: len(ids)])}, out / f"{name}.safetensors")

    return send


def mode(args: argparse.Namespace, work: Path, plugin: bool) -> dict[tuple[str, int], Figures]:
    dumps = work / ("dumps" if plugin else "unused-dumps")
    env = {"SGLANG_PLUGINS": "hsx_dump", "HSX_DUMP_ROOT": str(dumps)} if plugin else {}
    flags = PLUGIN_FLAGS if plugin else [*PLUGIN_FLAGS, "--enable-return-hidden-states"]
    server = SGLang(sglang_python(), work, work / "model", flags, env).start()
    out = work / f"bare-{plugin}"
    out.mkdir()
    bare = bare_plugin(dumps, out) if plugin else bare_answers(out)
    # Plugin-free, the answers hold the three aux layers only (no layer L): the job asks for what it gets.
    layers = "eagle3" if plugin else "any"
    try:
        return measure(
            args,
            server.url,
            {ALONE: alone, BARE: bare},
            lambda samples, warm, n: service(work, server.url, dumps, samples, warm, n, layers=layers, extra=[]),
        )
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv, __doc__ or "")
    with tempfile.TemporaryDirectory(prefix="hsx-bench-real-") as d:
        work = Path(d)
        make_model(work / "model", hidden=args.hidden)
        print(f"{datetime.now(timezone.utc):%Y-%m-%d}: real SGLang 0.5.23, CPU engine, tiny Llama float32")
        print(
            f"(hidden {args.hidden}, 8 layers), {args.rounds} rounds of {args.samples} samples of "
            f"{args.min_tokens}-{args.max_tokens} tokens per kind and number in flight"
        )
        plugin = mode(args, work, plugin=True)
        free = mode(args, work, plugin=False)
        print_table("plugin mode (aux layers + layer L, dumps)", "SGLang", plugin)
        print_table("plugin-free (aux layers in the answers)", "SGLang", free)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The service against the model server alone and a bare loop, at the same number of requests in flight, on a
real vLLM 0.32.0 (its CPU build) with hsx's connector writing every request's hidden states.

    python -m benchmarks.bench_real_vllm                   # 3 rounds of 24 samples, 1 and 4 in flight

One server (tests/support/real_vllm.py; a tiny random float32 Llama made here, layers 2, 4, 5 and 8) and,
against it, at each number in flight N:
  vllm alone      the prompts, N at a time, each file deleted unread once its lock is free (the server's
                  pace: vLLM writes a file for every request in this mode)
  bare loop       what a script does by hand, N at a time: POST, shared lock on the file's .lock, load
                  it, save it, delete it; no database, no checks, no shards
  service         `hsx serve --source vllm` (SQLite, --max-in-flight N) running the prompts as one job,
                  timed from POST /v1/jobs to the job's success
Rounds, fresh prompts and the table as in bench_real_sglang: every kind at every N each round, on token ids
no other run used (vLLM's prefix cache is on), the order turning each round.
"""

from __future__ import annotations

import fcntl
import sys
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import httpx
from safetensors.torch import load_file, save_file

from benchmarks.bench_real_sglang import ALONE, BARE, Send, arguments, measure, print_table, service
from tests.support.real_vllm import VLLM, vllm_python
from tests.support.tiny_llama import make_model

LAYERS = [2, 4, 5, 8]


def each_file(model: str, take: Callable[[str, Path], None]) -> Send:
    """POST the prompt; `take(name, path)` runs on its file under a shared lock; then the file goes."""

    def send(c: httpx.Client, name: str, ids: list[int]) -> None:
        body = {"model": model, "prompt": ids, "max_tokens": 1}
        answer = c.post("/v1/completions", json=body, headers={"X-Request-Id": name})
        path = Path(answer.raise_for_status().json()["kv_transfer_params"]["hidden_states_path"])
        lock = path.with_name(path.name + ".lock")
        with open(lock) as held:
            fcntl.flock(held, fcntl.LOCK_SH)
            take(name, path)
        path.unlink()
        lock.unlink()

    return send


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv, __doc__ or "")
    with tempfile.TemporaryDirectory(prefix="hsx-bench-vllm-") as d:
        work = Path(d)
        make_model(work / "model", hidden=args.hidden)
        server = VLLM(vllm_python(), work, work / "model", LAYERS, work / "dumps").start()
        out = work / "bare"
        out.mkdir()
        model = str(work / "model")
        clients = {
            ALONE: each_file(model, lambda _name, _path: None),
            BARE: each_file(model, lambda name, path: save_file(load_file(path), out / f"{name}.safetensors")),
        }
        print(f"{datetime.now(timezone.utc):%Y-%m-%d}: real vLLM 0.32.0, CPU build, tiny Llama float32")
        print(
            f"(hidden {args.hidden}, 8 layers), {args.rounds} rounds of {args.samples} samples of "
            f"{args.min_tokens}-{args.max_tokens} tokens per kind and number in flight"
        )
        try:
            figures = measure(
                args,
                server.url,
                clients,
                lambda samples, warm, n: service(
                    work,
                    server.url,
                    server.storage,
                    samples,
                    warm,
                    n,
                    layers="eagle3_pre_norm",
                    extra=["--source", "vllm"],
                ),
            )
        finally:
            server.stop()
        print_table(f"vLLM extract_hidden_states (layers {LAYERS}, files)", "vLLM", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

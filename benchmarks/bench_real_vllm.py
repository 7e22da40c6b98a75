"""The service against a bare loop of the same requests, on a real vLLM 0.32.0 (its CPU build) with
hsx's connector writing every request's hidden states.

    python -m benchmarks.bench_real_vllm                   # 60 samples of 100-400 tokens

One server (tests/support/real_vllm.py; a tiny random float32 Llama made here, layers 2, 4, 5 and 8)
and, against it, one sample at a time unless said:
  vllm alone      the same prompts, each file deleted unread once its lock is free (the server's pace:
                  vLLM writes a file for every request in this mode)
  bare loop       what a script does by hand: POST, shared lock on the file's .lock, load it, save it,
                  delete it; no database, no checks, no shards
  service         `hsx serve --source vllm` (SQLite) running the same prompts as one job,
                  --max-in-flight 1 and 4, timed from POST /v1/jobs to the job's success
Prints seconds per sample, tokens/s and CPU seconds per sample; the date heads the table.
"""

from __future__ import annotations

import argparse
import fcntl
import sys
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import httpx
from safetensors.torch import load_file, save_file

from benchmarks.bench_real_sglang import Row, print_table, prompts, service, timed
from tests.support.real_vllm import VLLM, vllm_python
from tests.support.tiny_llama import make_model

LAYERS = [2, 4, 5, 8]


def each_file(url: str, model: str, samples: list[list[int]], take: Callable[[int, Path], None]) -> None:
    """POST every prompt; `take(i, path)` runs on its file under a shared lock; then the file goes."""
    with httpx.Client(timeout=600) as c:
        for i, ids in enumerate(samples):
            body = {"model": model, "prompt": ids, "max_tokens": 1}
            answer = c.post(url + "/v1/completions", json=body, headers={"X-Request-Id": f"bench-{i}"})
            path = Path(answer.raise_for_status().json()["kv_transfer_params"]["hidden_states_path"])
            lock = path.with_name(path.name + ".lock")
            with open(lock) as held:
                fcntl.flock(held, fcntl.LOCK_SH)
                take(i, path)
            path.unlink()
            lock.unlink()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--min-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=400)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hsx-bench-vllm-") as d:
        work = Path(d)
        make_model(work / "model")
        server = VLLM(vllm_python(), work, work / "model", LAYERS, work / "dumps").start()
        samples = prompts(args.samples, args.min_tokens, args.max_tokens)
        out = work / "bare"
        out.mkdir()
        model = str(work / "model")
        try:
            each_file(server.url, model, samples[:3], lambda _i, _p: None)  # warm
            rows: list[Row] = [
                timed("vllm alone", samples, lambda: each_file(server.url, model, samples, lambda _i, _p: None)),
                timed(
                    "bare loop",
                    samples,
                    lambda: each_file(
                        server.url, model, samples, lambda i, path: save_file(load_file(path), out / f"{i}.safetensors")
                    ),
                ),
            ]
            rows += [service(work, server.url, server.storage, samples, n) for n in (1, 4)]
        finally:
            server.stop()
        print(f"{datetime.now(timezone.utc):%Y-%m-%d}: real vLLM 0.32.0, CPU build, tiny Llama float32")
        print(f"(hidden 256, 8 layers), {args.samples} samples of {args.min_tokens}-{args.max_tokens} tokens")
        print_table(f"vLLM extract_hidden_states (layers {LAYERS}, files)", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

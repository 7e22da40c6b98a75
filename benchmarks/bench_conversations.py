"""Conversation jobs: how long creating one takes, and how fast a writer prepares its conversations.

    python -m benchmarks.bench_conversations                 # 100,000 conversations, then 5,000 prepared
    python -m benchmarks.bench_conversations --create 20000 --prepare 1000

1. Creation: an API-only service (SQLite, no writer) takes a JSONL of N ShareGPT conversations streamed as
   NDJSON (what `hsx submit FILE` sends), and, for comparison, a file of the same number of token-id
   samples of about the same length. Conversations are only checked at creation (their turns, roles and
   texts) and stored as they are: rendering waits for a writer, so creation costs what a token-id
   file of the same size costs.
2. Preparation: a service with its writer in front of the reference server (the tiny test model, with a
   Llama-3-style chat template in its folder) prepares M conversations (chat template, loss mask) and
   extracts them; printed: the time until none is left to prepare, and until the job ends.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import httpx

from tests.support.chat import LLAMA3, save_chat_tokenizer
from tests.support.stack import VOCAB, make_checkpoint, start_reference, start_service

# One token-ish word each, so lengths are easy to reason about.
WORDS = ("answer", "one", "two", "three", "question", "hello", "there", "how", "are", "you", "the", "quick")


def conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))

    out = []
    for i in range(n):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns += [{"from": "human", "value": text()}, {"from": "gpt", "value": text()}]
        out.append({"id": f"c{i}", "conversations": turns})
    return out


def token_samples(convs: list[dict]) -> list[dict]:
    """Token-id samples about as long (in tokens) as the conversations: one token a word, plus headers."""
    rng = random.Random(1)
    out = []
    for c in convs:
        n = sum(len(t["value"].split()) + 5 for t in c["conversations"])
        out.append({"id": c["id"], "input_ids": [rng.randrange(VOCAB) for _ in range(n)]})
    return out


def submit(url: str, path: Path) -> tuple[float, dict]:
    started = time.perf_counter()
    with path.open("rb") as f:
        resp = httpx.post(f"{url}/v1/jobs", content=f, headers={"Content-Type": "application/x-ndjson"}, timeout=600)
    resp.raise_for_status()
    return time.perf_counter() - started, resp.json()


def bench_create(tmp: Path, n: int) -> None:
    convs = conversations(n)
    files = {"conversations": convs, "token ids": token_samples(convs)}
    svc = start_service(tmp / "create", f"sqlite:///{tmp / 'create.db'}", extra=["--no-writer"])
    try:
        for kind, samples in files.items():
            path = tmp / f"{kind.replace(' ', '-')}.jsonl"
            path.write_text("".join(json.dumps(s) + "\n" for s in samples))
            seconds, job = submit(svc.url, path)
            mb = path.stat().st_size / 1e6
            counts = job["counts"]
            print(
                f"create {kind:>13}: {n:,} samples, {mb:.1f} MB in {seconds:.2f} s ({n / seconds:,.0f} samples/s); "
                f"preparing {counts['preparing']:,}, queued {counts['queued']:,}"
            )
    finally:
        svc.stop()


def bench_prepare(tmp: Path, m: int) -> None:
    model = save_chat_tokenizer(make_checkpoint(tmp / "model"), LLAMA3, vocab_size=VOCAB)
    ref = start_reference(tmp, model)
    svc = start_service(
        tmp / "prepare", f"sqlite:///{tmp / 'prepare.db'}", backend_url=ref.url, dump_root=ref.dump_root
    )
    try:
        path = tmp / "prepare.jsonl"
        path.write_text("".join(json.dumps(s) + "\n" for s in conversations(m, seed=5)))
        started = time.perf_counter()
        _, job = submit(svc.url, path)
        prepared_at = None
        while True:
            job = svc.get(f"/v1/jobs/{job['id']}").json()
            now = time.perf_counter() - started
            if prepared_at is None and job["counts"]["preparing"] == 0:
                prepared_at = now
            if job["state"] in ("succeeded", "partial", "failed", "cancelled"):
                break
            time.sleep(0.2)
        print(
            f"prepare: {m:,} conversations ({job['tokens']['total']:,} tokens) rendered in {prepared_at:.1f} s "
            f"({m / prepared_at:,.0f}/s, beside extraction); job {job['state']} after {now:.1f} s "
            f"({job['tokens']['total'] / now:,.0f} tokens/s end to end)"
        )
    finally:
        svc.stop()
        ref.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--create", type=int, default=100_000, help="conversations in the created job")
    parser.add_argument("--prepare", type=int, default=5_000, help="conversations prepared and extracted")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.create:
            bench_create(Path(tmp), args.create)
        if args.prepare:
            bench_prepare(Path(tmp), args.prepare)


if __name__ == "__main__":
    main()

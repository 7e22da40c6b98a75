"""A trainer that follows a job as tests kill it: `python -m tests.support.follow_trainer --url URL --job JOB
--log LOG --checkpoint CKPT ...`. It reads a HiddenStateStream (through a StatefulDataLoader with
--workers), writes each item's id and a checksum of its hidden state to LOG (flushed to disk before the
next item), and every --every items, and at the end, saves its checkpoint (the resume token) atomically,
acknowledges it (--consumer) and writes `CKPT n` to LOG. Each start writes `RESUME n`, n the items its
checkpoint counts (a run killed between saving a checkpoint and logging it read exactly that many).
Started again after a SIGKILL, it resumes from its checkpoint."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from torchdata.stateful_dataloader import StatefulDataLoader

from hsx.sdk import HsxClient
from hsx.storage.atomic import atomic_file
from hsx.training import HiddenStateStream


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--consumer", default=None)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shuffle", type=int, default=0)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--item-sleep", type=float, default=0.0)
    p.add_argument("--cache", default=None)
    p.add_argument("--files", default=None)
    args = p.parse_args()

    stream = HiddenStateStream(
        HsxClient(args.url),
        args.job,
        files=args.files,
        cache_dir=args.cache,
        consumer=args.consumer,
        rank=args.rank,
        world_size=args.world_size,
        shuffle_buffer=args.shuffle,
        seed=args.seed,
        epochs=args.epochs,
        wait_s=2.0,
    )
    loader = StatefulDataLoader(stream, batch_size=None, num_workers=args.workers) if args.workers else None
    source = loader if loader is not None else stream
    checkpoint = Path(args.checkpoint)
    done = 0
    if checkpoint.exists():
        saved = json.loads(checkpoint.read_text())
        source.load_state_dict(saved["state"])
        done = saved["n"]
    with open(args.log, "a") as log:
        _write(log, f"RESUME {done}")  # what its checkpoint says it had read: the log may say more
        for item in source:
            done += 1
            _write(log, f"{item['id']} {item['hidden_state'].float().sum().item():.6f}")
            time.sleep(args.item_sleep)
            if done % args.every == 0:
                _checkpoint(checkpoint, source, stream, args.consumer, done, log)
        _checkpoint(checkpoint, source, stream, args.consumer, done, log)  # the end: every worker's last state
        _write(log, "DONE")


def _checkpoint(checkpoint: Path, source, stream: HiddenStateStream, consumer: str | None, done: int, log) -> None:
    """Save the resume token with the count of items read, then acknowledge it: in that order."""
    state = source.state_dict()
    with atomic_file(checkpoint) as f:
        f.write(json.dumps({"state": state, "n": done}).encode())
    if consumer:
        stream.ack(state)
    _write(log, f"CKPT {done}")


def _write(log, line: str) -> None:
    log.write(line + "\n")
    log.flush()
    os.fsync(log.fileno())


if __name__ == "__main__":
    main()

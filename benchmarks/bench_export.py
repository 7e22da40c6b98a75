"""What `hsx export` costs per GB of a job, for each target, with one worker and with several.

    python -m benchmarks.bench_export                    # a 512 MiB job, 1 and 4 workers, 3 runs each
    python -m benchmarks.bench_export --mib 2048 --workers 2 --dir /data/tmp
    python -m benchmarks.bench_export --hidden 1024 --tokens 20,300   # many small files

Builds a job as the service stores it (bf16 shards of EAGLE-3's four layers, hidden 4096, samples of
128-1024 tokens, written by hsx's own shard writer, whose CPU per GB is printed as the reference: what
persisting the same bytes cost extraction), then exports it to every target in turn, each into a fresh
folder on the same disk after a sync, with the shards evicted from the page cache (an export reads a
job written long before; --hot leaves them cached). Every export runs once first on a small job,
unmeasured, so that first-call costs (imports) are left out of the rows of 1 and N workers (export_job
in this process); the row "command" is the whole `hsx export --workers N` command, a process of its own,
its start (Python, torch) included. A row gives the export's wall seconds, its CPU seconds (this process
and its children: RUSAGE_SELF + RUSAGE_CHILDREN) per GB of the job's shards, and the disk it took beyond
the job's own (blocks of the files it wrote that the job folder does not share).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from benchmarks.report import Column, Report, add_json_argument
from hsx.exports import export_job
from hsx.manifest import Manifest, ManifestSample, ManifestShard, write_manifest
from hsx.states import JobState
from hsx.storage.shards import ShardSample, shard_name, write_shard

NUM_LAYERS = 32
LAYERS = [2, NUM_LAYERS // 2, NUM_LAYERS - 3, NUM_LAYERS]
MiB = 1024 * 1024
TARGETS = ("specforge", "speculators", "modelopt")
# deepspec (--targets ...,deepspec) takes the job's EAGLE-3 layers as its taps: the job holds no other set.
OPTIONS = {"deepspec": {"layer_set": "eagle3"}}
FLAGS = {"deepspec": ["--layer-set", "eagle3"]}


def cpu_seconds() -> float:
    """CPU of this process and of every child it has waited for (the export's worker processes)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _sample(k: int, tokens: int, hidden: int, weight: torch.Tensor, gen: torch.Generator) -> ShardSample:
    layers = {i: torch.randn(tokens, hidden, generator=gen) + (i % 7) for i in LAYERS[:-1]}
    last = torch.randn(tokens, hidden, generator=gen)
    # layer L after the final RMS norm, as a real model's: what the speculators export divides back out
    layers[NUM_LAYERS] = last / last.pow(2).mean(-1, keepdim=True).sqrt() * weight
    ids = torch.randint(0, 32000, (tokens,), generator=gen).numpy().astype(np.int64)
    raw = {i: t.bfloat16().view(torch.uint8).numpy().tobytes() for i, t in layers.items()}
    return ShardSample(f"sample-{k}", ids, (np.arange(tokens) % 5 != 0).astype(np.int64), raw)


def build_job(root: Path, args: argparse.Namespace, weight: torch.Tensor) -> tuple[Path, int, float]:
    """The job folder, its shards' bytes, and the shard writer's CPU seconds for them."""
    job_dir = root / "job_bench"
    job_dir.mkdir(parents=True)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    row_bytes = len(LAYERS) * args.hidden * 2 + 16
    budget, pending, written = args.mib * MiB, [], 0
    shards: list[ManifestShard] = []
    entries: list[ManifestSample] = []
    writer_cpu = 0.0

    def flush() -> None:
        nonlocal writer_cpu
        cpu0 = cpu_seconds()
        info = write_shard(job_dir / shard_name(len(shards)), pending, LAYERS, "bfloat16", args.hidden)
        writer_cpu += cpu_seconds() - cpu0
        shards.append(
            ManifestShard(
                name=info.name,
                bytes=info.bytes,
                sha256=info.sha256,
                num_samples=info.num_samples,
                num_tokens=info.num_tokens,
            )
        )
        entries.extend(
            ManifestSample(id=s.sample_id, shard=info.name, offset=o, num_tokens=s.num_tokens)
            for s, o in zip(pending, info.offsets)
        )
        pending.clear()

    while written < budget:
        tokens = rng.randint(*args.tokens)
        pending.append(_sample(len(entries) + len(pending), tokens, args.hidden, weight, gen))
        written += tokens * row_bytes
        if sum(s.num_tokens for s in pending) * row_bytes >= args.shard_mib * MiB:
            flush()
    if pending:
        flush()
    manifest = Manifest(
        job_id="job_bench",
        name="bench",
        state=JobState.SUCCEEDED,
        model={"model_path": "bench", "model_type": "llama", "num_hidden_layers": NUM_LAYERS, "vocab_size": 32000},
        layers=LAYERS,
        post_norm_layers=[NUM_LAYERS],
        hidden_size=args.hidden,
        dtype="bfloat16",
        num_samples=len(entries),
        num_stored=len(entries),
        shards=shards,
        samples=entries,
    )
    write_manifest(job_dir, manifest)
    return job_dir, sum(s.bytes for s in shards), writer_cpu


def extra_disk_bytes(out: Path, job_dir: Path) -> int:
    """Blocks of the files under `out` that no file of the job folder shares (hard links count once)."""
    shared = {(p.stat().st_dev, p.stat().st_ino) for p in job_dir.iterdir() if p.is_file()}
    seen: set[tuple[int, int]] = set()
    total = 0
    for p in out.rglob("*"):
        st = p.lstat()
        key = (st.st_dev, st.st_ino)
        if p.is_file() and key not in shared and key not in seen:
            seen.add(key)
            total += st.st_blocks * 512
    return total


def drop_cached(job_dir: Path) -> None:
    """Evict the job's shards from the page cache: an export reads a job written long before."""
    for p in job_dir.glob("shard-*"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run(target: str, workers: int, job_dir: Path, out: Path, options: dict, hot: bool) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and files of one export into the fresh folder `out`."""
    os.sync()  # no export pays for the writeback of the one before it
    if not hot:
        drop_cached(job_dir)
    cpu0, start = cpu_seconds(), time.perf_counter()
    result = export_job(target, job_dir, out, workers=workers, **options)
    return time.perf_counter() - start, cpu_seconds() - cpu0, result.written


def run_command(
    target: str, workers: int, job_dir: Path, out: Path, flags: list[str], hot: bool
) -> tuple[float, float, int]:
    """The same export as the `hsx export` command, a process of its own: its start (Python, torch)
    included."""
    os.sync()
    if not hot:
        drop_cached(job_dir)
    cpu0, start = cpu_seconds(), time.perf_counter()
    args = [sys.executable, "-m", "hsx.cli", "export", target, str(job_dir), str(out), "-q", "--workers", str(workers)]
    subprocess.run([*args, *flags], check=True)
    files = sum(1 for p in out.rglob("*") if p.is_file() and p.suffix in (".ckpt", ".pt", ".safetensors", ".bin"))
    return time.perf_counter() - start, cpu_seconds() - cpu0, files


def warm_up(tmp: Path, args: argparse.Namespace, weight: torch.Tensor, options: dict) -> None:
    """Every export once on a small job, unmeasured: what a first call costs once (imports, first
    allocations) is not what an export costs per GB."""
    small = argparse.Namespace(**{**vars(args), "mib": 8, "shard_mib": 4})
    job_dir = build_job(tmp / "warm", small, weight)[0]
    for target in args.targets.split(","):
        for workers in sorted({1, args.workers}):
            export_job(
                target, job_dir, tmp / "warm" / f"{target}-{workers}", workers=workers, **options.get(target, {})
            )
    shutil.rmtree(tmp / "warm")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="the job's size (default: 512 MiB)")
    parser.add_argument("--shard-mib", type=int, default=128, help="shard size (default: 128 MiB)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument(
        "--tokens",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=(128, 1024),
        metavar="LO,HI",
        help="each sample's token count, at random between the two (default: 128,1024)",
    )
    parser.add_argument("--workers", type=int, default=4, help="the parallel row's workers (default: 4)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; the row shows their medians (default: 3)")
    parser.add_argument(
        "--targets", default=",".join(TARGETS), help="comma-separated (default: these three; deepspec too)"
    )
    parser.add_argument("--hot", action="store_true", help="leave the shards in the page cache (default: evict them)")
    parser.add_argument("--dir", default=None, help="where the job and the exports go (default: the temp folder)")
    add_json_argument(parser)
    return parser.parse_args()


COLUMNS = (
    Column("target", "target", left=True),
    Column("workers", "workers"),
    Column("files", "files"),
    Column("wall_s", "wall s", ".2f"),
    Column("gb_s", "GB/s", ".2f"),
    Column("cpu_s", "CPU s", ".2f"),
    Column("cpu_s_per_gb", "CPU s/GB", ".2f"),
    Column("cpu_range", "(range)"),
    Column("x_writer", "x writer", ".2f"),
    Column("extra_disk_mib", "extra disk MiB", ".0f"),
    Column("x_job", "x job", ".2f"),
)


def main() -> None:
    args = parse_args()
    report = Report("bench_export", args)
    with tempfile.TemporaryDirectory(prefix="hsx-bench-export-", dir=args.dir) as tmp_name:
        tmp = Path(tmp_name)
        weight = torch.rand(args.hidden) + 0.5
        save_file({"model.norm.weight": weight}, tmp / "norm.safetensors")
        options = {"speculators": {"final_norm_weight": tmp / "norm.safetensors"}, **OPTIONS}
        warm_up(tmp, args, weight, options)
        job_dir, job_bytes, writer_cpu = build_job(tmp, args, weight)
        gb = job_bytes / 1e9
        print(
            f"job: {job_bytes / MiB:.0f} MiB in {len(list(job_dir.glob('shard-*')))} shards, bf16, hidden "
            f"{args.hidden}, layers {LAYERS}, {args.tokens[0]}-{args.tokens[1]} tokens a sample; shards "
            f"{'in' if args.hot else 'out of'} the page cache; {len(os.sched_getaffinity(0))} CPUs; the shard "
            f"writer (reference: extraction persisting them) {writer_cpu / gb:.2f} CPU s/GB; medians of {args.repeat}"
        )
        report.figure("writer_cpu_s_per_gb", writer_cpu / gb)
        table = report.table("exports", *COLUMNS)
        flags = {"speculators": ["--final-norm-weight", str(tmp / "norm.safetensors")], **FLAGS}
        for target in args.targets.split(","):
            rows = [(str(w), w, run) for w in sorted({1, args.workers})]
            rows.append(("command", args.workers, run_command))
            for label, workers, how in rows:
                extra_args = options.get(target, {}) if how is run else flags.get(target, [])
                walls, cpus = [], []
                for k in range(args.repeat):
                    out = tmp / f"{target}-{label}"
                    wall, cpu, files = how(target, workers, job_dir, out, extra_args, args.hot)
                    walls.append(wall)
                    cpus.append(cpu)
                    if k == 0:
                        extra = extra_disk_bytes(out, job_dir)
                    shutil.rmtree(out)
                wall, cpu = statistics.median(walls), statistics.median(cpus)
                table.add(
                    target=target,
                    workers=label if label == "command" else workers,
                    files=files,
                    wall_s=wall,
                    gb_s=gb / wall,
                    cpu_s=cpu,
                    cpu_s_per_gb=cpu / gb,
                    cpu_range=f"{min(cpus) / gb:.2f}-{max(cpus) / gb:.2f}",
                    cpu_s_per_gb_min=min(cpus) / gb,
                    cpu_s_per_gb_max=max(cpus) / gb,
                    x_writer=cpu / writer_cpu,
                    extra_disk_mib=extra / MiB,
                    x_job=extra / job_bytes,
                )
    report.write()


if __name__ == "__main__":
    main()

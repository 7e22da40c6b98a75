"""The encodings of stored hidden states: what they save, what they cost, and a job's rate with each.

    python -m benchmarks.bench_encoding
    python -m benchmarks.bench_encoding --trained /path/to/a/hf/checkpoint   # a trained model's too
    python -m benchmarks.bench_encoding --only codecs                          # no service, quickly

Three parts, in one run on this machine:

  codecs    hidden states of real models, each captured layer in bfloat16, float16 and float32, stored
            raw, lossless and fp8 by hsx's shard writer: bytes per token of the shards (input_ids and
            loss_mask included) and their ratio to raw; encode and decode MB/s per core (raw bytes per
            CPU second of the one thread doing it: the encoders as the shard writer calls them, fp8's
            error measurement included; the decoding every reader does); for fp8 the largest and the
            mean error relative to a row's largest magnitude. The models: the tiny random Llama the
            tests and the reference server use (hidden 64, 8 layers, layers 2, 4, 5, 8, on random
            ids), and with --trained a checkpoint of a trained model (any transformers model; its
            input is this repository's documentation, tokenized by its own tokenizer). The alternative
            codecs the lossless one was chosen over are measured on the same bfloat16 states when
            their packages are installed (blosc2, lz4), else skipped.
  jobs      one service and a synthetic reference server (hidden 4096, 4 layers, bfloat16, rid mode,
            requests in flight), jobs of the same samples stored raw, lossless and fp8, in turn, --rounds
            times: each job's tokens/s from its creation to its end, and its ratio to the raw jobs' (the
            median of each); with an instant server (the service bound by the two cores it shares with
            the server) and with a simulated prefill (the model the bottleneck, as on a GPU).
  dataset   hsx.training.HiddenStateDataset reading every item of those jobs in one process, torch on
            one thread: samples/s, tokens/s and MB/s of hidden states per core (the files are in the page
            cache: what it measures is the reading and decoding, not the disk).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.report import Column, Report, add_json_argument
from hsx.dtypes import DTYPES, HIDDEN_STATE_DTYPES
from hsx.manifest import load_manifest
from hsx.reference.model import load_model
from hsx.sdk import HsxClient
from hsx.storage.encoding import ENCODINGS, LayerEncoder, block_rows, encoding_of
from hsx.storage.mapped import MappedShard
from hsx.training import HiddenStateDataset
from tests.support.jobs import Sample, make_job
from tests.support.procs import Process, free_port, hsx_command

MB = 1e6
REPO = Path(__file__).resolve().parents[1]


# --- codecs ----------------------------------------------------------------------------------------------


def tiny_llama_states(tokens: int, seed: int = 0) -> tuple[list[int], list[tuple[list[int], list[torch.Tensor]]]]:
    """The reference server's embedded tiny Llama on random ids, sequences of 200-1000 tokens, float32."""
    model, _ = load_model(None, "float32")
    layers = [2, 4, 5, 8]
    rng = random.Random(seed)
    out = []
    with torch.inference_mode():
        while sum(len(ids) for ids, _ in out) < tokens:
            ids = [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(200, 1000))]
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            out.append((ids, [hs[i][0].clone() for i in layers]))
    return layers, out


def trained_states(path: str, tokens: int) -> tuple[list[int], list[tuple[list[int], list[torch.Tensor]]]]:
    """A trained checkpoint's hidden states on this repository's documentation, float32."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    n = int(model.config.num_hidden_layers)
    layers = sorted({2, n // 2, n - 3, n} if n >= 8 else {1, n // 2, n - 1, n})
    text = "\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"])
    width = min(512, int(getattr(model.config, "max_position_embeddings", 512)))
    ids_all = tokenizer(text, add_special_tokens=False)["input_ids"]
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids_all), width - 2):
            ids = ids_all[start : start + width - 2]
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            out.append((ids, [hs[i][0].clone() for i in layers]))
            if sum(len(i) for i, _ in out) >= tokens:
                break
    return layers, out


def thread_seconds(fn: Callable[..., object], *args: object) -> float:
    """CPU seconds of this thread running fn(*args)."""
    start = time.thread_time()
    fn(*args)
    return time.thread_time() - start


def decode_all(shard: MappedShard, layers: list[int], tokens: int) -> None:
    for i in layers:
        shard.rows(f"layer_{i}", 0, tokens)


def timed_codec(encode: Callable[[bytes], Any], decode: Callable[[Any], object], pieces: list[bytes]):
    """(compressed bytes, encode CPU seconds, decode CPU seconds) of every piece; an encoding may give
    a list of frames."""
    start = time.thread_time()
    blobs = [encode(p) for p in pieces]
    encoded = time.thread_time()
    for b in blobs:
        decode(b)
    size = sum(sum(map(len, b)) if isinstance(b, list) else len(b) for b in blobs)
    return size, encoded - start, time.thread_time() - encoded


def by_planes(compress: Callable[[bytes], bytes], decompress: Callable[[bytes], bytes]):
    """A codec applied to each byte plane of bfloat16 values apart (planes cut and joined as hsx does)."""

    def encode(piece: bytes) -> list[bytes]:
        values = np.frombuffer(piece, dtype="<u2")
        return [
            compress((values & 0xFF).astype(np.uint8).tobytes()),
            compress((values >> 8).astype(np.uint8).tobytes()),
        ]

    def decode(frames: list[bytes]) -> np.ndarray:
        low, high = (np.frombuffer(decompress(f), dtype=np.uint8) for f in frames)
        values = high.astype("<u2")
        values <<= 8
        values |= low
        return values

    return encode, decode


def codec_rows(name: str, layers: list[int], states, work: Path) -> list[dict]:
    rows = []
    tokens = sum(len(ids) for ids, _ in states)
    for dtype in HIDDEN_STATE_DTYPES:
        d = DTYPES[dtype]
        samples = [
            Sample(
                f"s{k}",
                torch.tensor(ids),
                torch.ones(len(ids), dtype=torch.int64),
                {i: h.to(d.torch).contiguous() for i, h in zip(layers, hs)},
            )
            for k, (ids, hs) in enumerate(states)
        ]
        hidden = samples[0].layers[layers[0]].shape[1]
        raw_layer_bytes = tokens * hidden * d.itemsize * len(layers)
        raw_bytes = None
        for enc in ENCODINGS:
            job = make_job(
                work / f"{name}-{dtype}-{enc}",
                layers=layers,
                hidden=hidden,
                dtype=dtype,
                samples=samples,
                samples_per_shard=len(samples),
                num_hidden_layers=max(layers),
                encoding=enc,
            )
            size = sum(s.bytes for s in job.manifest.shards)
            raw_bytes = raw_bytes or size
            row = {
                "model": name,
                "dtype": dtype,
                "encoding": enc,
                "bytes_token": size / tokens,
                "ratio": size / raw_bytes,
            }
            if encoding_of(enc).encoded:
                row["encode_mb_s"] = raw_layer_bytes / encode_seconds(enc, samples, layers, d, hidden) / MB
                shard = MappedShard(job.job_dir / job.manifest.shards[0].name)
                decode_all(shard, layers, tokens)  # unmeasured, as above; the file is in the page cache since
                seconds = thread_seconds(decode_all, shard, layers, tokens)
                row["decode_mb_s"] = raw_layer_bytes / seconds / MB
                stats = job.manifest.encoded_layers or []
                if enc == "fp8":
                    row["max_error"] = max(e.max_error or 0 for e in stats)
                    row["mean_error"] = statistics.fmean(e.mean_error or 0 for e in stats)
            rows.append(row)
    return rows


def encode_seconds(enc: str, samples: list[Sample], layers: list[int], d, hidden: int) -> float:
    """CPU seconds of this thread encoding every layer of every sample, block by block, as the shard
    writer does."""
    row_bytes = hidden * d.itemsize
    step = block_rows(row_bytes)
    blocks = [
        s.layers[i].view(torch.uint8).numpy().reshape(-1, row_bytes)[k : k + step]
        for i in layers
        for s in samples
        for k in range(0, s.input_ids.shape[0], step)
    ]
    encoder = encoding_of(enc).encoder("layer", d, hidden)
    encode_all(encoder, blocks)  # unmeasured: a process's first pass pays for faulting its arrays' memory in
    return thread_seconds(encode_all, encoder, blocks)


def encode_all(encoder: LayerEncoder, blocks: list[np.ndarray]) -> None:
    for block in blocks:
        encoder.encode(block)


def alternatives(states, layers: list[int]) -> list[str]:
    """What the codecs the lossless encoding was chosen over make of the same bfloat16 states."""
    data = np.concatenate(
        [h.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().reshape(-1) for _, hs in states for h in hs]
    )
    lines = []
    import lzma
    import zlib

    import zstandard

    zstd_decompress = zstandard.ZstdDecompressor().decompress
    candidates: dict[str, tuple[Callable[[bytes], Any], Callable[[Any], object]]] = {
        "zlib 6, whole": (lambda b: zlib.compress(b, 6), zlib.decompress),
        "zstd 3, whole": (zstandard.ZstdCompressor(level=3).compress, zstd_decompress),
        "zstd 1, byte planes": by_planes(zstandard.ZstdCompressor(level=1).compress, zstd_decompress),
        "lzma, byte planes": by_planes(lzma.compress, lzma.decompress),
    }
    if importlib.util.find_spec("blosc2"):
        import blosc2

        blosc2.set_nthreads(1)
        for codec, filt, label in (
            (blosc2.Codec.ZSTD, blosc2.Filter.SHUFFLE, "blosc2 shuffle + zstd 1"),
            (blosc2.Codec.ZSTD, blosc2.Filter.BITSHUFFLE, "blosc2 bitshuffle + zstd 5"),
            (blosc2.Codec.LZ4, blosc2.Filter.BITSHUFFLE, "blosc2 bitshuffle + lz4 5"),
        ):
            level = 1 if "zstd 1" in label else 5
            candidates[label] = (
                lambda b, c=codec, f=filt, lv=level: blosc2.compress(b, typesize=2, clevel=lv, filter=f, codec=c),
                blosc2.decompress,
            )
    else:
        lines.append("  (blosc2 not installed: its filters skipped)")
    block = 256 * 1024
    pieces = [data[k : k + block].tobytes() for k in range(0, len(data), block)]
    for label, (enc, dec) in candidates.items():
        # lzma encodes a few MB/s: the first 4 MiB are enough for its ratio and rates
        some = pieces[:16] if label.startswith("lzma") else pieces
        total = sum(map(len, some))
        size, e, d = timed_codec(enc, dec, some)
        lines.append(
            f"  {label:28s} {size / total:.3f}x  encode {total / e / MB:7.0f} MB/s  decode {total / d / MB:7.0f} MB/s"
        )
    return lines


def codec_report(args, work: Path, report: Report) -> None:
    print(f"codecs: {os.cpu_count()} cores; MB/s per core = raw bytes per CPU second of one thread")
    models = [("tiny Llama (tests)", *tiny_llama_states(args.codec_tokens))]
    if args.trained:
        models.append((f"trained: {Path(args.trained).name}", *trained_states(args.trained, args.codec_tokens)))
    for name, layers, states in models:
        tokens = sum(len(ids) for ids, _ in states)
        hidden = states[0][1][0].shape[1]
        print(f"\n{name}: {tokens} tokens in {len(states)} samples, hidden {hidden}, layers {layers}")
        table = report.table(
            f"codecs: {name}",
            Column("dtype", "dtype"),
            Column("encoding", "encoding"),
            Column("bytes_token", "bytes/token", ".0f"),
            Column("ratio", "x raw", ".3f"),
            Column("encode_mb_s", "encode MB/s", ".0f"),
            Column("decode_mb_s", "decode MB/s", ".0f"),
            Column("max_error", "fp8 max error", ".4f"),
            Column("mean_error", "fp8 mean error", ".4f"),
            markdown=True,
        )
        for r in codec_rows(name.split(":")[0].replace(" ", "-"), layers, states, work):
            table.add(**({c.key: None for c in table.columns} | r))
        print("other codecs on the same bfloat16 layers (256 KiB blocks, one thread; hsx's lossless above):")
        for line in alternatives(states, layers):
            print(line)


# --- jobs and the Dataset ---------------------------------------------------------------------------------


class Jobs:
    def __init__(self, args, work: Path, shm: Path, prefill_us: float):
        self.args, self.work = args, work
        port = free_port()
        self.server = Process(
            hsx_command()
            + ["reference-server", "--synthetic", "--hidden-size", str(args.hidden), "--num-layers", "32"]
            + ["--layers", "2,16,29,32", "--dump-root", str(shm / f"dumps-{prefill_us:g}"), "--port", str(port)]
            + ["--prefill-us-per-token", str(prefill_us), "--skip-server-warmup"]
            + ["--name-by", "rid", "--max-batch", str(args.in_flight)],
            work / f"reference-{prefill_us:g}.log",
        )
        self.server.wait_http(f"http://127.0.0.1:{port}/health")
        svc_port = free_port()
        self.output = work / f"output-{prefill_us:g}"
        self.service = Process(
            hsx_command()
            + ["serve", "--backend-url", f"http://127.0.0.1:{port}", "--dump-root", str(shm / f"dumps-{prefill_us:g}")]
            + ["--output-root", str(self.output), "--input-root", str(work)]
            + ["--database-url", f"sqlite:///{work / f'hsx-{prefill_us:g}.db'}", "--port", str(svc_port)]
            + ["--max-in-flight", str(args.in_flight), "--log-level", "warning"],
            work / f"service-{prefill_us:g}.log",
        )
        self.url = f"http://127.0.0.1:{svc_port}"
        self.service.wait_http(self.url + "/healthz")
        rng = random.Random(0)
        self.samples = [
            {"id": f"b{i}", "input_ids": [rng.randrange(32000) for _ in range(args.tokens)]}
            for i in range(args.samples)
        ]

    def run(self, enc: str) -> tuple[float, float, str]:
        """One job of the samples stored in `enc`: its extraction rate (tokens/s until every sample is
        extracted: staged or in a shard), its rate until it finished (its last shards written), its id."""
        tokens = len(self.samples) * self.args.tokens
        with HsxClient(self.url, timeout=600) as hsx:
            started = time.monotonic()
            job = hsx.create_job(self.samples, name=enc, options={"encoding": enc})
            while (job := hsx.get_job(job.id)).tokens.staged + job.tokens.done < tokens:
                time.sleep(0.05)
            extracted = time.monotonic() - started
            done = hsx.wait(job.id, poll_s=0.05, max_poll_s=0.05)
            finished = time.monotonic() - started
        assert done.state == "succeeded", done
        return tokens / extracted, tokens / finished, job.id

    def stop(self) -> None:
        self.service.stop()
        self.server.stop()


def dataset_rate(folder: Path) -> tuple[float, float, float]:
    """samples/s, tokens/s and MB/s of hidden states of reading every item once, per CPU second."""
    ds = HiddenStateDataset(folder)
    hidden_bytes = 0
    start = time.thread_time()
    for item in ds:
        hidden_bytes += item["aux_hidden_state"].nbytes + item["hidden_state"].nbytes
    seconds = time.thread_time() - start
    return len(ds) / seconds, sum(ds.lengths) / seconds, hidden_bytes / seconds / MB


def jobs_report(args, work: Path, shm: Path, report: Report) -> None:
    torch.set_num_threads(1)
    print(
        f"\njobs: {args.samples} samples of {args.tokens} tokens x 4 layers x hidden {args.hidden} bfloat16 "
        f"({args.tokens * 4 * args.hidden * 2 / 2**20:.1f} MiB each), {args.in_flight} in flight, "
        f"synthetic reference server; raw, lossless, fp8 in turn, {args.rounds} rounds, medians"
    )
    table = report.table(
        "jobs",
        Column("server", "server"),
        Column("encoding", "encoding"),
        Column("extracted_tokens_s", "extracted tokens/s", ",.0f"),
        Column("extracted_x_raw", "x raw", ".3f"),
        Column("finished_tokens_s", "until finished tokens/s", ",.0f"),
        Column("finished_x_raw", "x raw", ".3f"),
        Column("bytes_x_raw", "shard bytes x raw", ".3f"),
        Column("dataset_samples_s", "Dataset samples/s", ".1f"),
        Column("dataset_tokens_s", "tokens/s", ",.0f"),
        Column("dataset_mb_s", "MB/s per core", ",.0f"),
        markdown=True,
    )
    servers = {
        "instant": ("instant", 0.0),
        "prefill": (f"prefill {args.prefill_us_per_token:g} us/token", args.prefill_us_per_token),
    }
    for label, prefill in (servers[name] for name in args.servers.split(",")):
        jobs = Jobs(args, work, shm, prefill)
        try:
            jobs.run("raw")  # warm: a service's first job pays for what a process does once
            rates: dict[str, list[tuple[float, float]]] = {e: [] for e in ENCODINGS}
            last: dict[str, str] = {}
            for _ in range(args.rounds):
                for enc in ENCODINGS:
                    extracted, finished, job_id = jobs.run(enc)
                    rates[enc].append((extracted, finished))
                    last[enc] = job_id
        finally:
            jobs.stop()
        medians = {e: [statistics.median(r[k] for r in runs) for k in (0, 1)] for e, runs in rates.items()}
        sizes = {e: sum(s.bytes for s in load_manifest(jobs.output / j).shards) for e, j in last.items()}
        for enc in ENCODINGS:
            (extracted, finished), (raw_extracted, raw_finished) = medians[enc], medians["raw"]
            per_s = dataset_rate(jobs.output / last[enc])
            table.add(
                server=label,
                encoding=enc,
                extracted_tokens_s=extracted,
                extracted_x_raw=extracted / raw_extracted,
                finished_tokens_s=finished,
                finished_x_raw=finished / raw_finished,
                bytes_x_raw=sizes[enc] / sizes["raw"],
                dataset_samples_s=per_s[0],
                dataset_tokens_s=per_s[1],
                dataset_mb_s=per_s[2],
            )
        for folder in jobs.output.glob("job_*"):
            for f in folder.iterdir():
                f.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trained", help="a trained model's checkpoint folder (transformers), measured too")
    parser.add_argument("--codec-tokens", type=int, default=12000, help="tokens per model in the codec part")
    parser.add_argument("--samples", type=int, default=16, help="samples per job (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="jobs of each encoding per server (default: %(default)s)")
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=500.0,
        help="the simulated prefill of the second server, per token of its longest prompt in a batch (default: "
        "%(default)s: with 8 in flight, 16,000 tokens/s, 0.5 GB/s of hidden states, the model the bottleneck)",
    )
    parser.add_argument("--only", choices=["all", "codecs", "jobs"], default="all")
    parser.add_argument(
        "--servers", default="instant,prefill", help="the jobs' servers, of instant and prefill (default: %(default)s)"
    )
    parser.add_argument("--output-dir", default=".", help="a folder on the disk the jobs write to (default: here)")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    report = Report("bench_encoding", args)
    with (
        tempfile.TemporaryDirectory(prefix="hsx-bench-", dir=args.output_dir) as tmp,
        tempfile.TemporaryDirectory(prefix="hsx-bench-", dir="/dev/shm") as shm,
    ):
        if args.only in ("all", "codecs"):
            codec_report(args, Path(tmp), report)
        if args.only in ("all", "jobs"):
            jobs_report(args, Path(tmp), Path(shm), report)
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`hsx submit`: create a job from a local JSONL file (streamed) or a file under the service's input root."""

from __future__ import annotations

import argparse
import os
import stat
import sys
from typing import TYPE_CHECKING, Any, BinaryIO, get_args

from pydantic import ValidationError

from hsx.cli.client.common import ENV_NOTE, UsageError, add_common, add_quiet, follow, outcome, print_json, run
from hsx.cli.progress import PROGRESS_NOTE, progress
from hsx.layers import ANY_LAYERS, DEFAULT_LAYER_SET, LAYER_SETS, layer_choice_arg, shown_choice
from hsx.wire import Encoding, InvalidPolicy, JobOptions, LengthPolicy, LossPolicy, RegenerateOptions, SeedIgnored

if TYPE_CHECKING:
    from hsx.sdk import HsxClient, Job

NAME = "submit"
HELP = "create a job from a JSONL file (streamed) or a file under the service's input root"
DESCRIPTION = f"""Create an extraction job.

FILE is a local JSONL file with one sample per line: token ids, {{"id": ..., "input_ids": [...],
"loss_mask": [...]}} (id and loss_mask optional), or a conversation, {{"id": ..., "messages": [{{"role": ...,
"content": ...}}, ...]}} or ShareGPT's {{"id": ..., "conversations": [{{"from": ..., "value": ...}}, ...]}}.
Conversations are rendered with the model's own chat template (--tokenizer, a folder under the service's
--tokenizer-roots; default: the model path the server reports), with a loss mask on what the assistant
says (--loss), before extraction; with --regenerate N every assistant turn is first generated again by
the model (at most N tokens).
FILE is streamed to the service as application/x-ndjson, never read whole; "-" reads standard input.
With --input-path the service reads a JSONL or Parquet file under its own input root instead.
Every sample is checked before anything is stored: a refused job lists each bad line on stderr and
exits 2. --max-length with --length-policy truncate or skip, and --on-invalid skip, keep a few bad
samples from refusing the whole file: they are counted as skipped, each with its reason.
--encoding lossless stores the hidden states compressed, bit for bit (about 0.7x the bytes of bfloat16);
--encoding fp8 as float8_e4m3fn with a float32 scale per row (about 0.5x, each value within 1/28 of its
row's largest magnitude). Every reader decodes them.
The job's id comes first on stdout, then what it holds. With --wait the job is followed until it
finishes, its progress on stderr: exit 0 when it succeeded (every sample not skipped is stored), 3 when it
is partial (some samples failed: see hsx samples JOB --state failed), 1 when it failed (nothing stored) or
was cancelled; how it ended is said on stderr unless it succeeded. -q prints the job's id alone on stdout
and no progress, for scripts: JOB=$(hsx submit FILE -q --wait) sets JOB, and the exit status says how the
job ended (errors still go to stderr).
The upload of FILE shows its progress in bytes. {PROGRESS_NOTE}
{ENV_NOTE}

examples:
  hsx submit samples.jsonl --name run1 --wait
  JOB=$(hsx submit samples.jsonl -q --wait) || echo "job $JOB did not succeed"
  hsx submit conversations.jsonl --name chat1 --max-length 2048 --length-policy truncate --wait
  hsx submit --input-path run1.jsonl --layers 2,4,5,8 --idempotency-key run1 --json
  hsx submit samples.jsonl --name run2 --encoding lossless --wait
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", metavar="FILE", help="local JSONL file to stream ('-': standard input)")
    parser.add_argument("--input-path", help="a JSONL file under the service's input root, read by the service")
    parser.add_argument("--name", help="job name")
    parser.add_argument(
        "--layers",
        type=layer_choice_arg,
        metavar="SET|LIST",
        help=f"what the job's trainer reads: a named set ({', '.join([*LAYER_SETS, ANY_LAYERS])}; default "
        f"{DEFAULT_LAYER_SET}: EAGLE-3's three aux layers and the last after the final norm, for SpecForge and "
        "Model Optimizer; eagle3_pre_norm for vLLM speculators; dflash for DeepSpec's DFlash and DSpark), layers "
        "such as 2,4,5,8, or several sets and layers such as eagle3,dflash (their union captured once, each set "
        "read back by name); the job runs only on workers whose server gives them, and says what it waits for",
    )
    parser.add_argument("--idempotency-key", help="repeating a submission with the same key returns the first job")
    add_policy_arguments(parser)
    parser.add_argument("--wait", action="store_true", help="follow the job's progress until it finishes")
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between progress updates with --wait (default: %(default)s)",
    )
    add_quiet(parser, help="print only the job's id on stdout: no upload meter, no progress (errors still on stderr)")
    add_common(parser)


# The flags' choices and defaults are the API's own (hsx.wire), never a second list.
_DEFAULTS = JobOptions.model_validate({})
_REGENERATE = RegenerateOptions(max_new_tokens=1)  # what a regeneration takes for the flags not given
_SAMPLING = {"temperature": "--temperature", "top_p": "--top-p", "seed": "--seed", "seed_ignored": "--seed-ignored"}


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """The job's options (hsx.wire.JobOptions) as flags."""
    group = parser.add_argument_group("samples and conversations")
    group.add_argument("--max-length", type=int, metavar="N", help="the most tokens a sample may have")
    group.add_argument(
        "--length-policy",
        choices=get_args(LengthPolicy),
        default=_DEFAULTS.length_policy,
        help="a sample over --max-length (or the server's limit): keep its first N tokens (truncate), keep its "
        "whole turns up to the last answer that ends within N (truncate_turns), skip it, or refuse the whole job "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--on-invalid",
        choices=get_args(InvalidPolicy),
        default=_DEFAULTS.on_invalid,
        help="an invalid line or sample: refuse the whole job, or skip it (default: %(default)s)",
    )
    group.add_argument(
        "--loss",
        choices=get_args(LossPolicy),
        default=_DEFAULTS.loss,
        help="a conversation's loss mask: what the assistant says, its last turn only, or every token "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenizer folder on the writers' hosts: an absolute path under the service's --tokenizer-roots "
        "(default: the model path the server reports)",
    )
    group.add_argument("--regenerate", type=int, metavar="N", help="regenerate every assistant turn, at most N tokens")
    group.add_argument(
        "--temperature", type=float, help=f"with --regenerate (default: {_REGENERATE.temperature}, greedy)"
    )
    group.add_argument("--top-p", type=float, help=f"with --regenerate (default: {_REGENERATE.top_p})")
    group.add_argument("--seed", type=int, help="with --regenerate: the sampling seed (default: none)")
    group.add_argument(
        "--seed-ignored",
        choices=get_args(SeedIgnored),
        help="with --seed and a temperature above 0, where the servers ignore seeds: refuse the job, or run it and "
        f"say so on the job (default: {_REGENERATE.seed_ignored})",
    )
    parser.add_argument(
        "--encoding",
        choices=get_args(Encoding),
        default=_DEFAULTS.encoding,
        help="how the shards store hidden states: as they came, lossless (zstd, bit for bit, about 0.7x the "
        "bytes of bfloat16) or fp8 (e4m3 with a scale per row, about 0.5x); readers decode (default: %(default)s)",
    )


def job_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options the flags give; a sampling flag without --regenerate is a usage error (it would
    otherwise be dropped without a word)."""
    options: dict[str, Any] = {
        "max_length": args.max_length,
        "length_policy": args.length_policy,
        "on_invalid": args.on_invalid,
        "loss": args.loss,
        "tokenizer": args.tokenizer,
        "encoding": args.encoding,
    }
    sampling = {k: getattr(args, k) for k in _SAMPLING if getattr(args, k) is not None}
    if args.regenerate is not None:
        options["regenerate"] = {"max_new_tokens": args.regenerate, **sampling}
    elif sampling:
        raise UsageError(f"{', '.join(_SAMPLING[k] for k in sampling)}: only with --regenerate N")
    return options


def _open_jsonl(path: str) -> BinaryIO:
    """The file to stream; one that cannot be opened is a usage error, not a failed request."""
    try:
        return open(path, "rb")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def _size(source: BinaryIO) -> int | None:
    """The bytes there are to send: a regular file's size; None for a pipe or a terminal."""
    try:
        info = os.fstat(source.fileno())
    except (OSError, ValueError):
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def _upload(hsx: HsxClient, source: BinaryIO, args: argparse.Namespace, options: dict[str, Any]) -> Job:
    with progress("hsx submit", _size(source), quiet=args.quiet or args.json) as meter:
        return hsx.submit_jsonl(source, progress=meter.moveto, **options)


def _checked(options: dict[str, Any]) -> JobOptions:
    """The options as the service will check them: a bad value is a usage error here, before any upload."""
    try:
        return JobOptions.model_validate(options)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise UsageError(problems) from None


def _created(job: Job, args: argparse.Namespace) -> None:
    """What stdout says of the job just created: its id first (alone with -q), then what it holds; with --json
    and no --wait, the job."""
    if args.json:
        if not args.wait:
            print_json(job)
        return
    if args.quiet:
        print(job.id, flush=True)
        return
    print(
        f"{job.id} {job.state}: {job.counts.total} samples, {job.tokens.total} tokens"
        + (f", {job.counts.preparing} conversations to render" if job.counts.preparing else "")
        + (f", {job.counts.skipped} skipped" if job.counts.skipped else "")
        + (f" ({job.name})" if job.name else ""),
        flush=True,
    )


def _wait(hsx: HsxClient, job: Job, args: argparse.Namespace) -> int:
    """Follow the job to its end; the exit status says how it ended."""
    if args.json or args.quiet:
        final = hsx.wait(job, poll_s=min(0.5, args.interval), max_poll_s=args.interval)
        if args.json:
            print_json(final)
    else:
        # stdout carries what scripts read (the job's id first); the progress is for the person watching
        final = follow(hsx, job, as_json=False, interval=args.interval, stream=sys.stderr)
    return outcome(final, as_json=args.json)


def main(args: argparse.Namespace) -> int:
    def body(hsx: HsxClient) -> int:
        if (args.file is None) == (args.input_path is None):
            raise UsageError("give exactly one of FILE or --input-path")
        options = {
            "name": args.name,
            "layers": None if args.layers is None else shown_choice(args.layers),
            "idempotency_key": args.idempotency_key,
            "options": _checked(job_options(args)),
        }
        if args.input_path is not None:
            job = hsx.create_job(input_path=args.input_path, **options)
        elif args.file == "-":
            job = _upload(hsx, sys.stdin.buffer, args, options)
        else:
            with _open_jsonl(args.file) as source:
                job = _upload(hsx, source, args, options)
        _created(job, args)
        return _wait(hsx, job, args) if args.wait else 0

    return run(args, body)

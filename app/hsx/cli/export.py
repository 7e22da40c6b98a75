"""`hsx export`: write a job's hidden states in a training framework's own offline layout."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hsx.cli.progress import PROGRESS_NOTE, progress
from hsx.exports import TARGETS, Option, default_workers

NAME = "export"
EXTRA = "training"
HELP = "export a job for SpecForge, vLLM speculators, NVIDIA Model Optimizer or DeepSpec training"


def _layouts() -> str:
    width = max(map(len, TARGETS))
    return "\n".join(f"  {name:<{width}}  {target.layout}" for name, target in TARGETS.items())


DESCRIPTION = f"""\
Write a finished job's hidden states in a training framework's offline layout (one file per sample;
DeepSpec: one shard per hsx shard, with its index and manifest):

{_layouts()}

Layers follow hsx's numbering (0 = embeddings, k = decoder layer k, L = after the final norm), and
L, the post-norm layers and the model type come from the manifest where it records them; the
EAGLE-3 capture is [2, L//2, L-3, L]. A job whose layers do not fit the target is refused (exit 1).
A job stored lossless or in fp8 is exported decoded (in the job's dtype); speculators --fp8 instead
keeps an fp8 job's codes with their scales, as speculators' own FP8 backend writes and reads them
(speculators 0.9.0 or newer, trained with --hidden-states-backend fp8; older releases and its default
file backend read the codes without their scales: wrong values, and no error).
Rerunning into the same folder skips files already complete; every file is written atomically.
--workers N processes write the files (the same files, byte for byte, whatever N). The files written
so far are shown as progress. {PROGRESS_NOTE.replace("--json or ", "")}

Disk: every target needs its own copy. No file of any target is a shard or a part of one (each puts
the layers side by side token by token, in its own container), so nothing can be hard-linked or reflinked: an
export takes about the bytes of the layers it reads (the whole job for a job of exactly those four
layers, decoded), plus speculators' hsx_samples.jsonl (about 9 bytes a token). To train without a second
copy, read the shards directly with hsx's Dataset (hsx.training.HiddenStateDataset).
"""


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _add_option(p: argparse.ArgumentParser, option: Option) -> None:
    if option.type is bool:  # a switch: off unless given
        p.add_argument(f"--{option.name.replace('_', '-')}", action="store_true", help=option.help)
        return
    shown = "" if option.default is None else " (default: %(default)s)"
    p.add_argument(
        f"--{option.name.replace('_', '-')}",
        type=option.type,
        default=option.default,
        metavar=option.metavar,
        help=option.help + shown,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", required=True, metavar="TARGET")
    for name, target in TARGETS.items():
        p = sub.add_parser(name, help=target.help)
        p.add_argument("source", help="the job folder, or its manifest.json")
        p.add_argument("out_dir", help="output folder (created; must be empty or hold an earlier run of this export)")
        for option in target.all_options:
            _add_option(p, option)
        p.add_argument(
            "--workers",
            type=_positive,
            default=default_workers(),
            metavar="N",
            help=f"processes writing files, each a chunk of one shard's samples at a time (default: "
            f"{default_workers()}, the CPUs here, at most 4)",
        )
        p.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors (and no progress)")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The target's options as its exporter takes them."""
    return {option.name: getattr(args, option.name) for option in TARGETS[args.target].all_options}


def main(args: argparse.Namespace) -> int:
    from hsx.exports import export_job
    from hsx.exports.base import ExportRefused

    try:
        with progress(f"hsx export {args.target}", None, unit="files", quiet=args.quiet) as meter:
            result = export_job(
                args.target, args.source, args.out_dir, progress=meter.moveto, workers=args.workers, **_options(args)
            )
    except ExportRefused as exc:
        print(f"hsx export {args.target}: refused: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"hsx export {args.target}: error: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(
            f"{args.target} export in {result.out_dir}: {result.written} files written, "
            f"{result.skipped} already complete, {result.total} in all"
        )
        for note in result.notes:
            print(f"  {note}")
    return 0

"""`hsx export`: write a job's hidden states in a training framework's own offline layout."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hsx.cli.progress import PROGRESS_NOTE, progress
from hsx.exports import default_workers
from hsx.layers import layers_arg

NAME = "export"
EXTRA = "training"
HELP = "export a job for SpecForge, vLLM speculators or NVIDIA Model Optimizer training"
DESCRIPTION = f"""\
Write a finished job's hidden states as one file per sample in a training framework's offline layout:

  specforge    rows_<a>-<b>/data_<i>.ckpt  (input_ids, loss_mask, hidden_state [1,T,H], aux_hidden_state [1,T,3H])
  speculators  hidden_states/hs_<i>.safetensors  (hidden_states [T,4,H], token_ids [T]) + hsx_samples.jsonl
  modelopt     <sample id>.pt  (input_ids, hidden_states [T,H], aux_hidden_states [T,3H], loss_mask)

Layers follow hsx's numbering (0 = embeddings, k = decoder layer k, L = after the final norm), and
L, the post-norm layers and the model type come from the manifest where it records them; the
EAGLE-3 capture is [2, L//2, L-3, L]. A job whose layers do not fit the target is refused (exit 1).
A job stored lossless or in fp8 is exported decoded (in the job's dtype); speculators --fp8 instead
keeps an fp8 job's codes with their scales, as speculators' own FP8 backend writes and reads them.
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


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="the job folder, or its manifest.json")
    p.add_argument("out_dir", help="output folder (created; must be empty or hold an earlier run of this export)")
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        metavar="L",
        help="the model's number of decoder layers, when the manifest lacks model.num_hidden_layers",
    )
    p.add_argument(
        "--aux-layers",
        type=layers_arg,
        default=None,
        metavar="I,J,K",
        help="aux layers in hsx numbering (default: the target's EAGLE-3 convention, [2, L//2, L-3])",
    )
    p.add_argument(
        "--workers",
        type=_positive,
        default=default_workers(),
        metavar="N",
        help=f"processes writing files, each a chunk of one shard's samples at a time (default: {default_workers()}, "
        "the CPUs here, at most 4)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors (and no progress)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", required=True, metavar="TARGET")
    p = sub.add_parser("specforge", help="SpecForge offline EAGLE-3 (OfflineEagle3Dataset)")
    _common(p)
    p.add_argument(
        "--group-size",
        type=int,
        default=2000,
        help="files per rows_<a>-<b> folder (default: 2000, as SpecForge's --file-group-size)",
    )
    p = sub.add_parser("speculators", help="vLLM speculators (hs_<i>.safetensors)")
    _common(p)
    p.add_argument(
        "--final-norm-weight",
        default=None,
        metavar="CHECKPOINT",
        help="the target model's checkpoint folder (or a .safetensors file) holding its final norm "
        "weight; needed because speculators stores the last layer before the final norm",
    )
    p.add_argument(
        "--final-norm-key",
        default=None,
        help="tensor name of the final norm weight (default: model.norm.weight and common variants)",
    )
    p.add_argument(
        "--final-norm-offset",
        type=float,
        default=None,
        help="the norm scales by weight + OFFSET (default: 1 when the manifest's model.model_type has a "
        "Gemma-style norm, else 0)",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="a job stored in fp8: write its float8_e4m3fn codes and their scales (hidden_states_scales) as "
        "speculators' own FP8 backend does, for its reader to multiply in (default: decoded, in the job's dtype)",
    )
    p = sub.add_parser("modelopt", help="NVIDIA Model Optimizer offline EAGLE (OfflineSupervisedDataset)")
    _common(p)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    options = {"num_layers": args.num_layers, "aux_layers": args.aux_layers}
    if args.target == "specforge":
        options["group_size"] = args.group_size
    elif args.target == "speculators":
        options.update(
            final_norm_weight=args.final_norm_weight,
            final_norm_key=args.final_norm_key,
            final_norm_offset=args.final_norm_offset,
            fp8=args.fp8,
        )
    return options


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

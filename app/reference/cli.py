"""Command line of the reference server: `hsx reference-server` and `python -m app.reference`."""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

NAME = "reference-server"
HELP = "run the SGLang-compatible reference model server that writes hidden-state dumps"
DESCRIPTION = (
    "Serve a causal LM (a local transformers checkpoint, or an embedded tiny Llama) behind an "
    "SGLang-compatible HTTP API (/generate, /health, /get_model_info, /get_server_info, /flush_cache). "
    "Every forward request, warm-up and health checks included, writes its prefill hidden states to "
    "<dump-root>/req_<key>/ following dump protocol v1. Runs until SIGTERM or SIGINT."
)


def _layer_list(text: str) -> list[int]:
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not layers:
        raise argparse.ArgumentTypeError("expected at least one layer index")
    return layers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", metavar="PATH", default=None,
        help="local transformers checkpoint directory (never downloaded); default: the embedded "
             "tiny Llama (8 layers, hidden 64, vocab 512, fixed seed, bfloat16)",
    )
    parser.add_argument(
        "--dump-root", metavar="DIR", default="/dev/shm/sglang_hs",
        help="directory that receives one req_<key>/ per forward request; created if missing "
             "(default: %(default)s)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=30000, help="TCP port to listen on (default: %(default)s)")
    parser.add_argument(
        "--name-by", choices=("counter", "rid"), default="counter",
        help="name dump directories by the request counter (req_0, req_1, ... from process start) or by "
             "the request's rid (req_<rid>) (default: %(default)s)",
    )
    parser.add_argument(
        "--layers", type=_layer_list, metavar="I,J,...", default=None,
        help="hidden-state layers to dump, HF numbering (0 = embeddings, L = last layer after the final "
             "norm); default: EAGLE-3's 2,L//2,L-3,L",
    )
    parser.add_argument(
        "--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
        help="model and dump dtype; auto = the checkpoint's own (bfloat16 for the embedded model) "
             "(default: %(default)s)",
    )
    parser.add_argument(
        "--skip-server-warmup", action="store_true",
        help="do not send the start-up warm-up /generate (which otherwise consumes counter 0); "
             "/health answers 200 at once",
    )
    parser.add_argument(
        "--enable-return-hidden-states", action="store_true",
        help="honour return_hidden_states in /generate: meta_info.hidden_states gets the prompt's "
             "last-layer rows as float lists",
    )


def main(args: argparse.Namespace) -> int:
    # Imported here so `--help` stays fast: torch and transformers take seconds to import.
    from app.reference.dumper import DumpWriter
    from app.reference.model import ModelRunner, default_capture_layers, load_model
    from app.reference.server import Engine, ServerSettings, log, run_server

    if args.model is not None and not Path(args.model).is_dir():
        print(f"error: --model {args.model!r} is not a local checkpoint directory", file=sys.stderr)
        return 2
    model, model_path = load_model(args.model, args.dtype)
    num_layers = int(model.config.num_hidden_layers)
    layers = args.layers if args.layers is not None else default_capture_layers(num_layers)
    try:
        runner = ModelRunner(model, model_path, layers)
    except ValueError as exc:
        print(f"error: --layers: {exc}", file=sys.stderr)
        return 2

    dump_root = Path(os.path.abspath(os.path.expanduser(args.dump_root)))
    dump_root.mkdir(parents=True, exist_ok=True)
    boot_id = uuid.uuid4().hex
    writer = DumpWriter(dump_root, boot_id=boot_id, dtype_name=runner.dtype_name, hidden_size=runner.hidden_size)
    engine = Engine(runner, writer, args.name_by)
    settings = ServerSettings(
        dump_root=dump_root,
        name_by=args.name_by,
        host=args.host,
        port=args.port,
        skip_server_warmup=args.skip_server_warmup,
        enable_return_hidden_states=args.enable_return_hidden_states,
    )
    log(
        f"model={model_path} dtype={runner.dtype_name} layers={runner.layers} dump_root={dump_root} "
        f"name_by={args.name_by} boot_id={boot_id}"
    )
    return run_server(engine, settings)

"""Command line of the reference server: `hsx reference-server` and `python -m hsx.reference`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from hsx.dtypes import HIDDEN_STATE_DTYPES
from hsx.layers import eagle3_capture_layers, layers_arg

if TYPE_CHECKING:
    from hsx.reference.model import ModelRunner
    from hsx.reference.synthetic import SyntheticRunner

NAME = "reference-server"
EXTRA = "reference"
HELP = "run the SGLang-compatible reference model server that writes hidden-state dumps"
DESCRIPTION = """\
Serve a causal LM (a local transformers checkpoint, or an embedded tiny Llama; on the CPU or on
--device) behind an SGLang-compatible HTTP API (/generate, /health, /get_model_info,
/get_server_info, /flush_cache). Every forward request, warm-up and health checks included,
writes its prefill hidden states to <dump-root>/req_<key>/ following dump protocol v1. Runs until
SIGTERM or SIGINT.

Synthetic mode (--synthetic), for benchmarks: no model; a model of the shape that --hidden-size,
--num-layers, --vocab-size and --dtype give, whose hidden states are rows of a seeded random table
chosen by a hash of (token, previous token, position, layer): a deterministic function that
hsx.reference.synthetic.synthetic_hidden_states() recomputes. Prefill time is simulated
(--prefill-us-per-token, --per-request-us); in rid mode --max-batch > 1 runs concurrent requests
as batches (the batch costs its longest prompt's time plus --per-request-us per request).

Fault injection (--enable-fault-injection), for tests: mounts GET/POST/DELETE /admin/faults to
read, merge-patch and reset fault settings, and to read how many faults of each kind were injected:
  {"seed": null,
   "foreign_dumps": {"count": 0, "probability": 0.0, "before": 1, "after": 1, "health_like": false,
                     "after_reply_s": null},
   "crash":         {"count": 0, "probability": 0.0, "exit_code": 1},
   "delay":         {"count": 0, "probability": 0.0, "seconds": 0.0},
   "unavailable":   {"seconds": 0.0},
   "late_done":     {"count": 0, "probability": 0.0, "seconds": 1.0, "never": false},
   "late_dump":     {"count": 0, "probability": 0.0, "seconds": 0.02},
   "bad_dumps":     {"count": 0, "probability": 0.0, "kind": "nan"}}
A fault fires for the next `count` /generate sequences (delay: requests), then with `probability`.
foreign_dumps writes extra complete dumps of other ids around the real one (with after_reply_s, the
ones after it that many seconds after the reply); crash exits the process before the dump and the
reply; delay sleeps before the reply; unavailable answers 503 to /generate and /health for `seconds`
from the POST; late_done creates `done` `seconds` after the reply, or never; late_dump writes the
whole dump `seconds` after the reply (an asynchronous writer); bad_dumps writes the dump with wrong
content of `kind` (missing_layer, truncated, unreadable, wrong_shape, wrong_dtype, nan, inf,
wrong_num_tokens, wrong_ids, cached_tokens, missing_meta_field, bad_meta_json, duplicate_layer, or a
list of them). Details: the docstring of app/hsx/reference/faults.py.
--enable-radix-cache and --chunked-prefill-size change what the server does and reports, as in SGLang;
--anonymous-dumps leaves input ids and rid out of every dump, as older patched servers do.

Stock mode (--stock-sglang): behave as an unpatched SGLang 0.5.23 server launched with the same
flags (--enable-return-aux-hidden-states --speculative-algorithm EAGLE3, --return-hidden-states-mode,
--disable-radix-cache, ...): its /generate, warm-up, health checks and info endpoints, with the
prefix cache on unless --disable-radix-cache. No dumps of its own: when the hsx-sglang plugin
(deploy/sglang) is installed and HSX_DUMP_ROOT is set, the plugin's hook code writes them, fed
with this model's tensors as SGLang feeds it. What still differs from SGLang: the docstring of
app/hsx/reference/stock.py.
"""

STOCK_FLAGS = (
    "enable_return_aux_hidden_states",
    "speculative_algorithm",
    "return_aux_hidden_state_layer_ids",
    "return_hidden_states_mode",
    "disable_radix_cache",
)
LEGACY_FLAGS = ("dump_root", "layers", "enable_fault_injection", "enable_radix_cache", "synthetic")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_server_arguments(parser)
    _add_stock_arguments(parser.add_argument_group("stock mode: SGLang 0.5.23's own flags (see above)"))
    _add_synthetic_arguments(parser.add_argument_group("synthetic mode (benchmarks; no model compute)"))
    _add_fault_arguments(parser.add_argument_group("fault injection (tests)"))


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="local transformers checkpoint directory (never downloaded); default: the embedded "
        "tiny Llama (8 layers, hidden 64, vocab 512, fixed seed, bfloat16)",
    )
    parser.add_argument(
        "--dump-root",
        metavar="DIR",
        default=None,
        help="directory that receives one req_<key>/ per forward request; created if missing "
        "(default: /dev/shm/sglang_hs)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=30000, help="TCP port to listen on (default: %(default)s)")
    parser.add_argument(
        "--name-by",
        choices=("counter", "rid"),
        default="counter",
        help="name dump directories by the request counter (req_0, req_1, ... from process start) or by "
        "the request's rid (req_<rid>) (default: %(default)s)",
    )
    parser.add_argument(
        "--layers",
        type=layers_arg,
        metavar="I,J,...",
        default=None,
        help="hidden-state layers to dump, HF numbering (0 = embeddings, L = last layer after the final "
        "norm); default: EAGLE-3's 2,L//2,L-3,L",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", *HIDDEN_STATE_DTYPES),
        default="auto",
        help="model and dump dtype; auto = the checkpoint's own (bfloat16 for the embedded model) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--device",
        default=None,
        metavar="DEVICE",
        help="torch device the model runs on, e.g. cuda or cuda:1; dumps are written from host memory (default: cpu)",
    )
    parser.add_argument(
        "--skip-server-warmup",
        action="store_true",
        help="do not send the start-up warm-up /generate (which otherwise consumes counter 0); "
        "/health answers 200 at once",
    )
    parser.add_argument(
        "--enable-return-hidden-states",
        action="store_true",
        help="honour return_hidden_states in /generate: meta_info.hidden_states gets the prompt's "
        "last-layer rows as float lists",
    )


def _add_stock_arguments(stock: argparse._ArgumentGroup) -> None:
    stock.add_argument(
        "--stock-sglang",
        action="store_true",
        help="behave as stock SGLang 0.5.23; dumps only from the hsx-sglang plugin (HSX_DUMP_ROOT)",
    )
    stock.add_argument(
        "--enable-return-aux-hidden-states",
        action="store_true",
        help="capture the three aux layers (the hidden states SGLang returns become them, side by side)",
    )
    stock.add_argument(
        "--speculative-algorithm", default=None, metavar="NAME", help="with aux capture: the convention, EAGLE3"
    )
    stock.add_argument(
        "--return-aux-hidden-state-layer-ids",
        type=int,
        nargs="+",
        default=None,
        metavar="I",
        help="aux layers in SGLang's numbering (HF layer I+1); default: EAGLE-3's",
    )
    stock.add_argument(
        "--return-hidden-states-mode",
        choices=("last", "full"),
        default=None,
        help="the most return_hidden_states a request may ask for (last: one row)",
    )
    stock.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="turn the prefix cache off (stock mode has it on, as SGLang does)",
    )


def _add_synthetic_arguments(synthetic: argparse._ArgumentGroup) -> None:
    synthetic.add_argument(
        "--synthetic",
        action="store_true",
        help="serve synthetic hidden states of a realistic shape instead of running a model "
        "(model_path hsx-synthetic; --dtype auto means bfloat16)",
    )
    synthetic.add_argument("--hidden-size", type=int, default=None, metavar="N", help="hidden size (default: 4096)")
    synthetic.add_argument(
        "--num-layers",
        type=int,
        default=None,
        metavar="L",
        help="decoder layers; the captured layers default to EAGLE-3's 2,L//2,L-3,L (default: 32)",
    )
    synthetic.add_argument("--vocab-size", type=int, default=None, metavar="N", help="vocabulary size (default: 32000)")
    synthetic.add_argument(
        "--context-length",
        type=int,
        default=None,
        metavar="N",
        help="longest prompt accepted, reported as max_position_embeddings (default: 131072)",
    )
    synthetic.add_argument("--seed", type=int, default=None, help="seed of the synthetic content (default: 0)")
    synthetic.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=None,
        metavar="US",
        help="simulated prefill time per prompt token, in microseconds (default: 0)",
    )
    synthetic.add_argument(
        "--per-request-us",
        type=float,
        default=None,
        metavar="US",
        help="simulated fixed cost of every request in a batch, in microseconds (default: 0)",
    )
    synthetic.add_argument(
        "--max-batch",
        type=int,
        default=None,
        metavar="N",
        help="rid mode: concurrent requests waiting together run as one batch of up to N, costing the "
        "longest prompt's time plus --per-request-us each; counter mode stays serialised (default: 1)",
    )


def _add_fault_arguments(faults: argparse._ArgumentGroup) -> None:
    faults.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="mount the admin API GET/POST/DELETE /admin/faults (see above)",
    )
    faults.add_argument(
        "--anonymous-dumps",
        action="store_true",
        help="write dumps as older patched servers do, with neither input_ids.safetensors nor meta "
        "input_ids_sha256 nor meta rid: a dump then proves itself only by its token count",
    )
    faults.add_argument(
        "--enable-radix-cache",
        action="store_true",
        help="report disable_radix_cache=false and serve repeated prompt prefixes from a prefix cache: "
        "meta and reply cached_tokens > 0, and the dump holds only the non-cached rows",
    )
    faults.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=-1,
        metavar="N",
        help="report it and dump a prompt longer than N tokens as one dump per N-token chunk "
        "(-1: off) (default: %(default)s)",
    )


DEFAULT_DUMP_ROOT = "/dev/shm/sglang_hs"
SYNTHETIC_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096,
    "num_layers": 32,
    "vocab_size": 32000,
    "context_length": 131072,
    "seed": 0,
    "prefill_us_per_token": 0.0,
    "per_request_us": 0.0,
    "max_batch": 1,
}


def _synthetic_runner(args: argparse.Namespace) -> SyntheticRunner:
    from hsx.reference.synthetic import SyntheticRunner

    opts = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in SYNTHETIC_DEFAULTS.items()}
    layers = args.layers if args.layers is not None else eagle3_capture_layers(opts["num_layers"])
    batching = args.name_by == "rid" and opts["max_batch"] > 1
    if opts["max_batch"] > 1 and not batching:
        print("note: --max-batch only batches in rid mode; counter mode serves one request at a time", file=sys.stderr)
    return SyntheticRunner(
        dtype="bfloat16" if args.dtype == "auto" else args.dtype, layers=layers, batching=batching, **opts
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return [_flag(k) for k in names if getattr(args, k) not in (None, False)]


def _usage_error(args: argparse.Namespace) -> str | None:
    if args.chunked_prefill_size == 0 or args.chunked_prefill_size < -1:
        return "--chunked-prefill-size must be a positive number of tokens, or -1 for off"
    problem = _other_mode_flag(args)
    if problem is None:
        problem = _synthetic_usage_error(args) if args.synthetic else _model_usage_error(args)
    return problem


def _other_mode_flag(args: argparse.Namespace) -> str | None:
    """A flag of the other server: stock mode has no dump flags, the built-in server no stock flags."""
    if args.stock_sglang:
        legacy = _given(args, LEGACY_FLAGS) + (["--name-by"] if args.name_by != "counter" else [])
        if legacy:
            return f"{legacy[0]} does not exist in stock mode (the hsx-sglang plugin's HSX_DUMP_ROOT sets the dumps)"
    else:
        stock = _given(args, STOCK_FLAGS)
        if stock:
            return f"{stock[0]} needs --stock-sglang"
    return None


def _synthetic_usage_error(args: argparse.Namespace) -> str | None:
    if args.model is not None:
        return "--model and --synthetic exclude each other"
    if args.device is not None:
        return "--device needs a model: synthetic mode computes nothing"
    return None


def _model_usage_error(args: argparse.Namespace) -> str | None:
    given = [k for k in SYNTHETIC_DEFAULTS if getattr(args, k) is not None]
    if given:
        return f"--{given[0].replace('_', '-')} needs --synthetic"
    if args.model is not None and not Path(args.model).is_dir():
        return f"--model {args.model!r} is not a local checkpoint directory"
    return None


def main(args: argparse.Namespace) -> int:
    problem = _usage_error(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # Imported here so `--help` and usage errors stay fast: torch and transformers take seconds to
    # import (and synthetic mode never imports transformers).
    if args.stock_sglang:
        return _main_stock(args)
    from hsx.reference.dumper import Dumper
    from hsx.reference.faults import FaultInjector, PrefixCache
    from hsx.reference.server import Engine, ServerSettings, log, run_server

    runner: ModelRunner | SyntheticRunner
    try:
        if args.synthetic:
            runner = _synthetic_runner(args)
        else:
            from hsx.reference.model import ModelRunner, load_model

            model, model_path = load_model(args.model, args.dtype, args.device or "cpu")
            num_layers = int(model.config.num_hidden_layers)
            layers = args.layers if args.layers is not None else eagle3_capture_layers(num_layers)
            runner = ModelRunner(model, model_path, layers)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    dump_root = Path(os.path.abspath(os.path.expanduser(args.dump_root or DEFAULT_DUMP_ROOT)))
    dump_root.mkdir(parents=True, exist_ok=True)
    boot_id = uuid.uuid4().hex
    dumper = Dumper(
        dump_root,
        boot_id=boot_id,
        dtype_name=runner.dtype_name,
        hidden_size=runner.hidden_size,
        anonymous=args.anonymous_dumps,
    )
    engine = Engine(
        cast("ModelRunner", runner),  # Engine's annotation names ModelRunner; SyntheticRunner has its interface
        dumper,
        args.name_by,
        faults=FaultInjector() if args.enable_fault_injection else None,
        prefix_cache=PrefixCache() if args.enable_radix_cache else None,
        chunked_prefill_size=args.chunked_prefill_size,
        concurrent=getattr(runner, "batcher", None) is not None,
    )
    settings = ServerSettings(
        dump_root=dump_root,
        name_by=args.name_by,
        host=args.host,
        port=args.port,
        skip_server_warmup=args.skip_server_warmup,
        enable_return_hidden_states=args.enable_return_hidden_states,
    )
    extras = [
        name
        for name, on in (
            ("fault-injection", args.enable_fault_injection),
            ("anonymous-dumps", args.anonymous_dumps),
            ("radix-cache", args.enable_radix_cache),
            (f"chunked-prefill={args.chunked_prefill_size}", args.chunked_prefill_size > 0),
        )
        if on
    ]
    log(
        f"model={runner.model_path} dtype={runner.dtype_name} hidden={runner.hidden_size} layers={runner.layers} "
        f"dump_root={dump_root} name_by={args.name_by} boot_id={boot_id}"
        + (f" faults: {', '.join(extras)}" if extras else "")
    )
    return run_server(engine, settings)


def _stock_dtype(args: argparse.Namespace) -> str:
    """--dtype as SGLang resolves it: auto runs a float32 checkpoint in float16 (bfloat16 for Gemma)."""
    if args.dtype != "auto" or args.model is None:
        return args.dtype
    from hsx.dtypes import sglang_auto_dtype

    try:
        config = json.loads((Path(args.model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return args.dtype  # transformers says what is wrong when it loads the checkpoint
    return sglang_auto_dtype(config if isinstance(config, dict) else {})


def _main_stock(args: argparse.Namespace) -> int:
    from hsx.reference.model import ModelRunner, load_model
    from hsx.reference.server import log, serve
    from hsx.reference.stock import WARMUP_INPUT_IDS, StockArgs, StockError, aux_layers, start_stock

    stock = StockArgs(
        model_path="",
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        skip_server_warmup=args.skip_server_warmup,
        disable_radix_cache=args.disable_radix_cache,
        chunked_prefill_size=args.chunked_prefill_size,
        enable_return_hidden_states=args.enable_return_hidden_states,
        return_hidden_states_mode=args.return_hidden_states_mode,
        enable_return_aux_hidden_states=args.enable_return_aux_hidden_states,
        speculative_algorithm=args.speculative_algorithm,
        return_aux_hidden_state_layer_ids=args.return_aux_hidden_state_layer_ids,
    )
    try:
        stock.check()
        model, stock.model_path = load_model(args.model, _stock_dtype(args), args.device or "cpu")
        num_layers = int(model.config.num_hidden_layers)
        runner = ModelRunner(model, stock.model_path, [*aux_layers(stock, num_layers), num_layers])
        _, app_factory = start_stock(stock, runner)
    except (StockError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log(f"stock SGLang {stock.resolved()} model={runner.model_path} layers={runner.layers}")
    return serve(
        app_factory,
        host=args.host,
        port=args.port,
        skip_server_warmup=args.skip_server_warmup,
        warmup_ids=[t % runner.vocab_size for t in WARMUP_INPUT_IDS],
    )

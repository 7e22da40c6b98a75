"""How this model server gives hidden states, decided from what it says about itself.

Three kinds of server, told apart without guessing:

- the reference server, or a patched SGLang, that describes its dumps in /get_server_info
  (`hs_dump`): dumps in the dump root, named as it says;
- stock SGLang with the hsx-sglang plugin: the plugin writes `hsx-plugin.json` into the dump
  root (deploy/sglang/README.md): dumps named by rid, only for rids with its prefix, and only for
  requests whose batch carries per-request row counts (`return_logprob: true` makes SGLang fill them
  and keeps the answer small);
- stock SGLang without the plugin, returning hidden states (`--enable-return-hidden-states` or
  `--enable-return-aux-hidden-states`): the rows come in the answer itself (`response`); only the
  three aux layers, or only layer L, and hsx needs the model's config.json to number them.

A server that says nothing is taken for a patched SGLang whose dumps are named by counter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.dtypes import HIDDEN_STATE_DTYPES, sglang_auto_dtype
from hsx.identity import Identity
from hsx.manifest import MODEL_KEYS

PLUGIN_INFO_FILE = "hsx-plugin.json"
PLUGIN_INFO_FORMAT = "hsx-plugin/1"
DEFAULT_RID_PREFIX = "hsx-"


@dataclass(frozen=True)
class Capture:
    """What the writer needs to know to take one sample's hidden states from this server."""

    source: str  # "dumps", "response" or "vllm" (hsx.backends.vllm)
    layers: list[int] | None  # the layers the server gives; None: not said (a job's own list is trusted)
    name_by: str = "counter"  # dumps: "counter" or "rid"
    rid_prefix: str = DEFAULT_RID_PREFIX
    asks: str | None = None  # what each request asks for besides the token (backends.sglang.ASKS); None: nothing
    boot_id: str | None = None
    hidden_size: int | None = None  # response: the width of one layer's rows
    dtype: str | None = None  # response: the model's dtype, which JSON numbers do not carry
    how: str = ""  # for refusals: where the layers come from
    # What each dump will prove (hsx.identity) as far as the server says before the first one; None: not said.
    identity: Identity | None = None

    @property
    def concurrent(self) -> bool:
        """Whether several requests may run at once: not when dumps are found by scanning the root."""
        return self.source in ("response", "vllm") or self.name_by == "rid"


class CaptureProblem(Exception):
    """The server cannot give whole per-sample hidden states as it runs; the message says why and what to change."""


def read_plugin_info(dump_root: Path) -> dict[str, Any] | None:
    """The plugin's description of its dumps, or None when no plugin writes into this root."""
    path = Path(dump_root) / PLUGIN_INFO_FILE
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CaptureProblem(f"{path} is unreadable: {exc}") from None
    if not isinstance(info, dict) or info.get("format") != PLUGIN_INFO_FORMAT:
        raise CaptureProblem(f"{path} is not an {PLUGIN_INFO_FORMAT} description")
    return info


def read_model_config(model_path: object) -> dict[str, Any] | None:
    """The model's transformers config.json when `model_path` is a local checkpoint readable here."""
    if not isinstance(model_path, str) or not model_path:
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    # Multimodal checkpoints keep the language model's numbers in text_config.
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


@dataclass(frozen=True)
class ServerLimits:
    """What a model server accepts: token ids below vocab_size, at most max_prompt_tokens in a prompt
    (None: the server does not say). Samples are checked against them before anything is sent."""

    vocab_size: int | None = None
    max_prompt_tokens: int | None = None

    @classmethod
    def said(cls, vocab_size: Any, max_prompt_tokens: Any) -> ServerLimits:
        """The limits a server's answers give, each kept only when it is a positive integer."""
        return cls(_count(vocab_size), _count(max_prompt_tokens))

    @classmethod
    def of_sglang(cls, model_info: dict[str, Any], server_info: dict[str, Any]) -> ServerLimits:
        """An SGLang-style server's: its model's vocabulary, and its longest request input
        (max_req_input_len), else the model's context length."""
        longest = server_info.get("max_req_input_len") or model_info.get("max_position_embeddings")
        return cls.said(model_info.get("vocab_size"), longest)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def describe_model(model_info: dict[str, Any], server_info: dict[str, Any]) -> dict[str, Any]:
    """The model as a manifest records it (hsx.manifest.MODEL_KEYS): each field from the server's
    /get_model_info, or where it does not give one (stock SGLang gives model_type but no layer
    count) from config.json in its model_path when that is a checkpoint readable here, else None."""
    model_path = model_info.get("model_path") or server_info.get("model_path")
    config = read_model_config(model_path) or {}
    described = {"model_path": model_path}
    for key in MODEL_KEYS:
        if key != "model_path":
            value = model_info.get(key)
            described[key] = value if value is not None else config.get(key)
    return described


def decide(
    source: str,
    name_by: str,
    server_info: dict[str, Any],
    model_info: dict[str, Any],
    *,
    plugin_info: dict[str, Any] | None,
    dump_root: Path,
) -> Capture:
    """The capture for this server; CaptureProblem when it cannot give whole samples."""
    chunk = server_info.get("chunked_prefill_size")
    if isinstance(chunk, int) and chunk > 0:
        raise CaptureProblem(
            f"the server splits prompts into chunks of {chunk} tokens (chunked prefill), so a prompt's rows would "
            "come in pieces; restart it with --chunked-prefill-size -1"
        )
    described = server_info.get("hs_dump") or None
    if source == "response" or (
        source == "auto" and described is None and plugin_info is None and _returns_rows(server_info)
    ):
        return _response(server_info, model_info)
    if plugin_info is not None and described is None:
        return _plugin(server_info, plugin_info, name_by, dump_root)
    dump = described or {}
    name_by = name_by if name_by != "auto" else str(dump.get("name_by", "counter"))
    return Capture(
        source="dumps",
        layers=[int(i) for i in dump["layers"]] if dump.get("layers") else None,
        name_by=name_by,
        boot_id=dump.get("boot_id"),
        how="the server's dumps",
        identity=_said_identity(dump, name_by),
    )


def _said_identity(described: dict[str, Any], name_by: str) -> Identity | None:
    """What the dumps will prove before the first is read: what a server that describes them (hs_dump)
    says, else at least the rid where they are named by it; None where only the dumps can tell."""
    said = described.get("identity")
    if said in tuple(Identity):
        return Identity(said)
    return Identity.RID if name_by == "rid" else None


def _returns_rows(server_info: dict[str, Any]) -> bool:
    """Whether the server can answer every prompt row (SGLang's hidden-states mode `full`)."""
    mode = server_info.get("return_hidden_states_mode")
    # SGLang's get_server_return_hidden_states_mode: "last" wins, then "full" or the legacy flag.
    return mode != "last" and (mode == "full" or bool(server_info.get("enable_return_hidden_states")))


def _plugin(server_info: dict[str, Any], info: dict[str, Any], name_by: str, dump_root: Path) -> Capture:
    if info.get("name_by") != "rid" or (name_by not in ("auto", "rid")):
        raise CaptureProblem(f"the hsx-sglang plugin names dumps by rid, but --name-by is {name_by}")
    if server_info.get("enable_return_aux_hidden_states") is False:
        raise CaptureProblem(
            f"{Path(dump_root) / PLUGIN_INFO_FILE} describes a plugin, but the server does not capture aux hidden "
            "states: restart it with --enable-return-aux-hidden-states --speculative-algorithm EAGLE3"
        )
    return Capture(
        source="dumps",
        layers=[int(i) for i in info["layers"]],
        name_by="rid",
        rid_prefix=str(info.get("rid_prefix") or DEFAULT_RID_PREFIX),
        # The plugin needs the batch's per-request row counts, which SGLang fills when a request asks
        # for logprobs (or hidden states, whose rows would all come back as JSON).
        asks="logprob",
        boot_id=info.get("boot_id"),
        identity=Identity.RID,
        how=f"the hsx-sglang plugin's dumps ({PLUGIN_INFO_FILE})",
    )


def _response(server_info: dict[str, Any], model_info: dict[str, Any]) -> Capture:
    if not _returns_rows(server_info):
        raise CaptureProblem(
            "the server does not return every prompt row's hidden states: restart it with "
            "--enable-return-hidden-states (layer L) or --enable-return-aux-hidden-states --speculative-algorithm "
            "EAGLE3 (the three aux layers), or install the hsx-sglang plugin"
        )
    model_path = server_info.get("model_path") or model_info.get("model_path")
    config = read_model_config(model_path) or {}
    num_layers = model_info.get("num_hidden_layers") or config.get("num_hidden_layers")
    hidden_size = model_info.get("hidden_size") or config.get("hidden_size")
    if not isinstance(num_layers, int) or not isinstance(hidden_size, int):
        raise CaptureProblem(
            f"cannot tell the model's hidden size and layer count: hsx reads them from config.json in the server's "
            f"model_path ({model_path!r}), which is not a checkpoint directory readable here"
        )
    if server_info.get("enable_return_aux_hidden_states"):
        ids = server_info.get("return_aux_hidden_state_layer_ids")
        layers = sorted({2, num_layers // 2, num_layers - 3} if ids is None else {int(i) + 1 for i in ids})
        how = "the server's answers (aux capture gives only the three aux layers; the plugin's dumps add layer L)"
    else:
        layers = [num_layers]
        how = "the server's answers (without aux capture only layer L, after the final norm)"
    return Capture(
        source="response",
        layers=layers,
        hidden_size=hidden_size,
        dtype=_model_dtype(server_info, config),
        how=how,
        identity=Identity.RESPONSE,
    )


def _model_dtype(server_info: dict[str, Any], config: dict[str, Any]) -> str:
    """The dtype of the server's hidden states: its --dtype, or with auto what SGLang makes of the
    checkpoint's (sglang_auto_dtype)."""
    dtype = server_info.get("dtype")
    if dtype in (None, "auto"):
        dtype = sglang_auto_dtype(config)
    dtype = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
    if dtype not in HIDDEN_STATE_DTYPES:
        raise CaptureProblem(f"the model's dtype {dtype!r} is not one of {', '.join(HIDDEN_STATE_DTYPES)}")
    return dtype

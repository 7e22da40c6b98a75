"""The model a server runs, as a manifest records it (hsx.manifest.MODEL_KEYS): from what the server says
of it, and where that falls short from the checkpoint's config.json when it is readable here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hsx.manifest import MODEL_KEYS


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


def describe_model(model_info: dict[str, Any], server_info: dict[str, Any]) -> dict[str, Any]:
    """The model as a manifest records it (hsx.manifest.MODEL_KEYS): each field from the server's
    model info, or where it does not give one (stock SGLang gives model_type but no layer count) from
    config.json in its model_path when that is a checkpoint readable here, else None."""
    model_path = model_info.get("model_path") or server_info.get("model_path")
    config = read_model_config(model_path) or {}
    described = {"model_path": model_path}
    for key in MODEL_KEYS:
        if key != "model_path":
            value = model_info.get(key)
            described[key] = value if value is not None else config.get(key)
    return described

"""Turn submitted samples (JSON body or a JSONL file under the input root) into rows to store.

All samples are checked before anything is stored; every error names the sample and field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np
from pydantic import ValidationError

from app.api.problems import InvalidInput, ProblemError
from app.api.schemas import SampleIn
from app.db.repository import NewSample

MAX_TOKEN_ID = 2**31 - 1
MAX_ERRORS = 50


def _check(index: int, sample: SampleIn, seen: set[str], errors: list[dict], where: dict) -> NewSample | None:
    sid = str(sample.id) if sample.id is not None else str(index)
    bad = len(errors)

    def err(field: str, message: str) -> None:
        errors.append({"sample_index": index, **where, "sample_id": sid, "field": field, "message": message})

    ids = sample.input_ids
    if not ids:
        err("input_ids", "must hold at least one token id")
    elif min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
        pos = next(i for i, t in enumerate(ids) if t < 0 or t > MAX_TOKEN_ID)
        err(f"input_ids.{pos}", f"token id {ids[pos]} is out of range")
    mask = sample.loss_mask
    if mask is not None:
        if len(mask) != len(ids):
            err("loss_mask", f"has {len(mask)} values, input_ids has {len(ids)}")
        elif any(v not in (0, 1) for v in mask):
            err("loss_mask", "values must be 0 or 1")
    if sid in seen:
        err("id", f"duplicate sample id {sid!r}")
    seen.add(sid)
    if len(errors) > bad:
        return None
    packed_mask = None if mask is None or all(mask) else np.asarray(mask, dtype=np.uint8).tobytes()
    return NewSample(sid, np.asarray(ids, dtype="<i4").tobytes(), packed_mask, len(ids))


def samples_from_body(samples: list[SampleIn]) -> list[NewSample]:
    return _collect((i, s, {}) for i, s in enumerate(samples))


def _collect(items: Iterable[tuple[int, SampleIn | list[dict], dict]]) -> list[NewSample]:
    """Check every item (index, parsed sample or its parse errors, location fields for errors)."""
    errors: list[dict] = []
    seen: set[str] = set()
    out: list[NewSample] = []
    count = 0
    for index, item, where in items:
        count += 1
        if isinstance(item, list):  # parse errors already turned into error entries
            errors.extend(item)
            continue
        row = _check(index, item, seen, errors, where)
        if row is not None:
            out.append(row)
        if len(errors) >= MAX_ERRORS:
            break
    if errors:
        raise InvalidInput(errors[:MAX_ERRORS])
    if count == 0:
        raise InvalidInput([{"field": "samples", "message": "a job needs at least one sample"}])
    return out


def resolve_input_path(input_root: Path, relative: str) -> Path:
    """The file `relative` names under the input root; anything outside it is refused."""
    root = Path(input_root).resolve()
    candidate = Path(relative)
    if candidate.is_absolute() or "\x00" in relative:
        raise ProblemError(403, "input_path must be relative to the service's input root", field="input_path")
    path = (root / candidate).resolve()
    if path != root and root not in path.parents:
        raise ProblemError(403, "input_path points outside the service's input root", field="input_path")
    if not path.is_file():
        raise InvalidInput([{"field": "input_path", "message": f"no file {relative!r} under the input root"}])
    return path


def samples_from_jsonl(path: Path) -> list[NewSample]:
    def items():
        with open(path, encoding="utf-8") as f:
            index = 0
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield index, SampleIn.model_validate(json.loads(line), strict=True), {"line": lineno}
                except (ValueError, ValidationError) as exc:
                    yield index, _line_errors(index, lineno, exc), {}
                index += 1

    return _collect(items())


def _line_errors(index: int, lineno: int, exc: Exception) -> list[dict]:
    if isinstance(exc, ValidationError):
        return [{"sample_index": index, "line": lineno, "field": ".".join(str(p) for p in e["loc"]) or "sample",
                 "message": e["msg"]} for e in exc.errors()]
    return [{"sample_index": index, "line": lineno, "field": "sample", "message": f"not valid JSON: {exc}"}]

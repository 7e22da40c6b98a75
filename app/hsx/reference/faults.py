"""Fault injection (`--enable-fault-injection`): make the reference server misbehave on purpose.

Tests and soak runs use it to prove that the extraction service survives what real servers do.
Off by default; with the flag the server mounts an admin API:

    GET    /admin/faults   {"settings": {...}, "injected": {kind: n}, "state": {...}}
    POST   /admin/faults   a JSON merge patch of "settings" (objects merge key by key, a null resets
                           that key or section to its default; unknown keys or bad values: 400 and
                           nothing changes); answers like GET
    DELETE /admin/faults   reset settings and counters to the defaults; answers like GET

Settings and defaults (a fault "fires" for the next `count` eligible events; once count is 0 it
fires with `probability` per event, drawn from a random.Random seeded by `seed`, null = from the OS):

    {"seed": null,
     "foreign_dumps": {"count": 0, "probability": 0.0, "before": 1, "after": 1, "health_like": false,
                       "after_reply_s": null},
     "crash":         {"count": 0, "probability": 0.0, "exit_code": 1},
     "delay":         {"count": 0, "probability": 0.0, "seconds": 0.0},
     "unavailable":   {"seconds": 0.0},
     "late_done":     {"count": 0, "probability": 0.0, "seconds": 1.0, "never": false},
     "late_dump":     {"count": 0, "probability": 0.0, "seconds": 0.02},
     "bad_dumps":     {"count": 0, "probability": 0.0, "kind": "nan"}}

- foreign_dumps (event: one /generate sequence): around the real dump also write `before` complete
  dumps ahead of it and `after` behind it, each a real forward with its own counter value and rid
  "foreign-<hex>" (so in counter mode req_<c>..), with as many tokens as the real prompt but other
  ids (token + 1 + j, mod vocab, for the j-th); with health_like the first of them is instead an
  exact health-check dump (input_ids [0], rid HEALTH_CHECK_<time>). With after_reply_s a number, the
  `after` dumps are written that many seconds after the reply instead (a timer thread): another
  client's request that reached the server just after ours.
- crash (event: one /generate sequence): os._exit(exit_code) before the forward: no dump, no reply.
  A new process starts from counter 0 with a new boot_id. Crashes are logged, not counted.
- delay (event: one /generate request): sleep `seconds` after the dumps are written, before the
  reply (the request stays in flight: its rids stay claimed).
- unavailable: POSTing seconds = S answers /generate, /health and /health_generate with 503 for the
  next S seconds (from the POST); "state.unavailable_remaining_s" shows what is left.
- late_done (event: one /generate dump): write the dump without `done` and create `done` `seconds`
  after the HTTP reply (a timer thread), or never (never = true).
- late_dump (event: one /generate sequence): the sequence's own dump is written whole, `done` last,
  `seconds` after the reply (a timer thread), as an asynchronous writer does; its counter value is
  still taken when the request is served.
- bad_dumps (event: one /generate dump): the dump is written in the usual order, `done` last, with
  its content wrong in the way `kind` names (or, for a list of kinds, one drawn per dump):
  missing_layer (the last layer's tensor left out), truncated (tensor file cut inside its data),
  unreadable (tensor file replaced by garbage), wrong_shape (first layer [T, hidden - 1]),
  wrong_dtype (tensors in another dtype than meta's), nan / inf (one element of the first layer),
  wrong_num_tokens (meta num_tokens = T + 1), wrong_ids (input_ids file and sha256 of other ids),
  cached_tokens (meta cached_tokens = max(1, T // 2)), missing_meta_field (meta lacks num_tokens),
  bad_meta_json (meta.json is cut-off JSON), duplicate_layer (meta lists its last layer twice; the
  tensor file holds each layer once).

Only /generate traffic (the start-up warm-up included, if faults are set before it) is affected;
health checks only see `unavailable`. A batch /generate of k sequences is k sequence events and
k dumps, and one request event. With chunked prefill the faults apply to the last chunk's dump.

"injected" counts every fault injected since start or the last DELETE, by kind: foreign_dump,
health_like_dump, delay, unavailable (503 replies), late_done, never_done, late_dump, and
bad_dump.<kind>.

Two server-settings faults are plain CLI flags (see PrefixCache below and the server's Engine):
--enable-radix-cache (a repeated prompt prefix is served from a prefix cache: meta and reply
cached_tokens > 0 and the dump holds only the rows after the cached prefix) and
--chunked-prefill-size N (a prompt of more than N tokens is dumped as one dump per N-token chunk).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hsx.reference.common import HiddenStates, as_tensor
from hsx.reference.dumper import HIDDEN_STATES_FILE, Dumper

BAD_DUMP_KINDS = (
    "missing_layer",
    "truncated",
    "unreadable",
    "wrong_shape",
    "wrong_dtype",
    "nan",
    "inf",
    "wrong_num_tokens",
    "wrong_ids",
    "cached_tokens",
    "missing_meta_field",
    "bad_meta_json",
    "duplicate_layer",
)
INJECTED_KINDS = (
    "foreign_dump",
    "health_like_dump",
    "delay",
    "unavailable",
    "late_done",
    "never_done",
    "late_dump",
    *(f"bad_dump.{kind}" for kind in BAD_DUMP_KINDS),
)
MAX_FOREIGN = 64

DEFAULT_SETTINGS: dict[str, Any] = {
    "seed": None,
    "foreign_dumps": {
        "count": 0,
        "probability": 0.0,
        "before": 1,
        "after": 1,
        "health_like": False,
        "after_reply_s": None,
    },
    "crash": {"count": 0, "probability": 0.0, "exit_code": 1},
    "delay": {"count": 0, "probability": 0.0, "seconds": 0.0},
    "unavailable": {"seconds": 0.0},
    "late_done": {"count": 0, "probability": 0.0, "seconds": 1.0, "never": False},
    "late_dump": {"count": 0, "probability": 0.0, "seconds": 0.02},
    "bad_dumps": {"count": 0, "probability": 0.0, "kind": "nan"},
}


class FaultSettingsError(ValueError):
    """A POST /admin/faults body that cannot be applied (answered 400, nothing changed)."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _count(where: str, value: Any) -> int:
    if not _is_int(value) or value < 0:
        raise FaultSettingsError(f"{where} must be an integer >= 0")
    return value


def _foreign_count(where: str, value: Any) -> int:
    if not _is_int(value) or not 0 <= value <= MAX_FOREIGN:
        raise FaultSettingsError(f"{where} must be an integer >= 0 and <= {MAX_FOREIGN}")
    return value


def _probability(where: str, value: Any) -> float:
    if not _is_number(value) or not 0 <= value <= 1:
        raise FaultSettingsError(f"{where} must be a number in [0, 1]")
    return float(value)


def _seconds(where: str, value: Any, alternative: str = "") -> float:
    if not _is_number(value) or value < 0:
        raise FaultSettingsError(f"{where} must be a number >= 0{alternative}")
    return float(value)


def _flag(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise FaultSettingsError(f"{where} must be a boolean")
    return value


def _exit_code(where: str, value: Any) -> int:
    if not _is_int(value) or not 0 <= value <= 255:
        raise FaultSettingsError(f"{where} must be an integer in [0, 255]")
    return value


def _bad_dump_kind(where: str, value: Any) -> str | list[str]:
    kinds = value if isinstance(value, list) else [value]
    if not kinds or not all(isinstance(k, str) and k in BAD_DUMP_KINDS for k in kinds):
        raise FaultSettingsError(f"{where} must be one of {list(BAD_DUMP_KINDS)} or a non-empty list of them")
    return value


# The check of each setting, by key (a key means the same in every section that has it): the value
# as stored, or FaultSettingsError. A null never gets here: it resets the key to its default.
_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "count": _count,
    "before": _foreign_count,
    "after": _foreign_count,
    "probability": _probability,
    "seconds": _seconds,
    "after_reply_s": lambda where, value: _seconds(where, value, " or null"),
    "health_like": _flag,
    "never": _flag,
    "exit_code": _exit_code,
    "kind": _bad_dump_kind,
}


def _check(section: str, key: str, value: Any) -> Any:
    where = f"{section}.{key}"
    check = _CHECKS.get(key)
    if check is None:
        raise AssertionError(where)
    return check(where, value)


def _merged_section(section: str, current: Any, value: Any) -> Any:
    """One section of the settings after a merge patch's `value` for it: null resets the section to
    its defaults, an object merges key by key into `current` (a null key resets that key)."""
    if section == "seed":
        if value is not None and not _is_int(value):
            raise FaultSettingsError("seed must be an integer or null")
        return value
    defaults = DEFAULT_SETTINGS[section]
    if value is None:
        return copy.deepcopy(defaults)
    if not isinstance(value, dict):
        raise FaultSettingsError(f"{section} must be an object")
    for key, item in value.items():
        if key not in defaults:
            raise FaultSettingsError(f"unknown setting {section}.{key}; expected one of {list(defaults)}")
        current[key] = defaults[key] if item is None else _check(section, key, item)
    return current


@dataclass
class SequencePlan:
    """What the faults do to one /generate sequence, drawn before its forward."""

    crash: bool = False
    foreign_before: int = 0
    foreign_after: int = 0
    health_like: bool = False
    bad_kind: str | None = None
    late_done: float | None = None  # seconds after the reply; math.inf = never
    foreign_after_reply_s: float | None = None  # the `after` foreign dumps: seconds after the reply; None: before it
    late_dump: float | None = None  # the own dump is written this many seconds after the reply


class FaultInjector:
    """The admin API's state: settings, the counters of injected faults, and the draws."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.settings = copy.deepcopy(DEFAULT_SETTINGS)
            self.injected = dict.fromkeys(INJECTED_KINDS, 0)
            self._rng = random.Random()
            self._unavailable_until = 0.0

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            remaining = max(0.0, self._unavailable_until - time.monotonic())
            return {
                "settings": copy.deepcopy(self.settings),
                "injected": dict(self.injected),
                "state": {"unavailable_remaining_s": round(remaining, 3)},
            }

    def merge(self, patch: Any) -> None:
        """Apply a JSON merge patch of the settings, all or nothing."""
        if not isinstance(patch, dict):
            raise FaultSettingsError("the body must be a JSON object of fault settings")
        with self._lock:
            self._merge(patch)

    def _merge(self, patch: dict[str, Any]) -> None:
        new = copy.deepcopy(self.settings)
        for section, value in patch.items():
            if section not in DEFAULT_SETTINGS:
                raise FaultSettingsError(f"unknown fault setting {section!r}; expected one of {list(DEFAULT_SETTINGS)}")
            new[section] = _merged_section(section, new[section], value)
        self.settings = new
        if "seed" in patch:
            self._rng = random.Random(new["seed"])
        if "unavailable" in patch:
            self._unavailable_until = time.monotonic() + new["unavailable"]["seconds"]

    def count(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.injected[kind] += n

    def _fires(self, section: str) -> bool:
        """Called under the lock: spend one of `count`, else draw against `probability`."""
        s = self.settings[section]
        if s["count"] > 0:
            s["count"] -= 1
            return True
        return s["probability"] > 0 and self._rng.random() < s["probability"]

    def unavailable_now(self) -> bool:
        """True while an unavailable window is open; each such answer counts as one fault."""
        with self._lock:
            if time.monotonic() < self._unavailable_until:
                self.injected["unavailable"] += 1
                return True
            return False

    def request_delay(self) -> float:
        with self._lock:
            return self.settings["delay"]["seconds"] if self._fires("delay") else 0.0

    def plan_sequence(self) -> SequencePlan:
        plan = SequencePlan()
        with self._lock:
            if self._fires("crash"):
                plan.crash = True
                return plan
            if self._fires("foreign_dumps"):
                s = self.settings["foreign_dumps"]
                plan.foreign_before, plan.foreign_after, plan.health_like = s["before"], s["after"], s["health_like"]
                plan.foreign_after_reply_s = s["after_reply_s"]
            if self._fires("bad_dumps"):
                kind = self.settings["bad_dumps"]["kind"]
                plan.bad_kind = self._rng.choice(kind) if isinstance(kind, list) else kind
            if self._fires("late_done"):
                s = self.settings["late_done"]
                plan.late_done = math.inf if s["never"] else s["seconds"]
            if self._fires("late_dump"):
                plan.late_dump = self.settings["late_dump"]["seconds"]
        return plan

    def crash(self, rid: str) -> None:
        with self._lock:
            code = self.settings["crash"]["exit_code"]
        print(f"[hsx-ref] fault: crash with exit code {code} while serving rid={rid}", flush=True)
        os._exit(code)

    @staticmethod
    def schedule(deferred: Sequence[tuple[float, Callable[[], None]]]) -> None:
        """Run each action that many seconds from now (the reply is about to go out); inf: never."""
        for seconds, action in deferred:
            if math.isfinite(seconds):
                timer = threading.Timer(seconds, action)
                timer.daemon = True
                timer.start()


def mark_done_late(directory: Path) -> None:
    if directory.is_dir():  # not if the directory was removed (or moved out) meanwhile
        (directory / "done").touch()


def other_ids(input_ids: Sequence[int], vocab_size: int, shift: int = 1) -> list[int]:
    """Ids that differ from input_ids at every position (for vocab_size >= 2), same length."""
    shift = 1 + (shift - 1) % max(vocab_size - 1, 1)
    return [(t + shift) % vocab_size for t in input_ids]


class BadDumper(Dumper):
    """The server's Dumper with one step's content made wrong; the steps' order is unchanged."""

    def __init__(self, base: Dumper, kind: str, vocab_size: int):
        super().__init__(
            base.root,
            boot_id=base.boot_id,
            dtype_name=base.dtype_name,
            hidden_size=base.hidden_size,
            anonymous=base.anonymous,
        )
        if kind not in BAD_DUMP_KINDS:
            raise ValueError(f"unknown bad dump kind {kind!r}")
        self.kind = kind
        self.vocab_size = vocab_size

    def write_hidden_states(self, directory: Path, hidden_states: HiddenStates) -> None:
        hs = {i: as_tensor(t) for i, t in hidden_states.items()}
        first = min(hs)
        if self.kind == "missing_layer":
            del hs[max(hs)]
        elif self.kind == "wrong_shape":
            t = hs[first]
            hs[first] = t[:, :-1] if t.shape[1] > 1 else torch.cat([t, t], dim=1)
        elif self.kind == "wrong_dtype":
            other = torch.float32 if self.dtype_name != "float32" else torch.bfloat16
            hs = {i: t.to(other) for i, t in hs.items()}
        elif self.kind in ("nan", "inf"):
            t = hs[first].clone()
            t[t.shape[0] // 2, t.shape[1] // 2] = math.nan if self.kind == "nan" else math.inf
            hs[first] = t
        super().write_hidden_states(directory, hs)
        path = directory / HIDDEN_STATES_FILE
        if self.kind == "truncated":
            data = sum(t.numel() * t.element_size() for t in hs.values())
            os.truncate(path, path.stat().st_size - max(1, data // 2))
        elif self.kind == "unreadable":
            # An absurd header length, then noise: no safetensors reader can make sense of it.
            path.write_bytes(b"\xff" * 8 + os.urandom(1016))

    def _ids(self, input_ids: Sequence[int]) -> Sequence[int]:
        return other_ids(input_ids, self.vocab_size) if self.kind == "wrong_ids" else input_ids

    def write_input_ids(self, directory: Path, input_ids: Sequence[int]) -> None:
        super().write_input_ids(directory, self._ids(input_ids))

    def build_meta(
        self, rid: str, counter: int, input_ids: Sequence[int], layers: list[int], cached_tokens: int = 0
    ) -> dict[str, Any]:
        meta = super().build_meta(rid, counter, self._ids(input_ids), layers, cached_tokens)
        if self.kind == "wrong_num_tokens":
            meta["num_tokens"] += 1
        elif self.kind == "cached_tokens":
            meta["cached_tokens"] = max(1, meta["num_tokens"] // 2)
        elif self.kind == "missing_meta_field":
            del meta["num_tokens"]
        elif self.kind == "duplicate_layer":
            meta["layers"] = [*meta["layers"], meta["layers"][-1]]
        return meta

    def write_meta(self, directory: Path, meta: dict[str, Any]) -> None:
        if self.kind == "bad_meta_json":
            text = json.dumps(meta, indent=1)
            (directory / "meta.json").write_text(text[: len(text) // 2], encoding="utf-8")
        else:
            super().write_meta(directory, meta)


# A prompt prefix in the cache: the next token -> the longer prefix.
_TrieNode: TypeAlias = "dict[int, _TrieNode]"


class PrefixCache:
    """--enable-radix-cache: a trie of the prompts served so far, like SGLang's radix cache.

    match() is how many leading tokens of a prompt some earlier prompt shares, capped at
    len(prompt) - 1 because a forward needs at least one new token. As in SGLang, a request's
    `extra_key` namespaces the cache: prompts only match prompts sent with the same key.
    """

    def __init__(self) -> None:
        self._roots: dict[str | None, _TrieNode] = {}
        self._lock = threading.Lock()

    def match(self, input_ids: Sequence[int], namespace: str | None = None) -> int:
        with self._lock:
            node, n = self._roots.get(namespace, {}), 0
            for token in input_ids[:-1]:
                child = node.get(token)
                if child is None:
                    break
                node, n = child, n + 1
            return n

    def insert(self, input_ids: Sequence[int], namespace: str | None = None) -> None:
        with self._lock:
            node = self._roots.setdefault(namespace, {})
            for token in input_ids:
                node = node.setdefault(token, {})

    def clear(self) -> None:
        with self._lock:
            self._roots = {}


def add_admin_routes(app: FastAPI, injector: FaultInjector) -> None:
    """Mount GET/POST/DELETE /admin/faults on a FastAPI app."""

    @app.get("/admin/faults")
    async def get_faults() -> dict[str, Any]:
        return injector.snapshot()

    @app.post("/admin/faults")
    async def post_faults(request: Request) -> Any:
        try:
            patch = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "the request body is not valid JSON"}}, status_code=400)
        try:
            injector.merge(patch)
        except FaultSettingsError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        return injector.snapshot()

    @app.delete("/admin/faults")
    async def delete_faults() -> dict[str, Any]:
        injector.reset()
        return injector.snapshot()

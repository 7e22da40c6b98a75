"""Fault injection in the reference server, through real server subprocesses on loopback.

Two synthetic servers (fast to start; faults act on the dumps, whatever computed them) for the
module: `syn`, counter mode, --enable-fault-injection and --chunked-prefill-size 64 (every prompt
here but the chunking one is shorter); and `rid`, rid mode with --enable-fault-injection
--enable-radix-cache --chunked-prefill-size 16 (its prompts start with distinct tokens so the prefix
cache only hits where a test means it to). Expected tensors come from synthetic_hidden_states().
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from hsx.reference.dumper import input_ids_sha256
from hsx.reference.faults import BAD_DUMP_KINDS, DEFAULT_SETTINGS, INJECTED_KINDS, other_ids
from hsx.reference.synthetic import synthetic_hidden_states
from tests.support.procs import Process, free_port, hsx_command

DUMP_FILES = {"meta.json", "hidden_states.safetensors", "input_ids.safetensors", "done"}
SYN_HIDDEN, SYN_LAYERS, SYN_VOCAB = 16, [1, 2, 4], 64  # --num-layers 4: EAGLE-3 capture [2, 2, 1, 4]
SYN_ARGS = [
    "--synthetic",
    "--hidden-size",
    "16",
    "--num-layers",
    "4",
    "--vocab-size",
    "64",
    "--enable-fault-injection",
    "--chunked-prefill-size",
    "64",
]
RID_HIDDEN, RID_LAYERS, RID_VOCAB = 16, [2, 4, 5, 8], 512
RID_ARGS = [
    "--synthetic",
    "--hidden-size",
    "16",
    "--num-layers",
    "8",
    "--vocab-size",
    "512",
    "--name-by",
    "rid",
    "--skip-server-warmup",
    "--enable-fault-injection",
    "--enable-radix-cache",
    "--chunked-prefill-size",
    "16",
]


class RefServer:
    """One reference server subprocess; restart() replaces a dead one on the same dump root."""

    def __init__(self, base: Path, name: str, args: list[str]):
        self.base, self.name, self.args = base, name, args
        self.dump_root = base / f"dumps_{name}"
        self.client = httpx.Client(timeout=30, trust_env=False)
        self.start()

    def start(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = hsx_command() + ["reference-server", "--dump-root", str(self.dump_root), "--port", str(port), *self.args]
        self.proc = Process(cmd, self.base / f"{self.name}.log")

    def wait(self) -> None:
        self.proc.wait_http(self.url + "/health", timeout=120)

    def restart(self) -> None:
        self.proc.stop()
        self.start()
        self.wait()

    def get(self, path: str) -> httpx.Response:
        return self.client.get(self.url + path)

    def generate(self, body: dict, **kwargs) -> httpx.Response:
        return self.client.post(self.url + "/generate", json=body, **kwargs)

    def prefill(self, ids: list[int], rid: str | None = None) -> dict:
        """A prefill-only /generate that must succeed; the reply body."""
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}}
        if rid is not None:
            body["rid"] = rid
        reply = self.generate(body)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def faults(self, patch: dict | None = None) -> dict:
        reply = (
            self.client.get(self.url + "/admin/faults")
            if patch is None
            else self.client.post(self.url + "/admin/faults", json=patch)
        )
        assert reply.status_code == 200, reply.text
        return reply.json()

    def dirs(self) -> set[str]:
        return {p.name for p in self.dump_root.iterdir() if p.name.startswith("req_")}

    def new_dumps(self, before: set[str]) -> list[Path]:
        """The new dump directories, in counter order."""
        new = [self.dump_root / name for name in self.dirs() - before]
        return sorted(new, key=lambda d: json.loads((d / "meta.json").read_text())["counter"])


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    started = [RefServer(base, "syn", SYN_ARGS), RefServer(base, "rid", RID_ARGS)]
    try:
        for server in started:
            server.wait()
        yield {s.name: s for s in started}
    finally:
        for server in started:  # SIGTERM to all first: the shutdowns overlap
            if server.proc.proc.poll() is None:
                os.killpg(server.proc.proc.pid, signal.SIGTERM)
        for server in started:
            server.client.close()
            # No second SIGTERM: it could land after the shutdown.
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.proc.proc.wait(timeout=30)
            server.proc.stop()
    assert [s.proc.proc.returncode for s in started] == [0, 0]


@pytest.fixture
def syn(servers) -> RefServer:
    server = servers["syn"]
    assert server.client.delete(server.url + "/admin/faults").status_code == 200
    return server


@pytest.fixture
def rid(servers) -> RefServer:
    server = servers["rid"]
    assert server.client.delete(server.url + "/admin/faults").status_code == 200
    return server


def meta_of(d: Path) -> dict:
    return json.loads((d / "meta.json").read_text())


def ids_of(d: Path) -> list[int]:
    return load_file(d / "input_ids.safetensors")["input_ids"].tolist()


def tensors_of(d: Path) -> dict[str, torch.Tensor]:
    return load_file(d / "hidden_states.safetensors")


def syn_expected(ids: list[int]) -> dict[str, torch.Tensor]:
    hs = synthetic_hidden_states(ids, SYN_LAYERS, SYN_HIDDEN, torch.bfloat16)
    return {f"layer_{i}": t for i, t in hs.items()}


def rid_expected(ids: list[int]) -> dict[str, torch.Tensor]:
    hs = synthetic_hidden_states(ids, RID_LAYERS, RID_HIDDEN, torch.bfloat16)
    return {f"layer_{i}": t for i, t in hs.items()}


def assert_complete(d: Path) -> None:
    assert {p.name for p in d.iterdir()} == DUMP_FILES, d
    done_at = (d / "done").stat().st_mtime_ns
    assert all((d / f).stat().st_mtime_ns <= done_at for f in DUMP_FILES)


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def only_injected(server: RefServer) -> dict[str, int]:
    return {k: v for k, v in server.faults()["injected"].items() if v}


# --- the admin API -----------------------------------------------------------------------------


def test_admin_api_get_merge_reset(syn):
    state = syn.faults()
    assert state["settings"] == DEFAULT_SETTINGS
    assert state["injected"] == dict.fromkeys(INJECTED_KINDS, 0)
    assert state["state"] == {"unavailable_remaining_s": 0.0}

    merged = syn.faults({"bad_dumps": {"count": 2}, "delay": {"seconds": 0.25}, "seed": 9})["settings"]
    assert merged["bad_dumps"] == {"count": 2, "probability": 0.0, "kind": "nan"}  # the rest is kept
    assert merged["delay"] == {"count": 0, "probability": 0.0, "seconds": 0.25} and merged["seed"] == 9
    merged = syn.faults({"bad_dumps": {"kind": ["inf", "nan"]}, "delay": None})["settings"]
    assert merged["bad_dumps"] == {"count": 2, "probability": 0.0, "kind": ["inf", "nan"]}
    assert merged["delay"] == DEFAULT_SETTINGS["delay"]  # null resets a section

    for bad in (
        {"nope": 1},
        {"crash": {"count": -1}},
        {"bad_dumps": {"kind": "mystery"}},
        {"late_done": {"seconds": "1"}},
        {"foreign_dumps": {"before": 1000}},
        {"delay": {"probability": 1.5}},
        {"crash": {"speed": 1}},
        [1, 2],
        {"bad_dumps": {"count": 1}, "crash": 3},
    ):
        reply = syn.client.post(syn.url + "/admin/faults", json=bad)
        assert reply.status_code == 400, (bad, reply.text)
        assert isinstance(reply.json()["error"]["message"], str)
    assert syn.faults()["settings"]["bad_dumps"]["count"] == 2  # a rejected patch changes nothing

    reset = syn.client.delete(syn.url + "/admin/faults").json()
    assert reset["settings"] == DEFAULT_SETTINGS and not any(reset["injected"].values())


def test_admin_api_is_off_by_default(tmp_path):
    # The existing test module's servers run without the flag; a quick in-process check suffices here.
    from hsx.reference.server import Engine, ServerSettings, create_reference_app

    engine = Engine(runner=None, dumper=None, name_by="rid")
    app = create_reference_app(engine, ServerSettings(dump_root=tmp_path, name_by="rid"), ready=None)
    assert not any(getattr(r, "path", "").startswith("/admin") for r in app.routes)


# --- foreign dumps -------------------------------------------------------------------------------


def test_foreign_dumps_around_the_real_one(syn):
    syn.faults({"foreign_dumps": {"count": 1, "before": 2, "after": 1}})
    prompt = [5, 9, 13, 17, 21]
    before = syn.dirs()
    reply = syn.generate({"input_ids": prompt, "rid": "real", "sampling_params": {"max_new_tokens": 0}})
    assert reply.status_code == 200, reply.text
    dumps = syn.new_dumps(before)
    metas = [meta_of(d) for d in dumps]
    assert [m["rid"] == "real" for m in metas] == [False, False, True, False]
    counters = [m["counter"] for m in metas]
    assert counters == list(range(counters[0], counters[0] + 4))  # each consumed a counter value
    assert all(d.name == f"req_{m['counter']}" for d, m in zip(dumps, metas))
    for d, m in zip(dumps, metas):
        assert_complete(d)
        ids = ids_of(d)
        assert m["num_tokens"] == len(ids) == len(prompt)
        assert m["input_ids_sha256"] == input_ids_sha256(ids)
        if m["rid"] == "real":
            assert ids == prompt
        else:
            assert m["rid"].startswith("foreign-") and all(a != b for a, b in zip(ids, prompt))
        tensors = tensors_of(d)
        assert all(torch.equal(tensors[k], v) for k, v in syn_expected(ids).items())
    assert len({tuple(ids_of(d)) for d in dumps}) == 4
    assert only_injected(syn) == {"foreign_dump": 3}
    # The count is spent: the next request writes its own dump only.
    before = syn.dirs()
    assert syn.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}}).status_code == 200
    assert len(syn.new_dumps(before)) == 1


def test_foreign_health_like_dump_in_rid_mode(rid):
    rid.faults({"foreign_dumps": {"count": 1, "before": 1, "after": 1, "health_like": True}})
    prompt = [450, 3, 4, 5, 6, 7]
    before = rid.dirs()
    rid.prefill(prompt, "fh-1")
    dumps = rid.new_dumps(before)
    assert dumps[0].name.startswith("req_HEALTH_CHECK_") and dumps[1].name == "req_fh-1"
    assert dumps[2].name.startswith("req_foreign-")
    health, real, foreign = (meta_of(d) for d in dumps)
    assert health["rid"].startswith("HEALTH_CHECK_") and ids_of(dumps[0]) == [0] and health["num_tokens"] == 1
    assert real["num_tokens"] == foreign["num_tokens"] == len(prompt)
    assert ids_of(dumps[2]) == other_ids(prompt, RID_VOCAB, shift=2)
    assert [health["counter"] + 1, health["counter"] + 2] == [real["counter"], foreign["counter"]]
    for d in dumps:
        assert_complete(d)
    assert only_injected(rid) == {"health_like_dump": 1, "foreign_dump": 1}


# --- crash, delay, unavailable, late done ------------------------------------------------------------


def test_crash_exits_before_the_dump_and_the_reply(syn):
    old_boot = syn.get("/get_server_info").json()["hs_dump"]["boot_id"]
    syn.faults({"crash": {"count": 1, "exit_code": 3}})
    before = syn.dirs()
    with pytest.raises(httpx.HTTPError):
        syn.generate({"input_ids": [1, 2, 3], "rid": "doomed"})
    assert syn.proc.proc.wait(timeout=20) == 3
    assert syn.dirs() == before  # no dump, not even a partial one
    assert "fault: crash with exit code 3" in syn.proc.log()

    # A new process on the same dump root, cleared first (as a reader would): the old process's
    # req_<n> would otherwise be overwritten one by one as the new counter reaches them.
    for d in syn.dump_root.iterdir():
        shutil.rmtree(d)
    syn.restart()
    info = syn.get("/get_server_info").json()
    assert info["hs_dump"]["boot_id"] != old_boot
    warmup, health = meta_of(syn.dump_root / "req_0"), meta_of(syn.dump_root / "req_1")
    assert (warmup["counter"], health["counter"]) == (0, 1)  # the counter restarted at 0
    assert warmup["boot_id"] == health["boot_id"] == info["hs_dump"]["boot_id"]
    assert syn.faults()["settings"] == DEFAULT_SETTINGS  # settings do not survive a restart


def test_delay_outlasts_a_client_timeout(syn):
    syn.faults({"delay": {"count": 1, "seconds": 1.5}})
    before = syn.dirs()
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        syn.generate({"input_ids": [7, 8, 9], "rid": "slow"}, timeout=0.5)
    # The dump was written before the delay; the request is still in flight (its rid is claimed),
    # and other requests are not held up.
    (slow,) = syn.new_dumps(before)
    assert_complete(slow)
    assert meta_of(slow)["rid"] == "slow"
    retry = syn.generate({"input_ids": [7, 8, 9], "rid": "slow"})
    assert retry.status_code == 400 and "Duplicate request ID detected" in retry.json()["error"]["message"]
    other = syn.generate({"input_ids": [7, 8, 9], "rid": "fast"})
    assert other.status_code == 200 and time.monotonic() - started < 1.5
    assert only_injected(syn) == {"delay": 1}
    wait_for(lambda: syn.generate({"input_ids": [7], "rid": "slow"}).status_code == 200, timeout=5)


def test_unavailable_answers_503_for_a_while(syn):
    syn.faults({"unavailable": {"seconds": 1.0}})
    before = syn.dirs()
    assert syn.generate({"input_ids": [1, 2]}).status_code == 503
    assert syn.get("/health").status_code == 503
    assert syn.get("/health_generate").status_code == 503
    assert syn.get("/get_model_info").status_code == 200  # only /generate and /health are affected
    assert 0 < syn.faults()["state"]["unavailable_remaining_s"] <= 1.0
    assert syn.dirs() == before
    assert only_injected(syn) == {"unavailable": 3}
    wait_for(lambda: syn.get("/health").status_code == 200, timeout=5)
    assert syn.generate({"input_ids": [1, 2]}).status_code == 200


def test_late_and_never_done(syn):
    syn.faults({"late_done": {"count": 1, "seconds": 0.8}})
    before = syn.dirs()
    assert syn.generate({"input_ids": [4, 4, 4], "rid": "late"}).status_code == 200
    replied = time.monotonic()
    (late,) = syn.new_dumps(before)
    assert {p.name for p in late.iterdir()} == DUMP_FILES - {"done"}  # complete but for `done`
    syn.faults({"late_done": {"count": 1, "never": True}})
    before = syn.dirs()
    assert syn.generate({"input_ids": [4, 4, 5], "rid": "never"}).status_code == 200
    (never,) = syn.new_dumps(before)
    wait_for((late / "done").exists, timeout=10)
    assert time.monotonic() - replied >= 0.7
    assert_complete(late)
    time.sleep(0.3)
    assert not (never / "done").exists() and (never / "meta.json").exists()
    assert only_injected(syn) == {"late_done": 1, "never_done": 1}


# --- bad dumps ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", BAD_DUMP_KINDS)
def test_bad_dump(syn, kind):
    syn.faults({"bad_dumps": {"count": 1, "kind": kind}})
    prompt = [11, 12, 13, 14, 15, 16]
    before = syn.dirs()
    reply = syn.generate({"input_ids": prompt, "rid": f"bad-{kind}", "sampling_params": {"max_new_tokens": 0}})
    assert reply.status_code == 200, reply.text
    (d,) = [syn.dump_root / name for name in syn.dirs() - before]
    assert_complete(d)  # every file, `done` last: only the content is wrong
    assert only_injected(syn) == {f"bad_dump.{kind}": 1}
    assert reply.json()["meta_info"]["cached_tokens"] == 0
    expected = syn_expected(prompt)
    path = d / "hidden_states.safetensors"

    if kind == "bad_meta_json":
        with pytest.raises(json.JSONDecodeError):
            meta_of(d)
        return
    meta = meta_of(d)
    layers = SYN_LAYERS + SYN_LAYERS[-1:] if kind == "duplicate_layer" else SYN_LAYERS
    assert meta["rid"] == f"bad-{kind}" and meta["layers"] == layers and meta["dtype"] == "bfloat16"
    if kind in ("truncated", "unreadable"):
        with pytest.raises(Exception):  # noqa: B017 - whatever safetensors raises for a broken file
            load_file(path)
        if kind == "unreadable":
            assert path.read_bytes()[:8] == b"\xff" * 8
        return
    assert_bad_tensors(kind, tensors_of(d), expected, prompt)
    assert_bad_meta(kind, meta, ids_of(d), prompt)


def assert_bad_tensors(
    kind: str, tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], prompt: list[int]
) -> None:
    """A bad dump's tensors: wrong as `kind` says, or the expected ones for a kind that spoils no tensor."""
    if kind == "missing_layer":
        assert sorted(tensors) == ["layer_1", "layer_2"]
    elif kind == "wrong_shape":
        assert tensors["layer_1"].shape == (len(prompt), SYN_HIDDEN - 1)
        assert torch.equal(tensors["layer_1"], expected["layer_1"][:, :-1])
    elif kind == "wrong_dtype":
        assert all(t.dtype == torch.float32 for t in tensors.values())
        assert all(torch.equal(tensors[k], v.float()) for k, v in expected.items())
    elif kind in ("nan", "inf"):
        bad = torch.isnan(tensors["layer_1"]) if kind == "nan" else torch.isinf(tensors["layer_1"])
        assert int(bad.sum()) == 1
        assert torch.isfinite(tensors["layer_2"]).all() and torch.isfinite(tensors["layer_4"]).all()
    else:
        assert all(torch.equal(tensors[k], v) for k, v in expected.items())


def assert_bad_meta(kind: str, meta: dict[str, Any], ids: list[int], prompt: list[int]) -> None:
    """A bad dump's meta.json and input ids: wrong as `kind` says, else the prompt's."""
    if kind == "wrong_num_tokens":
        assert meta["num_tokens"] == len(prompt) + 1
    elif kind == "wrong_ids":
        assert len(ids) == len(prompt) and all(a != b for a, b in zip(ids, prompt))
        assert meta["input_ids_sha256"] == input_ids_sha256(ids) != input_ids_sha256(prompt)
    elif kind == "cached_tokens":
        assert meta["cached_tokens"] > 0
    elif kind == "missing_meta_field":
        assert "num_tokens" not in meta
    if kind != "wrong_ids":
        assert ids == prompt


def test_bad_dumps_by_probability_from_a_kind_list(syn):
    syn.faults({"seed": 3, "bad_dumps": {"probability": 1.0, "kind": ["nan", "inf"]}})
    before = syn.dirs()
    for n in range(4):
        assert syn.generate({"input_ids": [20 + n, 1], "sampling_params": {"max_new_tokens": 0}}).status_code == 200
    dumps = syn.new_dumps(before)
    assert len(dumps) == 4
    assert all(not torch.isfinite(tensors_of(d)["layer_1"]).all() for d in dumps)
    injected = only_injected(syn)
    assert set(injected) <= {"bad_dump.nan", "bad_dump.inf"} and sum(injected.values()) == 4


def test_health_checks_are_not_faulted(syn):
    syn.faults({"bad_dumps": {"count": 1, "kind": "nan"}, "foreign_dumps": {"count": 1}})
    before = syn.dirs()
    assert syn.get("/health").status_code == 200
    (d,) = syn.new_dumps(before)
    assert meta_of(d)["rid"].startswith("HEALTH_CHECK_") and all(
        torch.isfinite(t).all() for t in tensors_of(d).values()
    )
    settings = syn.faults()["settings"]
    assert settings["bad_dumps"]["count"] == 1 and settings["foreign_dumps"]["count"] == 1


# --- server-settings faults: radix cache and chunked prefill -----------------------------------------


def test_server_info_reports_the_settings(servers):
    rid = servers["rid"].get("/get_server_info").json()
    assert (rid["disable_radix_cache"], rid["chunked_prefill_size"], rid["enable_fault_injection"]) == (False, 16, True)
    syn = servers["syn"].get("/get_server_info").json()
    assert (syn["disable_radix_cache"], syn["chunked_prefill_size"]) == (True, 64)


def test_radix_cache_serves_a_repeated_prefix(rid):
    prompt = [500, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    first = rid.prefill(prompt, "rc-1")
    assert first["meta_info"]["cached_tokens"] == 0
    assert meta_of(rid.dump_root / "req_rc-1")["num_tokens"] == len(prompt)

    longer = prompt + [7, 8, 9, 10, 11]
    reply = rid.prefill(longer, "rc-2")
    assert reply["meta_info"]["cached_tokens"] == len(prompt) and reply["meta_info"]["prompt_tokens"] == 15
    d = rid.dump_root / "req_rc-2"
    meta = meta_of(d)
    assert (meta["cached_tokens"], meta["num_tokens"]) == (10, 5)
    assert ids_of(d) == longer[10:] and meta["input_ids_sha256"] == input_ids_sha256(longer[10:])
    tensors = tensors_of(d)  # only the non-cached rows
    assert all(torch.equal(tensors[k], v[10:]) for k, v in rid_expected(longer).items())

    same = rid.prefill(longer, "rc-3")
    assert same["meta_info"]["cached_tokens"] == len(longer) - 1  # at least one token is computed

    assert rid.client.post(rid.url + "/flush_cache").status_code == 200
    fresh = rid.prefill(longer, "rc-4")
    assert fresh["meta_info"]["cached_tokens"] == 0 and meta_of(rid.dump_root / "req_rc-4")["num_tokens"] == 15


def test_chunked_prefill_in_counter_mode(syn):
    prompt = [(7 * i + 3) % SYN_VOCAB for i in range(150)]
    before = syn.dirs()
    reply = syn.generate({"input_ids": prompt, "rid": "chunky", "sampling_params": {"max_new_tokens": 0}})
    assert reply.status_code == 200 and reply.json()["meta_info"]["prompt_tokens"] == 150
    dumps = syn.new_dumps(before)
    metas = [meta_of(d) for d in dumps]
    assert [m["num_tokens"] for m in metas] == [64, 64, 22]
    assert [m["counter"] - metas[0]["counter"] for m in metas] == [0, 1, 2]
    assert {m["rid"] for m in metas} == {"chunky"} and all(m["cached_tokens"] == 0 for m in metas)
    full = syn_expected(prompt)
    for d, (a, b) in zip(dumps, [(0, 64), (64, 128), (128, 150)]):
        assert_complete(d)
        assert ids_of(d) == prompt[a:b]
        assert all(torch.equal(tensors_of(d)[k], v[a:b]) for k, v in full.items())


def test_chunked_prefill_and_radix_cache_in_rid_mode(rid):
    rid.prefill([401], "ch-0")
    start = meta_of(rid.dump_root / "req_ch-0")["counter"]
    prompt = [400] + list(range(100, 139))  # 40 tokens: chunks of 16, 16, 8, each a forward pass
    rid.prefill(prompt, "ch-1")
    meta = meta_of(rid.dump_root / "req_ch-1")  # each chunk rewrote req_ch-1: the last one remains
    assert (meta["counter"], meta["num_tokens"], meta["cached_tokens"]) == (start + 3, 8, 0)
    assert ids_of(rid.dump_root / "req_ch-1") == prompt[32:]
    tensors = tensors_of(rid.dump_root / "req_ch-1")
    assert all(torch.equal(tensors[k], v[32:]) for k, v in rid_expected(prompt).items())

    longer = prompt + list(range(200, 220))  # 40 cached tokens, then chunks of 16 and 4
    reply = rid.prefill(longer, "ch-2")
    assert reply["meta_info"]["cached_tokens"] == 40
    meta = meta_of(rid.dump_root / "req_ch-2")
    assert (meta["counter"], meta["num_tokens"], meta["cached_tokens"]) == (start + 5, 4, 40)
    tensors = tensors_of(rid.dump_root / "req_ch-2")
    assert all(torch.equal(tensors[k], v[56:]) for k, v in rid_expected(longer).items())

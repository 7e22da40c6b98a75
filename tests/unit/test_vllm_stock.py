"""vLLM with its own hidden-states connector, which writes no hsx-vllm.json (hsx.backends.engines.vllm): the
layers come from --capture-layers, the model from /v1/models and its config.json, the boot id from /metrics'
process_start_time_seconds; an engine that dies at hsx's probe is said to have died. Against a small HTTP server
on loopback that answers as vLLM 0.32 does."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from hsx import backends
from hsx.backends.dumps import DumpRoot
from hsx.backends.engine import CaptureProblem, Look, Server, ServerDown
from hsx.backends.engines.vllm import VLLM_INFO_FILE, VLLM_INFO_FORMAT, VLLMEngine
from hsx.cli import build_parser
from hsx.config import Settings, parse_layer_list
from hsx.extraction import server_watch
from hsx.extraction.server_watch import PROBE_RETRY_FIRST_S, PROBE_RETRY_MOST_S, ServerWatch
from hsx.identity import Identity
from hsx.sources import AUTO
from tests.support.procs import hsx_command

# What vLLM 0.32's /metrics says of its API server's process (prometheus_client's process collector).
METRICS = """# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds {started}
process_cpu_seconds_total 7.06
"""

# What vLLM 0.32 answers a request in flight when its engine core dies (EngineDeadError through
# create_error_response: 500), before its watchdog stops the API server; /health answers 503 meanwhile.
ENGINE_DEAD = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


class FakeVLLM:
    """/health, /v1/models and /metrics as vLLM answers them; what they say can be changed between looks."""

    def __init__(self, model_path: Path):
        self.card: dict[str, Any] = {
            "id": str(model_path),
            "object": "model",
            "owned_by": "vllm",
            "root": str(model_path),
            "max_model_len": 2048,
        }
        self.metrics: str | None = METRICS.format(started="1.79637827367e+09")
        self.asked: list[str] = []
        # What a completion does: "no_file" answers without naming a hidden-states file; "dies" kills the
        # engine (the answer as vLLM gives it, /health 503 from then on); "names_file" names a file that is never
        # written, and the engine dies (the scheduler named it before the worker's copy failed); "elsewhere"
        # writes the file and its lock into `elsewhere`, a folder other than the dump root, and names it there.
        self.completion = "no_file"
        self.elsewhere = Path("/nonexistent")
        self.dead = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.asked.append(self.path)
                if self.path == "/health":
                    self._send(503 if fake.dead else 200, "text/plain", "")
                elif self.path == "/v1/models":
                    self._send(200, "application/json", json.dumps({"object": "list", "data": [fake.card]}))
                elif self.path == "/metrics" and fake.metrics is not None:
                    self._send(200, "text/plain; version=0.0.4", fake.metrics)
                else:
                    self._send(404, "application/json", '{"detail": "Not Found"}')

            def do_POST(self) -> None:
                fake.asked.append(self.path)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path != "/v1/completions":
                    self._send(404, "application/json", '{"detail": "Not Found"}')
                    return
                status, answer = fake.complete(body, self.headers["X-Request-Id"])
                self._send(status, "application/json", json.dumps(answer))

            def _send(self, status: int, kind: str, body: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                return None

        self.root = Path("/nonexistent")  # the dump root, once a test's Server has one
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def complete(self, body: dict[str, Any], rid: str) -> tuple[int, dict[str, Any]]:
        """A completion's status and answer, as `completion` says."""
        if self.completion == "dies":
            self.dead = True
            return 500, ENGINE_DEAD
        answer: dict[str, Any] = {"choices": [{"text": "x"}], "usage": {"prompt_tokens": len(body["prompt"])}}
        if self.completion == "names_file":
            self.dead = True
            answer["kv_transfer_params"] = {"hidden_states_path": str(self.root / f"cmpl-{rid}-0.safetensors")}
        if self.completion == "elsewhere":
            path = self.elsewhere / f"cmpl-{rid}-0-5f3a.safetensors"
            path.write_bytes(b"\0" * 64)
            path.with_name(path.name + ".lock").touch()
            answer["kv_transfer_params"] = {"hidden_states_path": str(path)}
        return 200, answer

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 256, "vocab_size": 1000}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def fake(checkpoint: Path) -> Iterator[FakeVLLM]:
    f = FakeVLLM(checkpoint)
    yield f
    f.close()


def server(tmp_path: Path, fake: FakeVLLM, layers: list[int] | None) -> Server:
    root = tmp_path / "dumps"
    root.mkdir(exist_ok=True)
    fake.root = root.resolve()
    return Server(fake.url, DumpRoot(root), tmp_path / "staging", timeout_s=5.0, dump_wait_s=0.3, capture_layers=layers)


def look(s: Server, *, auto: bool = False) -> Look:
    return Look(s, auto=auto, after_outage=False)


def test_capture_layers_are_ascending_layer_numbers(monkeypatch):
    assert parse_layer_list("2,4,5,8") == [2, 4, 5, 8] and parse_layer_list("0,8") == [0, 8]
    assert parse_layer_list("") is None and Settings().capture_layer_list() is None
    for bad in ("8,2", "2,2", "2,x", "-1,2", "2,,4", "2,4,", ",", " ", "2, 4", "+2,4", "1_0"):
        with pytest.raises(ValueError):
            parse_layer_list(bad)
        with pytest.raises(ValueError):
            Settings(capture_layers=bad)
    monkeypatch.setenv("HSX_CAPTURE_LAYERS", "2,4,5,8")
    assert Settings().capture_layer_list() == [2, 4, 5, 8]


@pytest.mark.slow  # starts the command as a process: --all runs it
@pytest.mark.parametrize("command", ["serve", "worker"])
def test_capture_layers_with_an_empty_item_stop_the_command(tmp_path, command):
    """A list written with an empty item or a blank is refused (exit 2) before the database is touched,
    never read as the layers that remain."""
    for layers in ("2,,4", "2, 4"):
        database = tmp_path / "hsx.db"
        args = [command, "--capture-layers", layers, "--database-url", f"sqlite:///{database}"]
        proc = subprocess.run(hsx_command() + args, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"hsx {command}: --capture-layers (HSX_CAPTURE_LAYERS): {layers!r} is not" in proc.stderr
        assert not database.exists()


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_serve_and_worker_take_capture_layers(command):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flag = next(a for a in sub._actions if a.dest == "capture_layers")
    assert flag.option_strings == ["--capture-layers"]
    assert "ExampleHiddenStatesConnector" in (flag.help or "") and "ascending" in (flag.help or "")


def test_the_stock_capture_comes_from_the_flag_the_model_card_and_metrics(tmp_path, fake, checkpoint):
    s = server(tmp_path, fake, [2, 4, 5, 8])
    engine = VLLMEngine.discover(look(s))
    assert isinstance(engine, VLLMEngine) and engine.model == str(checkpoint)
    capture = engine.capture
    assert capture.layers == [2, 4, 5, 8] and capture.layers_from.startswith("--capture-layers")
    assert capture.model["final_layer"] == "pre_norm" and capture.model["num_hidden_layers"] == 8
    assert capture.model["model_path"] == str(checkpoint) and capture.hidden_size == 256
    assert capture.dtype is None, "the files say their dtype; the server does not say it before"
    assert capture.identity == Identity.IDS and capture.boot_id == "vllm-started-1796378273.67"
    assert "--capture-layers (2,4,5,8)" in engine.probe_hint()
    limits = VLLMEngine.limits(s)
    assert limits is not None and (limits.vocab_size, limits.max_tokens, limits.layers) == (1000, 2047, [2, 4, 5, 8])
    s.close()


def test_a_new_start_time_is_a_restart_and_no_metric_is_no_boot_id(tmp_path, fake):
    s = server(tmp_path, fake, [2, 8])
    first = VLLMEngine.discover(look(s))
    fake.metrics = METRICS.format(started="1.79637912e+09")
    second = VLLMEngine.discover(look(s))
    assert first is not None and second is not None and second.restarted(first)
    fake.metrics = "process_cpu_seconds_total 7.06\n"  # several API server processes: no start time
    third = VLLMEngine.discover(look(s))
    fake.metrics = None  # /metrics 404
    fourth = VLLMEngine.discover(look(s))
    assert third is not None and fourth is not None
    assert third.capture.boot_id is None and fourth.capture.boot_id is None
    assert not third.restarted(second), "unknown: not taken for a restart"
    s.close()


def test_auto_takes_a_server_owned_by_vllm_only_when_given_its_layers(tmp_path, fake):
    s = server(tmp_path, fake, None)
    assert VLLMEngine.discover(look(s, auto=True)) is None
    assert fake.asked == [], "without the flag or hsx-vllm.json, auto asks nothing"
    s.close()
    s = server(tmp_path, fake, [2, 8])
    assert isinstance(VLLMEngine.discover(look(s, auto=True)), VLLMEngine)
    assert isinstance(backends.discover(s, AUTO), VLLMEngine)
    fake.card["owned_by"] = "sglang"
    assert VLLMEngine.discover(look(s, auto=True)) is None
    s.close()


def test_without_either_source_of_layers_the_refusal_names_both(tmp_path, fake):
    s = server(tmp_path, fake, None)
    with pytest.raises(CaptureProblem, match=f"{VLLM_INFO_FILE}.*--capture-layers"):
        VLLMEngine.discover(look(s))
    s.close()


def test_layers_the_model_cannot_have_or_a_model_not_readable_here_are_refused(tmp_path, fake, checkpoint):
    s = server(tmp_path, fake, [2, 9])
    with pytest.raises(CaptureProblem, match="beyond the model's 8"):
        VLLMEngine.discover(look(s))
    s.close()
    (checkpoint / "config.json").unlink()
    s = server(tmp_path, fake, [2, 8])
    with pytest.raises(CaptureProblem, match=r"config\.json"):
        VLLMEngine.discover(look(s))
    s.close()


def test_hsx_vllm_json_wins_and_a_flag_that_disagrees_is_refused(tmp_path, fake):
    s = server(tmp_path, fake, [2, 4])
    info = {
        "format": VLLM_INFO_FORMAT,
        "layers": [2, 4, 5, 8],
        "num_hidden_layers": 8,
        "hidden_size": 256,
        "dtype": "float32",
        "model_path": "/nowhere",
        "boot_id": "b1",
    }
    (s.root.path / VLLM_INFO_FILE).write_text(json.dumps(info))
    with pytest.raises(CaptureProblem, match="disagrees"):
        VLLMEngine.discover(look(s))
    s.close()
    s = server(tmp_path, fake, [2, 4, 5, 8])
    engine = VLLMEngine.discover(look(s))
    assert engine is not None and engine.capture.boot_id == "b1" and engine.capture.dtype == "float32"
    assert engine.capture.layers_unverified is None, "hsx's connector says its layers"
    assert engine.capture.boot_id == "b1", "the connector's boot id, not the start time"
    s.close()


def test_an_hsx_vllm_json_older_than_the_server_now_running_is_refused(tmp_path, fake):
    """An earlier vLLM with hsx's connector left hsx-vllm.json; the one now running (vLLM's own connector)
    writes none: its layers and boot id would be taken for this server's."""
    s = server(tmp_path, fake, None)
    info = {"format": VLLM_INFO_FORMAT, "layers": [2, 8], "num_hidden_layers": 8, "hidden_size": 256}
    path = s.root.path / VLLM_INFO_FILE
    path.write_text(json.dumps({**info, "dtype": "float32", "model_path": "/m", "boot_id": "old"}))
    started = 1.79637827367e09
    os.utime(path, (started - 3600, started - 3600))
    with pytest.raises(CaptureProblem, match="written 3600 s before the vLLM now running started"):
        VLLMEngine.discover(look(s))
    os.utime(path, (started + 5, started + 5))  # written by this server's connector, after its start
    engine = VLLMEngine.discover(look(s))
    assert engine is not None and engine.capture.boot_id == "old"
    fake.metrics = None  # several API servers: no start time to hold the file to
    os.utime(path, (started - 3600, started - 3600))
    assert VLLMEngine.discover(look(s)) is not None
    s.close()


def test_a_probe_that_finds_no_file_on_a_live_server_asks_about_the_layers_and_the_dump_root(tmp_path, fake):
    s = server(tmp_path, fake, [2, 4, 5, 8])
    engine = VLLMEngine.discover(look(s))
    assert engine is not None
    unverified = engine.capture.layers_unverified or ""
    assert (
        unverified.startswith("--capture-layers 2,4,5,8 is the operator's word")
        and "checks only their count" in unverified
    )
    said = engine.probe()
    assert said is not None and said.cause == "no_dump"
    assert said.reason.startswith("a probe request gave no usable hidden states (no_dump: ")
    assert "--capture-layers (2,4,5,8)" in said.reason and "shared_storage_path" in said.reason
    s.close()


@pytest.mark.parametrize("how", ["dies", "names_file"])
def test_an_engine_that_dies_at_the_probe_is_said_to_have_died_until_a_probe_gets_through(tmp_path, fake, how):
    """The stock connector on a host without CUDA kills vLLM's engine at the first finished request: the writer says
    the engine died (not a question about --capture-layers or the storage path), and keeps saying it while the
    server is away."""
    s = server(tmp_path, fake, [2, 4, 5, 8])
    engine = VLLMEngine.discover(look(s))
    assert engine is not None
    fake.completion = how
    with pytest.raises(ServerDown) as down:
        engine.probe()
    said = str(down.value)
    assert said.startswith("the model server stopped answering during hsx's probe request: its engine died")
    assert "GET /health: HTTP 503" in said and "pin_memory=True" in said and "hsx's connector" in said
    assert "shared_storage_path" not in said, "nothing to ask about the dump root"
    if how == "dies":
        assert "HTTP 500" in said and "EngineCore encountered an issue" in said

    fake.dead, fake.completion = False, "dies"
    settings = Settings(source="vllm", capture_layers="2,4,5,8", backend_url=fake.url, dump_root=s.root.path)
    watch = ServerWatch(settings, s)
    engine_now, verdict = watch.ensure()
    assert engine_now is None and verdict is not None and verdict.state == "waiting"
    assert verdict.reason is not None and verdict.reason.startswith("the model server stopped answering")
    fake.close()  # then the API server exits: nothing listens
    _, verdict = watch.ensure()
    assert verdict is not None and verdict.reason is not None
    assert verdict.reason.startswith("model server not ready: GET ") and "ConnectError" in verdict.reason
    assert "(it went away at hsx's last probe: the model server stopped answering" in verdict.reason
    s.close()


def test_probes_into_another_folder_are_removed_and_sent_less_often_while_the_cause_stays(tmp_path, fake, monkeypatch):
    """A writer whose dump root is not where the server writes: each probe's file and lock, left in the server's
    folder, are removed once named; the reason says where the files went; the probe is sent again after 2 s,
    then 4, 8, ... up to 120 s while it fails the same way, and at once after a restart or on a new cause."""
    clock = [1000.0]
    monkeypatch.setattr(server_watch.time, "monotonic", lambda: clock[0])
    s = server(tmp_path, fake, [2, 4, 5, 8])
    fake.elsewhere = tmp_path / "vllm-storage"
    fake.elsewhere.mkdir()
    fake.completion = "elsewhere"
    settings = Settings(source="vllm", capture_layers="2,4,5,8", backend_url=fake.url, dump_root=s.root.path)
    watch = ServerWatch(settings, s)

    def probes() -> int:
        return fake.asked.count("/v1/completions")

    engine, verdict = watch.ensure()
    assert engine is None and verdict is not None and verdict.state == "refusing" and probes() == 1
    reason = verdict.reason or ""
    assert (
        f"the server writes its files to {fake.elsewhere}" in reason and "give hsx that folder as --dump-root" in reason
    )
    assert "hsx removed that file and its lock" in reason
    assert list(fake.elsewhere.iterdir()) == [], "nothing of hsx's probe is left in the server's folder"
    waits = []
    wait = PROBE_RETRY_FIRST_S
    while len(waits) < 8:
        clock[0] += wait - 0.01
        _, verdict = watch.ensure()
        assert verdict is not None and verdict.state == "refusing" and verdict.reason == reason, "the last probe's"
        sent = probes()
        clock[0] += 0.01
        _, verdict = watch.ensure()
        assert probes() == sent + 1, f"the probe goes {wait} s after the last"
        assert verdict is not None and verdict.reason is not None and "hsx removed that file" in verdict.reason
        reason = verdict.reason
        waits.append(wait)
        wait = min(wait * 2, PROBE_RETRY_MOST_S)
    assert waits == [2, 4, 8, 16, 32, 64, 120, 120]
    assert list(fake.elsewhere.iterdir()) == []

    fake.completion = "no_file"  # a new cause: the next probe, due now, starts the waits over
    clock[0] += PROBE_RETRY_MOST_S
    watch.ensure()
    clock[0] += PROBE_RETRY_FIRST_S
    sent = probes()
    watch.ensure()
    assert probes() == sent + 1

    fake.metrics = METRICS.format(started="1.79637900000e+09")  # restarted: probed at once
    sent = probes()
    _, verdict = watch.ensure()
    assert probes() == sent + 1 and verdict is not None and verdict.state == "refusing"
    s.close()

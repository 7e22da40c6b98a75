"""A Compose file's services run as local processes, for a machine without a container engine.

Each service runs its `command` with its `environment`, in its own folder, with the test interpreter's
scripts first on PATH (where the image has hsx and python). What a container would see is mapped:
a named volume's mount point to a folder shared by every service that mounts it; `<service>:<port>` to a
free loopback port (and the service's own port, as a bare number or on 127.0.0.1/localhost/0.0.0.0, to
the same); 0.0.0.0 to 127.0.0.1; and a URL naming a service the test provides itself (a database) to the
URL given for it. `depends_on` orders the start, and a service_healthy dependency is waited for by
running its healthcheck command until it succeeds."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from tests.support.procs import Process, free_port


class LocalCompose:
    def __init__(self, path: Path, tmp: Path, provided: dict[str, str]):
        self.spec: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
        self.services: dict[str, dict[str, Any]] = self.spec["services"]
        self.tmp = tmp
        self.provided = provided
        self.ports = {
            (name, port): free_port()
            for name, svc in self.services.items()
            if name not in provided
            for port in _container_ports(svc)
        }
        self.procs: dict[str, Process] = {}

    # -- what a service sees ------------------------------------------------------------------------

    def volume(self, name: str) -> Path:
        assert name in (self.spec.get("volumes") or {}), f"{name} is not a named volume"
        path = self.tmp / "volumes" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def url(self, service: str, port: int) -> str:
        return f"http://127.0.0.1:{self.ports[(service, port)]}"

    def mapped(self, service: str, value: Any) -> str:
        text = str(value)
        if urlsplit(text).scheme and urlsplit(text).hostname in self.provided:
            return self.provided[urlsplit(text).hostname or ""]
        for (name, port), free in self.ports.items():
            hosts = [name, "127.0.0.1", "localhost", "0.0.0.0"] if name == service else [name]
            for host in hosts:
                text = re.sub(rf"(?<![\w.-]){re.escape(host)}:{port}(?!\d)", f"127.0.0.1:{free}", text)
            if name == service and text == str(port):
                text = str(free)
        if text == "0.0.0.0":
            text = "127.0.0.1"
        for volume, target in self._mounts(service):
            if text == target or text.startswith(target + "/"):
                text = str(self.volume(volume)) + text[len(target) :]
        return text

    def argv(self, service: str) -> list[str]:
        command = self.services[service]["command"]
        words = shlex.split(command) if isinstance(command, str) else command
        return [self.mapped(service, w) for w in words]

    def env(self, service: str) -> dict[str, str]:
        raw = self.services[service].get("environment") or {}
        pairs = raw.items() if isinstance(raw, dict) else (item.split("=", 1) for item in raw)
        env = {key: self.mapped(service, value) for key, value in pairs}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        return env

    def _mounts(self, service: str) -> list[tuple[str, str]]:
        mounts = []
        for entry in self.services[service].get("volumes") or []:
            source, target = (entry.split(":")[:2]) if isinstance(entry, str) else (entry["source"], entry["target"])
            assert source in (self.spec.get("volumes") or {}), f"{service}: only named volumes are mapped ({source})"
            mounts.append((source, target))
        return mounts

    # -- running it ---------------------------------------------------------------------------------

    def up(self, services: list[str], timeout: float = 120.0) -> None:
        """Start the services in dependency order, each once its service_healthy dependencies pass
        their healthchecks; a dependency that is neither started here nor provided is an error."""
        for name in self._order(services):
            for dep, condition in _depends_on(self.services[name]).items():
                assert dep in self.procs or dep in self.provided, f"{name} depends on {dep}, not started"
                if condition == "service_healthy" and dep in self.procs:
                    self.wait_healthy(dep, timeout)
            folder = self.tmp / "services" / name
            folder.mkdir(parents=True, exist_ok=True)
            self.procs[name] = Process(self.argv(name), self.tmp / f"{name}.log", env=self.env(name), cwd=folder)

    def healthy(self, service: str) -> bool:
        test = self.services[service]["healthcheck"]["test"]
        if isinstance(test, str):
            test = ["CMD-SHELL", test]
        kind, *words = test
        argv = (
            [self.mapped(service, w) for w in words] if kind == "CMD" else ["sh", "-c", self.mapped(service, words[0])]
        )
        try:
            done = subprocess.run(argv, env={**os.environ, **self.env(service)}, capture_output=True, timeout=30)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    def wait_healthy(self, service: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        proc = self.procs[service]
        while not self.healthy(service):
            if proc.proc.poll() is not None:
                raise RuntimeError(f"{service} exited with {proc.proc.returncode}:\n{proc.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service} not healthy after {timeout}s:\n{proc.log()[-4000:]}")
            time.sleep(0.5)

    def down(self) -> None:
        for name in reversed(list(self.procs)):
            self.procs[name].stop()

    def _order(self, services: list[str]) -> list[str]:
        ordered: list[str] = []

        def visit(name: str, path: tuple[str, ...]) -> None:
            assert name not in path, f"dependency cycle: {' -> '.join(path + (name,))}"
            if name in ordered or name in self.provided:
                return
            for dep in _depends_on(self.services[name]):
                if dep in services or dep in self.provided:
                    visit(dep, path + (name,))
            ordered.append(name)

        for name in services:
            visit(name, ())
        return ordered


def _depends_on(svc: dict[str, Any]) -> dict[str, str]:
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return {name: "service_started" for name in deps}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def _container_ports(svc: dict[str, Any]) -> set[int]:
    """The ports a service listens on inside its container: `ports` targets and `expose`."""
    ports = set()
    for entry in svc.get("ports") or []:
        target = entry["target"] if isinstance(entry, dict) else str(entry).split(":")[-1]
        ports.add(int(str(target).split("/")[0]))
    for entry in svc.get("expose") or []:
        ports.add(int(str(entry).split("/")[0]))
    return ports

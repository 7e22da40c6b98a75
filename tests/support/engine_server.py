"""One real model server (SGLang or vLLM) run as a process for a test module: started, waited for
until /health answers, SIGKILLed, started again on the same port, stopped."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tests.support.procs import Process, free_port


@dataclass
class EngineServer:
    python: str
    tmp: Path
    model_path: Path
    port: int = field(default_factory=free_port, kw_only=True)
    proc: Process | None = field(default=None, kw_only=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> tuple[list[str], dict[str, str]]:
        """The server's command line and the environment it adds."""
        raise NotImplementedError

    def start(self) -> EngineServer:
        args, env = self.command()
        self.proc = Process(args, self.tmp / f"{type(self).__name__.lower()}-{self.port}.log", env=env)
        try:
            self.proc.wait_http(self.url + "/health", timeout=400)
        except BaseException:
            self.proc.stop()
            raise
        return self

    def log(self) -> str:
        return self.proc.log() if self.proc else ""

    def kill(self) -> None:
        if self.proc:
            self.proc.kill()

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()
            self.proc = None

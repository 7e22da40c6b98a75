"""Python client for the hsx API (httpx, synchronous)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx

TERMINAL_STATES = ("succeeded", "failed", "cancelled")


class HsxError(Exception):
    """An error answer from the service, built from its problem+json body."""

    def __init__(self, status: int, problem: dict):
        self.status = status
        self.problem = problem
        self.title = problem.get("title", "")
        self.detail = problem.get("detail", "")
        self.errors = problem.get("errors", [])
        super().__init__(f"HTTP {status}: {self.title}: {self.detail}")


class HsxClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, timeout: float = 60.0):
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout)

    def __enter__(self) -> "HsxClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        resp = self._http.request(method, path, **kwargs)
        if resp.status_code >= 400:
            try:
                problem = resp.json()
            except ValueError:
                problem = {"title": resp.reason_phrase, "detail": resp.text[:500]}
            raise HsxError(resp.status_code, problem)
        return resp

    def create_job(self, *, samples: list[dict] | None = None, input_path: str | None = None,
                   name: str | None = None, layers: list[int] | None = None) -> dict:
        body = {k: v for k, v in
                {"samples": samples, "input_path": input_path, "name": name, "layers": layers}.items()
                if v is not None}
        return self._call("POST", "/v1/jobs", json=body).json()

    def get_job(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}").json()

    def list_samples(self, job_id: str, *, state: str | None = None, after: str | None = None,
                     limit: int = 100) -> dict:
        params = {k: v for k, v in {"state": state, "after": after, "limit": limit}.items() if v is not None}
        return self._call("GET", f"/v1/jobs/{job_id}/samples", params=params).json()

    def iter_samples(self, job_id: str, *, state: str | None = None) -> Iterator[dict]:
        after = None
        while True:
            page = self.list_samples(job_id, state=state, after=after, limit=1000)
            yield from page["data"]
            if not page["has_more"]:
                return
            after = page["next_after"]

    def manifest(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}/manifest").json()

    def download_shard(self, job_id: str, name: str, dest: Path, *, sha256: str | None = None) -> Path:
        """Stream a shard to `dest` and check its sha256 (from the manifest when not given)."""
        if sha256 is None:
            sha256 = next(s["sha256"] for s in self.manifest(job_id)["shards"] if s["name"] == name)
        dest = Path(dest)
        tmp = dest.with_name(dest.name + ".part")
        digest = hashlib.sha256()
        with self._http.stream("GET", f"/v1/jobs/{job_id}/shards/{name}") as resp:
            if resp.status_code >= 400:
                resp.read()
                raise HsxError(resp.status_code, resp.json())
            with open(tmp, "wb") as f:
                for chunk in resp.iter_bytes(1 << 20):
                    f.write(chunk)
                    digest.update(chunk)
        if digest.hexdigest() != sha256:
            tmp.unlink()
            raise HsxError(0, {"title": "Checksum mismatch", "detail": f"{name}: sha256 differs from the manifest"})
        tmp.replace(dest)
        return dest

    def wait(self, job_id: str, *, timeout: float | None = None, poll_s: float = 0.5,
             on_progress: Callable[[dict], None] | None = None) -> dict:
        """Poll until the job is succeeded, failed or cancelled; return the final job."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = poll_s
        while True:
            job = self.get_job(job_id)
            if on_progress:
                on_progress(job)
            if job["state"] in TERMINAL_STATES:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job['state']} after {timeout}s")
            time.sleep(delay)
            delay = min(delay * 1.5, 5.0)

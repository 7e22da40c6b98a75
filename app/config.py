"""Service settings: every `hsx serve` flag can also come from an HSX_* environment variable."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HSX_", extra="ignore")

    backend_url: str = Field("http://127.0.0.1:30000", description="base URL of the SGLang-style model server")
    dump_root: Path = Field(Path("/dev/shm/sglang_hs"), description="the dump directory the server writes to")
    staging_dir: Path | None = Field(
        None,
        description="where validated dumps wait for their shard; must be on the dump root's file system "
        "(default: a sibling of the dump root named <dump_root>.hsx-staging)",
    )
    output_root: Path = Field(Path("hsx-data/output"), description="shards, manifest: <output_root>/<job id>/")
    input_root: Path = Field(Path("hsx-data/input"), description="server-side JSONL inputs are read from here only")
    database_url: str = Field("sqlite:///hsx-data/hsx.db", description="SQLAlchemy URL (SQLite file or Postgres)")
    host: str = "127.0.0.1"
    port: int = 8000
    shard_max_bytes: int = Field(256 * 1024 * 1024, description="a shard rolls once it would exceed this size")
    shard_max_wait_s: float = Field(
        30.0, description="staged samples are written to a shard at least this often, even below the size"
    )
    max_attempts: int = Field(3, description="attempts per sample before it fails")
    dump_wait_s: float = Field(30.0, description="how long to wait for a dump's `done` marker after the reply")
    request_timeout_s: float = Field(600.0, description="HTTP timeout for one /generate request")
    name_by: str = Field("auto", description="dump naming: auto (ask the server), counter or rid")
    max_json_bytes: int = Field(64 * 1024 * 1024, description="largest application/json request body")
    max_ndjson_bytes: int = Field(16 * 1024**3, description="largest streamed application/x-ndjson job body")
    api_tokens: str = Field(
        "",
        description="comma-separated bearer tokens, each TOKEN or TOKEN:read; when set, every endpoint but "
        "/healthz needs one, and :read tokens may only read",
    )
    disk_check: str = Field(
        "refuse",
        description="at job creation, when the output volume lacks room for the "
        "job's estimated size: refuse (507), warn (recorded in the job) or off",
    )
    max_in_flight: int = Field(4, description="rid mode: requests kept in flight at once (counter mode: always 1)")
    run_writer: bool = Field(True, description="run the single writer for the dump root in this process")

    def resolved_staging_dir(self) -> Path:
        if self.staging_dir is not None:
            return self.staging_dir
        root = self.dump_root.resolve()
        return root.with_name(root.name + ".hsx-staging")

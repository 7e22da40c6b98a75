"""The plugin's settings, read from the model server's environment."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

ENV_DUMP_ROOT = "HSX_DUMP_ROOT"
ENV_RID_PREFIX = "HSX_RID_PREFIX"
ENV_MAX_PENDING = "HSX_DUMP_MAX_PENDING"
# Set by the plugin in the launcher process, inherited by every scheduler process it starts, so
# all of one server launch's dumps carry the same boot id.
ENV_BOOT_ID = "HSX_SGLANG_BOOT_ID"

DEFAULT_RID_PREFIX = "hsx-"
DEFAULT_MAX_PENDING = 2

# A rid names a directory: letters, digits and a few punctuation marks, never a path separator.
SAFE_RID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+=@-]{0,199}")


class SettingsError(ValueError):
    """The environment sets the plugin up in a way it cannot work with."""


@dataclass(frozen=True)
class PluginSettings:
    dump_root: Path
    rid_prefix: str = DEFAULT_RID_PREFIX
    max_pending: int = DEFAULT_MAX_PENDING  # batches waiting for the writer thread


def settings_from_env(env: Mapping[str, str]) -> PluginSettings | None:
    """The settings, or None when HSX_DUMP_ROOT is unset (the plugin then stays idle)."""
    root = env.get(ENV_DUMP_ROOT, "").strip()
    if not root:
        return None
    prefix = env.get(ENV_RID_PREFIX, DEFAULT_RID_PREFIX)
    if not SAFE_RID.fullmatch(prefix):
        raise SettingsError(
            f"{ENV_RID_PREFIX}={prefix!r}: it must be non-empty and hold only letters, digits and ._:+=@- "
            "(an empty prefix would dump every request, health checks included)"
        )
    raw_pending = env.get(ENV_MAX_PENDING, str(DEFAULT_MAX_PENDING)).strip()
    try:
        max_pending = int(raw_pending)
    except ValueError:
        max_pending = 0
    if max_pending < 1:
        raise SettingsError(f"{ENV_MAX_PENDING}={raw_pending!r}: it must be a positive integer")
    return PluginSettings(dump_root=Path(root), rid_prefix=prefix, max_pending=max_pending)


def shared_boot_id(env: MutableMapping[str, str]) -> str:
    """This server launch's boot id: the inherited one, or a new one that child processes inherit."""
    return env.setdefault(ENV_BOOT_ID, uuid.uuid4().hex)

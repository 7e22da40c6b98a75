"""The plugin's source folder on the import path (it is its own distribution, deploy/sglang, not
installed with hsx), and the wheel of the SGLang release it supports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

PLUGIN_SOURCE = Path(__file__).resolve().parents[2] / "deploy" / "sglang"

if str(PLUGIN_SOURCE) not in sys.path:
    sys.path.insert(0, str(PLUGIN_SOURCE))

from tests.sglang_plugin.wheels import SUPPORTED_SGLANG, sglang_wheel  # noqa: E402


@pytest.fixture(scope="session")
def supported_wheel() -> Path:
    return sglang_wheel(SUPPORTED_SGLANG)

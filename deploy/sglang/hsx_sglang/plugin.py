"""The SGLang side: the entry point SGLang's plugin loader runs, and the two hooks it registers.

SGLang runs `register()` in every process that loads plugins (the launcher, the scheduler
processes, the detokenizer). The hooks only fire in a scheduler process:

- after `SchedulerBatchResultProcessor.__init__` (the model's config is known): start the capture
  and, on attention-TP rank 0, write `hsx-plugin.json`;
- around `SchedulerBatchResultProcessor.process_batch_result_prefill`: read the batch before SGLang
  processes it (processing changes the requests' chunk counters), queue the dumps after it (SGLang
  has then waited for the batch's device results).

Every SGLang name used here is checked against the released wheel by
tests/acceptance/test_sglang_release.py.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from hsx_sglang.capture import PrefillCapture, start_capture
from hsx_sglang.dumpdir import DTYPE_NAMES, DumpDirWriter
from hsx_sglang.layers import CapturedLayers, eagle3_layers
from hsx_sglang.settings import PluginSettings, SettingsError, settings_from_env, shared_boot_id

log = logging.getLogger("hsx_sglang")

PROCESSOR_CLASS = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
INIT_TARGET = f"{PROCESSOR_CLASS}.__init__"
PREFILL_TARGET = f"{PROCESSOR_CLASS}.process_batch_result_prefill"
AUX_CAPTURE_METHOD = "eagle3"  # SGLang's name for `--speculative-algorithm EAGLE3` in aux-capture mode


def _start_line() -> logging.Logger:
    """The logger of the one line saying at start whether the plugin is active. SGLang loads plugins with
    its own logging set up or not yet, at a level that may drop an INFO line: this logger writes to stderr
    itself, whatever SGLang's handlers and levels are, and only this line goes through it."""
    said = logging.getLogger("hsx_sglang.start")
    if not said.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s"))
        said.addHandler(handler)
        said.setLevel(logging.INFO)
        said.propagate = False
    return said


def register() -> None:
    """Entry point of the `sglang.srt.plugins` group. Logs one line saying whether the plugin is active."""
    try:
        settings = settings_from_env(os.environ)
    except SettingsError as exc:
        log.error("hsx-sglang: %s; idle, no dumps", exc)
        return
    if settings is None:
        _start_line().warning("hsx-sglang: HSX_DUMP_ROOT is not set; idle, no hooks registered, no dumps")
        return
    _start_line().info(
        "hsx-sglang: active, dumps to %s once the model is loaded (pid %d)", settings.dump_root, os.getpid()
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = SchedulerHooks(settings, shared_boot_id(os.environ))
    HookRegistry.register(INIT_TARGET, hooks.after_processor_init, HookType.AFTER)
    HookRegistry.register(PREFILL_TARGET, hooks.around_prefill, HookType.AROUND)


class SchedulerHooks:
    """The hooks of one process; its capture starts with the first batch result processor."""

    def __init__(self, settings: PluginSettings, boot_id: str):
        self.settings = settings
        self.boot_id = boot_id
        self.capture: PrefillCapture | None = None
        self.rank = 0
        self._started = False

    def after_processor_init(self, _returned: None, processor: Any, *args: Any, **kwargs: Any) -> None:
        """AFTER hook on the processor's constructor. A failure leaves the server serving, undumped."""
        if self._started:
            return
        try:
            from sglang.srt.runtime_context import get_exec, get_parallel

            self.start(processor, get_exec().features, int(get_parallel().attn_tp_rank))
        except Exception:
            log.exception("hsx-sglang: could not start; idle, no dumps")

    def start(self, processor: Any, features: Any, rank: int) -> None:
        """Start this process's capture from the processor and SGLang's execution features (its
        `aux_hidden_state_capture` and `return_aux_hidden_state_layer_ids`); once per process."""
        if self._started:
            return
        self._started = True
        self.rank = rank
        self.capture = self._start(processor, features)

    def _start(self, processor: Any, features: Any) -> PrefillCapture | None:
        layers, problem = captured_layers(processor, features)
        if layers is None:
            log.error("hsx-sglang: %s; idle, no dumps", problem)
            if self.rank == 0:  # no description of a capture that does not run
                DumpDirWriter(self.settings.dump_root, self.boot_id).remove_plugin_info()
            return None
        model_config = processor.model_config
        capture = start_capture(
            self.settings,
            layers=layers,
            boot_id=self.boot_id,
            attn_tp_rank=self.rank,
            hidden_size=int(model_config.hidden_size),
            dtype=DTYPE_NAMES.get(model_config.dtype, str(model_config.dtype).removeprefix("torch.")),
            sglang_version=_installed_version("sglang"),
        )
        log.info(
            "hsx-sglang: dumping requests with rid prefix %r to %s, layers %s, attention-TP rank %d",
            self.settings.rid_prefix,
            self.settings.dump_root,
            layers.all,
            self.rank,
        )
        return capture

    def around_prefill(self, original: Callable[..., Any], processor: Any, batch: Any, result: Any) -> Any:
        """AROUND hook on process_batch_result_prefill(self, batch, result)."""
        capture = self.capture
        if capture is None:
            return original(processor, batch, result)
        try:
            jobs = capture.plan(batch, result, self.rank)
        except Exception:
            log.exception("hsx-sglang: reading a prefill batch failed; no dumps from it")
            jobs = []
        returned = original(processor, batch, result)
        capture.submit(jobs)
        return returned


def captured_layers(processor: Any, features: Any) -> tuple[CapturedLayers | None, str]:
    """The layers this server's dumps hold, or None and why it cannot dump."""
    if not processor.is_generation:
        return None, "the model is not a generation model"
    if features.aux_hidden_state_capture != AUX_CAPTURE_METHOD:
        return None, (
            "aux hidden-state capture is off "
            "(launch with --enable-return-aux-hidden-states --speculative-algorithm EAGLE3)"
        )
    try:
        return eagle3_layers(processor.model_config.num_hidden_layers, features.return_aux_hidden_state_layer_ids), ""
    except ValueError as exc:
        return None, str(exc)


def _installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:  # SGLang run from a source tree
        return "unknown"

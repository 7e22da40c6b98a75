"""Stand-ins for the SGLang 0.5.23 objects the plugin reads, with exactly their attribute names.

`SGLANG_CLASS` names the class each one stands for; test_release_check.py checks every field and
method here against that class in the released wheel, so these cannot drift from the release.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass
class Req:
    SGLANG_CLASS: ClassVar[str] = "sglang.srt.managers.schedule_batch.Req"

    rid: str
    origin_input_ids: list[int]
    inflight_middle_chunks: int = 0
    cached_tokens: int = 0
    is_retracted: bool = False
    finished_reason: Any = None

    def finished(self) -> bool:
        return self.finished_reason is not None


@dataclass
class ScheduleBatch:
    SGLANG_CLASS: ClassVar[str] = "sglang.srt.managers.schedule_batch.ScheduleBatch"

    reqs: list[Req]


@dataclass
class LogitsProcessorOutput:
    SGLANG_CLASS: ClassVar[str] = "sglang.srt.layers.logits_processor.LogitsProcessorOutput"

    next_token_logits: torch.Tensor | None
    hidden_states: torch.Tensor | None = None
    last_hidden_states: torch.Tensor | None = None


@dataclass
class GenerationBatchResult:
    SGLANG_CLASS: ClassVar[str] = "sglang.srt.managers.utils.GenerationBatchResult"

    logits_output: LogitsProcessorOutput | None = None
    extend_input_len_per_req: list[int] | None = None
    copy_done: Any = None


@dataclass
class ModelConfig:
    SGLANG_CLASS: ClassVar[str] = "sglang.srt.configs.model_config.ModelConfig"

    num_hidden_layers: int
    hidden_size: int
    dtype: torch.dtype


@dataclass
class ExecFeatures:
    """What `get_exec().features` holds (sglang.srt.runtime_context)."""

    SGLANG_CLASS: ClassVar[str] = "sglang.srt.arg_groups.fields.exec_.ExecFeatures"

    aux_hidden_state_capture: str | None = None
    return_aux_hidden_state_layer_ids: list[int] | None = None


@dataclass
class Parallel:
    """What `get_parallel()` holds (sglang.srt.runtime_context)."""

    SGLANG_CLASS: ClassVar[str] = "sglang.srt.arg_groups.fields.parallel.Parallel"

    attn_tp_rank: int = 0


@dataclass(kw_only=True, slots=True, frozen=True)
class SchedulerBatchResultProcessor:
    """Constructed by keyword, frozen, with slots: like the release's."""

    SGLANG_CLASS: ClassVar[str] = (
        "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
    )

    is_generation: bool
    model_config: ModelConfig

    def process_batch_result_prefill(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        """What the release does to the requests that the plugin reads: a middle chunk's counter goes
        down, a request whose prefill completes gets its token (and, at max_new_tokens=1, finishes)."""
        for req in batch.reqs:
            if req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
            elif not req.finished():
                req.finished_reason = "length"

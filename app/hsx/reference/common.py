"""What the server, the model runner and the synthetic runner share, importable without transformers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hsx.dtypes import DTYPES as DTYPE_TABLE
from hsx.dtypes import HIDDEN_STATE_DTYPES

if TYPE_CHECKING:  # synthetic imports this module
    from hsx.reference.synthetic import RowGather

DTYPES: dict[str, torch.dtype] = {name: DTYPE_TABLE[name].torch for name in HIDDEN_STATE_DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Captured layer -> [T, hidden] in the model dtype: a tensor, or in synthetic mode a lazy
# synthetic.RowGather (shape, dtype, row slices, materialize(), buffers()) that the Dumper streams.
HiddenStates = Mapping[int, "torch.Tensor | RowGather"]


def as_tensor(t: torch.Tensor | RowGather) -> torch.Tensor:
    """A hidden-state value as a tensor: tensors as they are, lazy ones (synthetic.RowGather) gathered."""
    return t if isinstance(t, torch.Tensor) else t.materialize()


@dataclass
class ForwardResult:
    hidden_states: HiddenStates
    # Post-norm last layer [T, hidden], for return_hidden_states; a runner that would have to compute
    # it separately gives a function instead (final_hidden_fn), called only when a reply needs it.
    final_hidden: torch.Tensor | None
    output_ids: list[int]
    final_hidden_fn: Callable[[], torch.Tensor] | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (--enable-radix-cache)
    # Fault injection's work due after the reply (late `done` markers, late dumps, foreign dumps):
    # (seconds after the reply, inf = never; the action).
    after_reply: list[tuple[float, Callable[[], None]]] = field(default_factory=list)

    def last_hidden(self) -> torch.Tensor:
        if self.final_hidden is None:
            if self.final_hidden_fn is None:
                raise ValueError("the runner gave neither final_hidden nor final_hidden_fn")
            self.final_hidden = self.final_hidden_fn()
        return self.final_hidden

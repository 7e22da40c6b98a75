"""Which layers a dump holds, in HF `output_hidden_states` numbering (0 = embeddings, L = after the final norm)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CapturedLayers:
    aux: tuple[int, ...]  # ascending: the order of the column blocks of SGLang's aux hidden states
    final: int  # L, the post-norm last hidden state

    @property
    def all(self) -> list[int]:
        return sorted((*self.aux, self.final))


def eagle3_layers(num_hidden_layers: int, layer_ids: Sequence[int] | None = None) -> CapturedLayers:
    """The layers SGLang's EAGLE3 aux capture returns, plus L.

    Without explicit ids SGLang captures the inputs of decoder layers [2, L//2, L-3], which are
    the outputs of HF layers 2, L//2 and L-3; an explicit id i captures the input of layer i+1,
    HF layer i+1. A model captures in layer order, whatever order the ids were given in.
    """
    n = num_hidden_layers
    aux = sorted({2, n // 2, n - 3} if layer_ids is None else {int(i) + 1 for i in layer_ids})
    if not aux or aux[0] < 1 or aux[-1] >= n:
        raise ValueError(f"aux layers {aux} are outside 1..{n - 1} for a model of {n} layers")
    return CapturedLayers(aux=tuple(aux), final=n)

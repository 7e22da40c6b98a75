"""Layer numbers: hsx's numbering, layer lists as users write them, and EAGLE-3's choice of layers.

hsx numbers layers as transformers' `output_hidden_states` does: 0 is the embedding output, k the
output of decoder layer k, L (= num_hidden_layers) the last layer's output after the final norm.
EAGLE-3 trains on three auxiliary layers and the final layer. SGLang, SpecForge and vLLM name the
auxiliary layers [1, L//2 - 1, L - 4] by the decoder layer whose *output* they take, which in this
numbering is [2, L//2, L - 3]; with the post-norm final layer the capture is [2, L//2, L - 3, L].

A job asks for the layers its trainer reads, by name (LAYER_SETS) or as a list; a name fixes which side of
the final norm layer L lies too, since the trainers differ there and an export must never find out late.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal


def layer_key(layer: int) -> str:
    """The name of a layer's tensor in dumps and shards."""
    return f"layer_{layer}"


def parse_layers(text: str) -> list[int]:
    """Layer numbers written as "2,4,5,8" (in the order given; blanks around them are ignored)."""
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated layer numbers such as 2,4,5,8, not {text!r}") from None
    if not layers:
        raise ValueError("no layers given")
    return layers


def layers_arg(text: str) -> list[int]:
    """`parse_layers` as an argparse type: a bad list is a usage error naming the flag."""
    try:
        return parse_layers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def layer_choice_arg(text: str) -> list[int] | str:
    """A job's layers as a command line gives them: a set's name (LAYER_SETS, or any), or a list."""
    if text in LAYER_SETS or text == ANY_LAYERS:
        return text
    try:
        return parse_layers(text)
    except ValueError:
        names = ", ".join([*LAYER_SETS, ANY_LAYERS])
        raise argparse.ArgumentTypeError(f"expected one of {names}, or layer numbers such as 2,4,5,8") from None


# Far beyond any model (the largest have a few hundred layers), and small enough that a job's layers
# fit the database's layers key (jobs.layers_key, 2000 characters) on every engine alike.
MAX_LAYERS = 256
MAX_LAYER_INDEX = 4095


def check_layers(layers: list[int]) -> list[int]:
    """The layers a job requires: what a capture lists, each once, in ascending order."""
    if not layers or layers != sorted(set(layers)) or layers[0] < 0:
        raise ValueError("layers must be a non-empty list of non-negative, unique, ascending layer indices")
    if len(layers) > MAX_LAYERS or layers[-1] > MAX_LAYER_INDEX:
        raise ValueError(f"layers must list at most {MAX_LAYERS} layers, each at most {MAX_LAYER_INDEX}")
    return layers


def eagle3_aux_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def eagle3_capture_layers(num_layers: int) -> list[int]:
    """EAGLE-3's aux layers and the post-norm last layer, ascending; a model too small to have four
    distinct ones gets those it has."""
    return sorted({i for i in [*eagle3_aux_layers(num_layers), num_layers] if 0 <= i <= num_layers})


def select_layers(
    available: list[int], aux_layers: list[int] | None = None, last_layer: int | None = None
) -> tuple[list[int], int]:
    """(aux layers in concatenation order, last layer) among a job's captured layers.

    Defaults: the last layer is the highest captured one, the aux layers all the others in
    ascending order, and there must be exactly three of them (EAGLE-3) unless `aux_layers` is given.
    """
    have = sorted({int(i) for i in available})
    if not have:
        raise ValueError("the job captured no layers")
    last = max(have) if last_layer is None else int(last_layer)
    if last not in have:
        raise ValueError(f"last layer {last} is not in the job's captured layers {have}")
    if aux_layers is None:
        aux = [i for i in have if i != last]
        if len(aux) != 3:
            raise ValueError(
                f"the job captured layers {have}: with last layer {last} that leaves {len(aux)} "
                f"auxiliary layers {aux}, EAGLE-3 needs 3; choose them with aux_layers"
            )
        return aux, last
    aux = [int(i) for i in aux_layers]
    if not aux:
        raise ValueError("aux_layers is empty")
    if len(set(aux)) != len(aux):
        raise ValueError(f"aux_layers {aux} repeats a layer")
    missing = [i for i in aux if i not in have]
    if missing:
        raise ValueError(f"aux layers {missing} are not in the job's captured layers {have}")
    if last in aux:
        raise ValueError(f"layer {last} is both an aux layer and the last layer")
    return aux, last


@dataclass(frozen=True)
class LayerSet:
    """Layers a kind of drafter trains on, named; `final_layer` is the side of the final norm layer L
    must be taken from (post_norm: after it, as SGLang gives it; pre_norm: before, as vLLM does)."""

    name: str
    description: str
    final_layer: Literal["post_norm", "pre_norm"]
    last_only: bool = False

    def layers(self, num_layers: int) -> list[int]:
        return [num_layers] if self.last_only else eagle3_capture_layers(num_layers)


LAYER_SETS = {
    s.name: s
    for s in (
        LayerSet(
            "eagle3",
            "EAGLE-3's three aux layers and the last, after the final norm (SpecForge and Model Optimizer read "
            "it so; SGLang with the hsx-sglang plugin gives it so)",
            "post_norm",
        ),
        LayerSet(
            "eagle3_pre_norm",
            "EAGLE-3's three aux layers and the last, before the final norm (vLLM speculators read it so; vLLM "
            "gives it so)",
            "pre_norm",
        ),
        LayerSet(
            "last",
            "the last layer alone, after the final norm (EAGLE-1/2 and MTP-style drafters)",
            "post_norm",
            last_only=True,
        ),
        LayerSet("last_pre_norm", "the last layer alone, before the final norm", "pre_norm", last_only=True),
    )
}
# Whatever the server captures: the job keeps the layers of its first stored sample.
ANY_LAYERS: Literal["any"] = "any"
DEFAULT_LAYER_SET = "eagle3"
LayerSetName = Literal["eagle3", "eagle3_pre_norm", "last", "last_pre_norm", "any"]


def sets_given(layers: list[int] | None, num_layers: int | None, final_layer: str | None) -> list[str]:
    """The named sets a server gives exactly: capturing `layers` of a model of `num_layers` layers, its
    layer L on the `final_layer` side of the norm (post_norm when it does not say)."""
    if not layers or not num_layers:
        return []
    side = final_layer or "post_norm"
    return [s.name for s in LAYER_SETS.values() if s.final_layer == side and s.layers(num_layers) == sorted(layers)]


def describe_choice(choice: str | list[int] | None) -> str:
    """A job's layers as a person reads them: a list, or a set's name with what it means."""
    if isinstance(choice, list):
        return f"layers [{', '.join(map(str, choice))}]"
    if choice in LAYER_SETS:
        return f"layers {choice} ({LAYER_SETS[choice].description})"
    return "any layers"

"""Layer numbers: hsx's numbering, layer lists as users write them, and EAGLE-3's choice of layers.

hsx numbers layers as transformers' `output_hidden_states` does: 0 is the embedding output, k the
output of decoder layer k, L (= num_hidden_layers) the last layer's output after the final norm.
EAGLE-3 trains on three auxiliary layers and the final layer. SGLang, SpecForge and vLLM name the
auxiliary layers [1, L//2 - 1, L - 4] by the decoder layer whose *output* they take, which in this
numbering is [2, L//2, L - 3]; with the post-norm final layer the capture is [2, L//2, L - 3, L].
"""

from __future__ import annotations

import argparse


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

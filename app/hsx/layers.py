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
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

# A layer number as a list writes it: decimal digits, nothing else.
_NUMBER = re.compile(r"[0-9]+")
_SET_NAME = re.compile(r"[a-z][a-z0-9_]*")  # how every layer set is named (LAYER_SETS, any)


def layer_key(layer: int) -> str:
    """The name of a layer's tensor in dumps and shards."""
    return f"layer_{layer}"


def parse_layers(text: str) -> list[int]:
    """Layer numbers written as "2,4,5,8", in the order given. Each item is decimal digits alone, as strict as
    a JSON list of layers: an empty item ("2,,4"), a blank, a sign or anything int() would also take ("٣",
    "1_0") is an error, not dropped or read as something the writer may not have meant."""
    if not text:
        raise ValueError("no layers given")
    parts = text.split(",")
    bad = next((part for part in parts if not _NUMBER.fullmatch(part)), None)
    if bad is not None:
        what = "an empty item" if not bad.strip() else f"{bad!r}, which is not a layer number"
        raise ValueError(f"{text!r} is not comma-separated layer numbers such as 2,4,5,8: it has {what}")
    return [int(part) for part in parts]


def layers_arg(text: str) -> list[int]:
    """`parse_layers` as an argparse type: a bad list is a usage error naming the flag."""
    try:
        return parse_layers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def layer_choice_arg(text: str) -> list[int] | str:
    """A job's layers as a command line gives them (`parse_choice_text`): a usage error names the sets."""
    try:
        return parse_choice_text(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (comma-separated: eagle3,dflash or 2,4,5,8)") from None


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


def dflash_taps(num_layers: int, taps: int = 5) -> list[int]:
    """DFlash's target layers for a model of `num_layers` decoder layers, in hsx's numbering.

    DFlash (and DeepSpec's DFlash and DSpark drafters) taps `taps` decoder layers spread evenly from the
    second (index 1) to the fourth from the end (index L-4), rounded as Python rounds, ties to even:
    `round(1 + i * (L - 4) / (taps - 1))`. DeepSpec hooks those layers' *outputs* and counts decoder layers
    from 0 (its -1 is the embeddings), so its layer k is hsx's k + 1. Qwen3-8B (36 layers): DeepSpec's
    [1, 9, 17, 25, 33], hsx's [2, 10, 18, 26, 34]; Qwen3-14B (40): [1, 10, 19, 28, 37], hsx's
    [2, 11, 20, 29, 38]."""
    first, last = 1, num_layers - 3
    return [round(first + i * (last - first) / (taps - 1)) + 1 for i in range(taps)]


@dataclass(frozen=True)
class LayerSet:
    """Layers a kind of drafter trains on, named: `taps(L)` the layers it reads before the last, and layer L,
    taken on the `final_layer` side of the final norm (post_norm: after it, as SGLang gives it; pre_norm:
    before, as vLLM does). `min_layers`: the fewest decoder layers a model needs for the taps to be distinct."""

    name: str
    description: str
    final_layer: Literal["post_norm", "pre_norm"]
    taps: Callable[[int], list[int]] = eagle3_aux_layers
    min_layers: int = 1

    def fits(self, num_layers: int) -> str | None:
        """Why a model of `num_layers` decoder layers cannot give this set; None when it can."""
        if num_layers < self.min_layers:
            return f"{self.name} needs at least {self.min_layers} decoder layers, the model has {num_layers}"
        return None

    def layers(self, num_layers: int) -> list[int]:
        """The set's layers for a model of `num_layers` decoder layers, ascending; a model too small for
        EAGLE-3's four distinct ones gets those it has."""
        return sorted({i for i in [*self.taps(num_layers), num_layers] if 0 <= i <= num_layers})


def _no_taps(num_layers: int) -> list[int]:
    return []


LAYER_SETS = {
    s.name: s
    for s in (
        LayerSet(
            "eagle3",
            "EAGLE-3's three aux layers [2, L//2, L-3] and L after the final norm (SpecForge and Model Optimizer "
            "read it so; SGLang with the hsx-sglang plugin gives it so, and hsx applies the model's final norm to "
            "vLLM's L)",
            "post_norm",
        ),
        LayerSet(
            "eagle3_pre_norm",
            "EAGLE-3's three aux layers and L before the final norm (vLLM speculators read it so; vLLM gives it so)",
            "pre_norm",
        ),
        LayerSet(
            "dflash",
            "DFlash's and DSpark's five taps spread from layer 2 to L-2 (DeepSpec's target_layer_ids "
            "round(1 + i*(L-4)/4), plus one) and L after the final norm (DeepSpec's target cache)",
            "post_norm",
            dflash_taps,
            min_layers=8,
        ),
        LayerSet(
            "dflash_pre_norm",
            "DFlash's five taps and L before the final norm",
            "pre_norm",
            dflash_taps,
            min_layers=8,
        ),
        LayerSet(
            "last",
            "the last layer alone, after the final norm (EAGLE-1/2 and MTP-style drafters)",
            "post_norm",
            _no_taps,
        ),
        LayerSet("last_pre_norm", "the last layer alone, before the final norm", "pre_norm", _no_taps),
    )
}
# Whatever the server captures: the job keeps the layers of its first stored sample.
ANY_LAYERS: Literal["any"] = "any"
DEFAULT_LAYER_SET = "eagle3"
LayerSetName = Literal["eagle3", "eagle3_pre_norm", "dflash", "dflash_pre_norm", "last", "last_pre_norm", "any"]
# A job asking for several sets, or sets and layer ids, is stored under one key: its sets in LAYER_SETS'
# order, then its ids, joined by "+" ("eagle3+dflash", "eagle3+7,9").
CHOICE_JOIN = "+"


def set_names() -> str:
    """The names a job may ask for, for messages."""
    return ", ".join([*LAYER_SETS, ANY_LAYERS])


def parse_choice(value: object) -> list[int] | str:
    """A job's layers as given (a set's name, `any`, a list of layer ids, or a list of set names and ids) as
    hsx keeps them: a name, a list of ids (each once, ascending), or several sets with any ids as one key
    (CHOICE_JOIN). ValueError names what is wrong and the sets there are."""
    if isinstance(value, str):
        if value in LAYER_SETS or value == ANY_LAYERS:
            return value
        raise ValueError(f"{value!r} is no layer set: ask for one of {set_names()}, or a list of layer ids")
    if not isinstance(value, list) or not value:
        raise ValueError(f"layers must be a layer set ({set_names()}) or a non-empty list of sets and layer ids")
    if len(value) > MAX_LAYERS:
        raise ValueError(f"layers must list at most {MAX_LAYERS} layers, each at most {MAX_LAYER_INDEX}")
    names = [v for v in value if isinstance(v, str)]
    ids = [v for v in value if not isinstance(v, str)]
    bad = next((v for v in ids if type(v) is not int), None)
    if bad is not None:
        raise ValueError(f"layers lists {bad!r}: each element is a layer id or a set's name ({set_names()})")
    if not names:
        return check_layers(ids)
    if ids:
        check_layers(ids)
    ordered = _check_names(names)
    if len(ordered) == 1 and not ids:
        return ordered[0]
    return CHOICE_JOIN.join([*ordered, *([",".join(map(str, ids))] if ids else [])])


def _check_names(names: list[str]) -> list[str]:
    """The set names a list gives, in LAYER_SETS' order: known, each once, reading layer L on one side."""
    unknown = [n for n in names if n not in LAYER_SETS]
    if unknown:
        raise ValueError(
            f"{unknown[0]!r} is no layer set: a list may name {', '.join(LAYER_SETS)} (any stands alone), and layer ids"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"layers names a set twice: {names}")
    post = [n for n in names if LAYER_SETS[n].final_layer == "post_norm"]
    pre = [n for n in names if LAYER_SETS[n].final_layer == "pre_norm"]
    if post and pre:
        raise ValueError(
            f"layers asks for layer L after the final norm ({', '.join(post)}) and before it ({', '.join(pre)}); "
            "a job stores each layer once: ask for sets of one side (e.g. eagle3 and dflash, or eagle3_pre_norm "
            "and dflash_pre_norm)"
        )
    return [n for n in LAYER_SETS if n in names]


def parse_choice_text(text: str) -> list[int] | str:
    """A job's layers as a command line or a query string gives them: a set's name, or comma-separated sets
    and layer ids ("eagle3,dflash", "2,4,5,8", "eagle3,7"). As strict as a JSON body: an empty item, a blank
    or a sign is an error (parse_layers), never dropped."""
    parts = text.split(",")
    bad = next((part for part in parts if not (_NUMBER.fullmatch(part) or _SET_NAME.fullmatch(part))), None)
    if bad is not None:
        what = "an empty item" if not bad.strip() else f"{bad!r}, which is not a layer number or a set's name"
        raise ValueError(
            f"{text!r} is not comma-separated layer sets or numbers such as eagle3 or 2,4,5,8: it has {what}"
        )
    if len(parts) == 1 and not _NUMBER.fullmatch(parts[0]):
        return parse_choice(parts[0])
    return parse_choice([int(p) if _NUMBER.fullmatch(p) else p for p in parts])


def choice_parts(choice: list[int] | str) -> tuple[list[str], list[int]]:
    """(set names, layer ids) of a job's choice or its key; `any` has neither."""
    if isinstance(choice, list):
        return [], list(choice)
    if choice == ANY_LAYERS:
        return [], []
    names: list[str] = []
    ids: list[int] = []
    for part in choice.split(CHOICE_JOIN):
        if part in LAYER_SETS:
            names.append(part)
        else:
            ids += [int(i) for i in part.split(",")]
    return names, ids


def shown_choice(choice: list[int] | str) -> list[int | str] | str:
    """A job's choice as the API shows it: a name, a list of ids, or a list of set names and ids."""
    if isinstance(choice, list):
        return list[int | str](choice)
    if CHOICE_JOIN not in choice:
        return choice
    names, ids = choice_parts(choice)
    return [*names, *ids]


@dataclass(frozen=True)
class Wanted:
    """What a job asks for, on a model of a given depth: `layers`, the union of its sets and ids, ascending;
    `final_layer`, the side of the final norm its sets read layer L on (None: as the server gives it);
    `sets`, each named set's layers."""

    layers: list[int]
    final_layer: str | None
    sets: dict[str, list[int]]


def resolve(choice: list[int] | str, num_layers: int) -> Wanted:
    """The layers a job's choice (or its key) needs from a model of `num_layers` decoder layers; ValueError
    when a set does not fit that model or an id lies beyond its depth, saying which."""
    names, ids = choice_parts(choice)
    sets: dict[str, list[int]] = {}
    for name in names:
        why = LAYER_SETS[name].fits(num_layers)
        if why is not None:
            raise ValueError(why)
        sets[name] = LAYER_SETS[name].layers(num_layers)
    beyond = [i for i in ids if i > num_layers]
    if beyond:
        raise ValueError(f"layers {beyond} lie beyond the model's depth ({num_layers} decoder layers: 0..{num_layers})")
    union = sorted({*ids, *(i for layers in sets.values() for i in layers)})
    sides = {LAYER_SETS[n].final_layer for n in names}
    return Wanted(union, sides.pop() if len(sides) == 1 else None, sets)


def sets_within(layers: list[int] | None, num_layers: int | None, final_layer: str | None) -> dict[str, list[int]]:
    """The named sets that stored `layers` make, for a model of `num_layers` layers whose layer L is on the
    `final_layer` side of the norm (post_norm when not said): each set's layers."""
    if not layers or not num_layers:
        return {}
    have, side = set(layers), final_layer or "post_norm"
    return {
        s.name: s.layers(num_layers)
        for s in LAYER_SETS.values()
        if s.fits(num_layers) is None and s.final_layer == side and have.issuperset(s.layers(num_layers))
    }


def sets_given(
    layers: list[int] | None, num_layers: int | None, final_layer: str | None, *, converts: bool = False
) -> list[str]:
    """The named sets a server serves: capturing `layers` of a model of `num_layers` layers, its layer L on
    the `final_layer` side of the norm (post_norm when it does not say); with `converts`, hsx applies the
    model's final norm to a pre-norm L, so the post-norm sets are served too."""
    if not layers or not num_layers:
        return []
    given = list(sets_within(layers, num_layers, final_layer))
    if converts and final_layer == "pre_norm":
        given += sets_within(layers, num_layers, "post_norm")
    return [name for name in LAYER_SETS if name in given]


def describe_choice(choice: str | list[int] | None) -> str:
    """A job's layers as a person reads them: a list, or its sets' names with what each means."""
    if isinstance(choice, list):
        return f"layers [{', '.join(map(str, choice))}]"
    if choice is None or choice == ANY_LAYERS:
        return "any layers"
    names, ids = choice_parts(choice)
    parts = [f"{n} ({LAYER_SETS[n].description})" for n in names]
    if ids:
        parts.append(f"[{', '.join(map(str, ids))}]")
    return "layers " + " and ".join(parts)

"""Named layer sets, several in one job, and reading one back by name: the DFlash rule, how a job's
choice is kept, what a server serves, the manifest's layer_sets, the Dataset's and the exports' layer_set."""

from __future__ import annotations

import pytest
import torch

from hsx.exports import export_job
from hsx.exports.base import ExportRefused
from hsx.layers import LAYER_SETS, dflash_taps, parse_choice, parse_choice_text, resolve, sets_within, shown_choice
from hsx.matching import Serves
from hsx.training.dataset import HiddenStateDataset
from tests.support.jobs import make_job


@pytest.mark.parametrize(
    ("num_layers", "deepspec"),
    [(36, [1, 9, 17, 25, 33]), (40, [1, 10, 19, 28, 37]), (8, [1, 2, 3, 4, 5]), (9, [1, 2, 4, 5, 6])],
    ids=["qwen3-8b", "qwen3-14b", "tiny", "ties-to-even"],
)
def test_dflash_taps_are_deepspecs_layer_outputs_one_up(num_layers, deepspec):
    """DeepSpec's configs tap Qwen3-8B's (36 layers) and Qwen3-4B's outputs of decoder layers [1, 9, 17, 25,
    33], Qwen3-14B's (40) [1, 10, 19, 28, 37]: DFlash's round(1 + i * (L - 4) / 4). Its layer k is the output
    of decoder layer k counted from 0, hsx's layer k + 1; the set adds L after the final norm, what its
    target cache keeps as the last hidden state."""
    assert dflash_taps(num_layers) == [k + 1 for k in deepspec]
    assert LAYER_SETS["dflash"].layers(num_layers) == [*[k + 1 for k in deepspec], num_layers]
    assert LAYER_SETS["dflash"].final_layer == "post_norm" and LAYER_SETS["dflash_pre_norm"].final_layer == "pre_norm"


def test_dflash_needs_eight_layers_for_five_distinct_taps():
    assert LAYER_SETS["dflash"].fits(8) is None
    assert LAYER_SETS["dflash"].fits(7) == "dflash needs at least 8 decoder layers, the model has 7"
    assert len(set(dflash_taps(7))) < 5


@pytest.mark.parametrize(
    ("given", "kept", "shown"),
    [
        ("eagle3", "eagle3", "eagle3"),
        (["eagle3"], "eagle3", "eagle3"),
        (["dflash", "eagle3"], "eagle3+dflash", ["eagle3", "dflash"]),
        (["eagle3", 7, 9], "eagle3+7,9", ["eagle3", 7, 9]),
        ([2, 4, 5, 8], [2, 4, 5, 8], [2, 4, 5, 8]),
        ("any", "any", "any"),
    ],
)
def test_a_choice_is_kept_as_one_key_and_shown_as_given(given, kept, shown):
    assert parse_choice(given) == kept and shown_choice(kept) == shown


def test_a_choice_from_a_command_line():
    assert parse_choice_text("eagle3,dflash") == "eagle3+dflash"
    assert parse_choice_text("2,4,5,8") == [2, 4, 5, 8]
    assert parse_choice_text("dflash") == "dflash"
    assert parse_choice_text("eagle3,7") == "eagle3+7"
    for lax in ("eagle3, 7", "eagle3,,dflash", "eagle3,", "+2,4"):  # as strict as a JSON body: never dropped
        with pytest.raises(ValueError, match=r"it has (an empty item|'.*', which is not a layer number)"):
            parse_choice_text(lax)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ([], "a layer set (eagle3, eagle3_pre_norm, dflash, dflash_pre_norm, last, last_pre_norm, any)"),
        ("eagle4", "'eagle4' is no layer set: ask for one of eagle3, eagle3_pre_norm, dflash"),
        (["eagle3", "dflsh"], "'dflsh' is no layer set: a list may name eagle3, eagle3_pre_norm, dflash"),
        (["eagle3", "any"], "(any stands alone)"),
        (["eagle3", "eagle3"], "names a set twice"),
        (["eagle3", "dflash_pre_norm"], "after the final norm (eagle3) and before it (dflash_pre_norm)"),
        (["eagle3", 4, 2], "ascending"),
        (["eagle3", 2.5], "each element is a layer id or a set's name"),
    ],
)
def test_a_bad_choice_names_the_sets(given, message):
    with pytest.raises(ValueError) as refused:
        parse_choice(given)
    assert message in str(refused.value)


def test_several_sets_resolve_to_their_union_on_a_model():
    wanted = resolve("eagle3+dflash", 36)
    assert wanted.layers == [2, 10, 18, 26, 33, 34, 36] and wanted.final_layer == "post_norm"
    assert wanted.sets == {"eagle3": [2, 18, 33, 36], "dflash": [2, 10, 18, 26, 34, 36]}
    assert resolve("eagle3+7", 8).layers == [2, 4, 5, 7, 8] and resolve([3, 8], 8).final_layer is None
    with pytest.raises(ValueError, match="dflash needs at least 8 decoder layers, the model has 6"):
        resolve("eagle3+dflash", 6)
    with pytest.raises(ValueError, match=r"layers \[12\] lie beyond the model's depth"):
        resolve("eagle3+12", 8)


def test_a_server_serves_the_sets_its_capture_covers_on_its_side_of_the_norm():
    llama = {"model_path": "/m", "num_hidden_layers": 8}
    union = Serves.of([2, 3, 4, 5, 6, 8], llama)
    assert union.gives("eagle3+dflash") and union.gives("eagle3") and union.gives("dflash+4")
    assert not union.gives("eagle3+7") and union.refusal("eagle3+7") == "it does not capture layers [7]"
    assert not union.gives("dflash_pre_norm") and "cannot be undone" in (union.refusal("dflash_pre_norm") or "")
    vllm = {**llama, "final_layer": "pre_norm"}
    assert not Serves.of([2, 3, 4, 5, 6, 8], vllm).gives("eagle3+dflash")
    assert Serves.of([2, 3, 4, 5, 6, 8], vllm, converts=True).gives("eagle3+dflash")
    # A list of ids reads L as the server gives it, whichever side that is.
    assert Serves.of([2, 3, 4, 5, 6, 8], vllm).gives("2,8")
    # A server that does not say the model's depth serves no named set, only ids it captures.
    blind = Serves.of([2, 4], {"model_path": "/m"})
    assert not blind.gives("eagle3") and blind.gives("2") and not blind.gives("3")


def test_stored_layers_make_every_set_they_hold_on_their_side_of_the_norm():
    assert sets_within([2, 3, 4, 5, 6, 8], 8, "post_norm") == {
        "eagle3": [2, 4, 5, 8],
        "dflash": [2, 3, 4, 5, 6, 8],
        "last": [8],
    }
    assert sets_within([2, 4, 5, 8], 8, "pre_norm") == {"eagle3_pre_norm": [2, 4, 5, 8], "last_pre_norm": [8]}
    assert sets_within([2, 4, 5], 8, "post_norm") == {}


@pytest.fixture
def union_job(tmp_path):
    """A job of eagle3 and dflash on an 8-layer model, each layer stored once."""
    return make_job(
        tmp_path,
        layers=[2, 3, 4, 5, 6, 8],
        model={"model_type": "llama"},
        post_norm_layers=[8],
        num_samples=3,
    )


def test_each_set_of_a_job_is_read_back_by_name(union_job):
    assert union_job.manifest.sets() == {"eagle3": [2, 4, 5, 8], "dflash": [2, 3, 4, 5, 6, 8], "last": [8]}
    eagle3 = HiddenStateDataset(union_job.job_dir, layer_set="eagle3")
    dflash = HiddenStateDataset(union_job.job_dir, layer_set="dflash")
    last = HiddenStateDataset(union_job.job_dir, layer_set="last")
    assert (eagle3.aux_layers, dflash.aux_layers, last.aux_layers) == ([2, 4, 5], [2, 3, 4, 5, 6], [])
    for k, sample in enumerate(union_job.samples):
        want = sample.layers
        assert torch.equal(eagle3[k]["aux_hidden_state"], torch.cat([want[2], want[4], want[5]], dim=-1))
        assert torch.equal(dflash[k]["aux_hidden_state"], torch.cat([want[i] for i in (2, 3, 4, 5, 6)], dim=-1))
        assert torch.equal(dflash[k]["hidden_state"], want[8]) and torch.equal(eagle3[k]["hidden_state"], want[8])
        assert last[k]["aux_hidden_state"].shape == (want[8].shape[0], 0)


def test_a_set_the_job_did_not_capture_is_refused_naming_those_it_did(union_job, tmp_path):
    with pytest.raises(ValueError, match=r"the job did not capture layer set eagle3_pre_norm: its layers "):
        HiddenStateDataset(union_job.job_dir, layer_set="eagle3_pre_norm")
    with pytest.raises(ValueError, match=r"eagle4 is no layer set \(the sets are eagle3, eagle3_pre_norm"):
        HiddenStateDataset(union_job.job_dir, layer_set="eagle4")
    with pytest.raises(ValueError, match="not both"):
        HiddenStateDataset(union_job.job_dir, layer_set="eagle3", aux_layers=[2, 4, 5])
    out = tmp_path / "sf"
    with pytest.raises(ExportRefused, match=r"specforge: the job did not capture layer set dflash_pre_norm"):
        export_job("specforge", union_job.job_dir, out, layer_set="dflash_pre_norm")
    with pytest.raises(ExportRefused, match="exactly three distinct aux layers"):
        export_job("specforge", union_job.job_dir, out, layer_set="dflash")
    assert not out.exists(), "a refused export writes nothing"


def test_every_export_selects_a_set_by_name(union_job, tmp_path):
    result = export_job("specforge", union_job.job_dir, tmp_path / "sf", layer_set="eagle3")
    assert result.written == 3
    first = torch.load(tmp_path / "sf" / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    want = union_job.samples[0].layers
    assert torch.equal(first["aux_hidden_state"][0], torch.cat([want[2], want[4], want[5]], dim=-1))
    export_job("modelopt", union_job.job_dir, tmp_path / "mo", layer_set="dflash")
    item = torch.load(tmp_path / "mo" / "s-0.pt", weights_only=True)
    assert torch.equal(item["aux_hidden_states"], torch.cat([want[i] for i in (2, 3, 4, 5, 6)], dim=-1))
    assert torch.equal(item["hidden_states"], want[8])

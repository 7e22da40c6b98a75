"""A job runs only on workers whose layers and model match it, on SQLite and Postgres: claims skip
the jobs a worker cannot serve, the first stored sample pins the job's model and layers, and a job
nobody live can serve says why it waits."""

from __future__ import annotations

import numpy as np
import pytest

from hsx.db import repository as repo
from hsx.db.models import JobRow
from hsx.matching import Serves, model_key
from hsx.service.errors import InvalidInput
from hsx.service.jobs import check_layers_fit, check_regenerate
from hsx.service.views import job_out
from hsx.wire import JobOptions

LLAMA = {"model_path": "/models/llama", "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64}
QWEN = {"model_path": "/models/qwen", "model_type": "qwen2", "num_hidden_layers": 8, "hidden_size": 64}


def job_with(sessions, n: int, layers: list[int] | str | None = None) -> str:
    samples = [repo.NewSample(f"s{i}", np.arange(1, 5, dtype="<i4").tobytes(), None, 4) for i in range(n)]
    with sessions.begin() as s:
        return repo.create_job(s, name=None, layers=layers, samples=samples).id


def claim(sessions, writer: str, serves: Serves) -> repo.Claimed | None:
    with sessions.begin() as s:
        return repo.claim_next(s, writer, serves)


def stage(sessions, c: repo.Claimed, writer: str, serves: Serves, layers: list[int]) -> dict:
    """What the request loop records with a job's first dump: the model, then the staged sample."""
    model = dict(LLAMA if serves.model == model_key(LLAMA) else QWEN, layers=layers, dtype="bfloat16")
    with sessions.begin() as s:
        recorded = repo.set_job_model_info(s, c.job_id, model, serves)
        repo.mark_staged(
            s, c, writer=writer, staged_path="/staged/x", observed_tokens=4, dump_key=None, boot_id=None, identity="ids"
        )
    return recorded


def test_a_claim_skips_jobs_of_other_layers(sessions):
    asks_2_4 = job_with(sessions, 2, layers=[2, 4])
    any_layers = job_with(sessions, 2)
    other = claim(sessions, "w-6-8", Serves.of([6, 8], LLAMA))
    assert other is not None and other.job_id == any_layers, "the older job asks for layers this worker lacks"
    mine = claim(sessions, "w-2-4", Serves.of([2, 4], LLAMA))
    assert mine is not None and mine.job_id == asks_2_4
    # A worker whose server does not say its layers may take either: its dumps are checked as they come.
    unknown = claim(sessions, "w-unknown", Serves.of(None, LLAMA))
    assert unknown is not None and unknown.job_id == asks_2_4


def test_the_first_stored_sample_pins_the_model_and_layers(sessions):
    job_id = job_with(sessions, 4)
    llama_2_4, qwen_2_4, llama_6 = Serves.of([2, 4], LLAMA), Serves.of([2, 4], QWEN), Serves.of([6], LLAMA)
    first = claim(sessions, "a", llama_2_4)
    assert first is not None
    stage(sessions, first, "a", llama_2_4, [2, 4])
    with sessions() as s:
        job = repo.get_job(s, job_id)
        assert job is not None and (job.layers_key, job.model_key) == ("2,4", model_key(LLAMA))
    assert claim(sessions, "b", qwen_2_4) is None, "another model may not add samples to the job"
    assert claim(sessions, "c", llama_6) is None, "nor other layers of the same model"
    second = claim(sessions, "d", Serves.of([2, 4], dict(LLAMA)))
    assert second is not None and second.job_id == job_id


def test_a_job_asking_for_any_layers_still_shows_any_once_its_first_sample_pins_them(sessions):
    job_id = job_with(sessions, 2, layers="any")
    serves = Serves.of([1, 3], LLAMA)
    c = claim(sessions, "a", serves)
    assert c is not None
    stage(sessions, c, "a", serves, [1, 3])
    with sessions() as s:
        job = repo.get_job(s, job_id)
        assert job is not None and job.layers_key == "1,3" and job_out(job).layers == "any"
    both = job_with(sessions, 1, layers="eagle3+dflash+7")
    with sessions() as s:
        assert job_out(repo.get_job(s, both)).layers == ["eagle3", "dflash", 7]


def test_a_job_asking_for_layers_keeps_them_once_its_model_is_recorded(sessions):
    job_id = job_with(sessions, 2, layers=[2, 4])
    serves = Serves.of([2, 4], LLAMA)
    c = claim(sessions, "a", serves)
    assert c is not None
    stage(sessions, c, "a", serves, [2, 4])
    with sessions() as s:
        job = repo.get_job(s, job_id)
        assert job is not None and job.layers == [2, 4] and job.layers_key == "2,4"


def test_a_job_no_live_worker_serves_says_why_it_waits(sessions):
    job_id = job_with(sessions, 2, layers=[2, 4])
    for identity, layers, model in (("host:/a", [6, 8], LLAMA), ("host:/b", [2, 4], QWEN)):
        with sessions.begin() as s:
            epoch = repo.register_writer(
                s, identity, lease_s=30, started_at=repo.utcnow(), staged_exists=lambda _: True
            )
            server = {"layers": layers, "model_path": model["model_path"], "model_key": model_key(model)}
            repo.renew_lease(s, identity, epoch, lease_s=30, state="ready", reason=None, server=server, stats=None)
    with sessions() as s:
        job = repo.get_job(s, job_id)
        assert job is not None
        reason = repo.waiting(s).reason(job)
    # host:/b gives the layers (its model is not pinned yet): the job can run there.
    assert reason is None
    with sessions.begin() as s:
        s.get(JobRow, job_id).model_key = model_key(LLAMA)
    with sessions() as s:
        job = repo.get_job(s, job_id)
        reason = repo.waiting(s).reason(job)
    assert reason is not None and "no live worker serves this job" in reason
    assert "layers [2, 4]" in reason and "the worker on host reading /a gives layers [6, 8] of /models/llama" in reason
    assert "the worker on host reading /b gives layers [2, 4] of /models/qwen" in reason


def test_a_new_job_keeps_to_the_tightest_limits_of_the_live_workers_that_may_run_it(sessions):
    """The limits workers register with their heartbeat: a new job's are the tightest among the live
    workers whose layers fit it (any model: none is pinned yet); a stopped worker's no longer count."""
    workers = {"host:/a": ([6, 8], 32000, 4096), "host:/b": ([2, 4], 128000, 1024), "host:/c": (None, None, 8192)}
    epochs = {}
    for identity, (layers, vocab, longest) in workers.items():
        with sessions.begin() as s:
            epochs[identity] = epoch = repo.register_writer(
                s, identity, lease_s=30, started_at=repo.utcnow(), staged_exists=lambda _: True
            )
            server = {"layers": layers, "vocab_size": vocab, "max_prompt_tokens": longest}
            repo.renew_lease(
                s, identity, epoch, lease_s=30, state="ready", reason=None, server=server, stats=None,
                vocab_size=vocab, max_prompt_tokens=longest,
            )  # fmt: skip
    with sessions() as s:
        assert repo.writer_limits(s, None) == (32000, 1024), "every worker may run it"
        assert repo.writer_limits(s, [2, 4]) == (128000, 1024), "a, whose layers differ, may not"
        assert repo.writer_limits(s, [6, 8]) == (32000, 4096)
        assert repo.writer_limits(s, [1]) == (None, 8192), "only c, which does not say its layers"
    with sessions.begin() as s:
        repo.report_writer_stopped(s, "host:/b", epochs["host:/b"])
    with sessions() as s:
        assert repo.writer_limits(s, [2, 4]) == (None, 8192), "a stopped worker claims nothing"


def test_regeneration_is_refused_only_once_every_live_worker_has_said_what_its_server_is(sessions):
    """A worker still probing its server (no source yet) may turn out to generate: a regenerate job then
    waits; once every live worker has said and none generates for hsx, the job is refused at creation."""
    options = JobOptions.model_validate({"regenerate": {"max_new_tokens": 4}})
    with sessions.begin() as s:
        epoch = repo.register_writer(s, "host:/v", lease_s=30, started_at=repo.utcnow(), staged_exists=lambda _: True)
        repo.renew_lease(s, "host:/v", epoch, lease_s=30, state="starting", reason=None, server={}, stats=None)
    check_regenerate(sessions, options)  # not refused: the worker has not said yet
    with sessions.begin() as s:
        server = {"source": "vllm", "regenerates": False, "applies_seed": True}
        repo.renew_lease(s, "host:/v", epoch, lease_s=30, state="ready", reason=None, server=server, stats=None)
    with pytest.raises(InvalidInput) as refused:
        check_regenerate(sessions, options)
    assert refused.value.extra["errors"][0]["field"] == "regenerate"
    said = refused.value.extra["errors"][0]["message"]
    assert said.endswith("; live now: the worker on host reading /v (vLLM's hidden-states files)"), said

    seeded = JobOptions.model_validate({"regenerate": {"max_new_tokens": 4, "temperature": 0.7, "seed": 7}})
    with sessions.begin() as s:
        server = {"source": "dumps", "regenerates": True, "applies_seed": False}
        repo.renew_lease(s, "host:/v", epoch, lease_s=30, state="ready", reason=None, server=server, stats=None)
    with pytest.raises(InvalidInput) as refused:
        check_regenerate(sessions, seeded)
    error = refused.value.extra["errors"][0]
    assert error["field"] == "regenerate.seed" and "its CPU engine refuses that flag" in error["message"]
    assert "temperature 0" in error["message"] and "(SGLang dumps)" in error["message"]


VLLM_LLAMA = {**LLAMA, "final_layer": "pre_norm"}


def register(sessions, identity: str, server: dict) -> int:
    with sessions.begin() as s:
        epoch = repo.register_writer(s, identity, lease_s=30, started_at=repo.utcnow(), staged_exists=lambda _: True)
        repo.renew_lease(s, identity, epoch, lease_s=30, state="ready", reason=None, server=server, stats=None)
    return epoch


def waiting_reason(sessions, job_id: str) -> str | None:
    with sessions() as s:
        job = repo.get_job(s, job_id)
        assert job is not None
        return repo.waiting(s).reason(job)


def test_a_job_of_several_sets_is_claimed_only_by_a_worker_whose_capture_covers_their_union(sessions):
    """eagle3 and dflash on an 8-layer model: [2, 4, 5, 8] and [2, 3, 4, 5, 6, 8], captured once as their
    union [2, 3, 4, 5, 6, 8]. A worker giving eagle3's layers alone takes none of it, one giving the union
    takes it, and an eagle3 job too (it covers that set)."""
    both = job_with(sessions, 2, layers="eagle3+dflash")
    eagle3_only = Serves.of([2, 4, 5, 8], LLAMA)
    union = Serves.of([2, 3, 4, 5, 6, 8], LLAMA)
    assert eagle3_only.sets == ("eagle3", "last") and claim(sessions, "w-eagle3", eagle3_only) is None
    assert union.sets == ("eagle3", "dflash", "last")
    c = claim(sessions, "w-union", union)
    assert c is not None and c.job_id == both and c.job_layers_key == "eagle3+dflash"
    eagle3 = job_with(sessions, 1, layers="eagle3")
    c = claim(sessions, "w-eagle3", eagle3_only)
    assert c is not None and c.job_id == eagle3
    assert claim(sessions, "w-union-2", union).job_id == both


def test_layer_l_after_the_norm_comes_from_a_server_giving_it_before_only_where_hsx_applies_the_norm(sessions):
    """vLLM gives L before the final norm: an eagle3 job (L after it) runs there only on a worker that can
    apply the model's norm; eagle3_pre_norm runs on any of them, never on SGLang's post-norm L (a norm is
    not undone)."""
    post = job_with(sessions, 2, layers="eagle3")
    pre = job_with(sessions, 1, layers="eagle3_pre_norm")
    sglang = Serves.of([2, 4, 5, 8], LLAMA)
    no_norm = Serves.of([2, 4, 5, 8], VLLM_LLAMA)
    converts = Serves.of([2, 4, 5, 8], VLLM_LLAMA, converts=True)
    assert no_norm.sets == ("eagle3_pre_norm", "last_pre_norm")
    assert converts.sets == ("eagle3", "eagle3_pre_norm", "last", "last_pre_norm")
    assert "a norm cannot be undone" in (sglang.refusal("eagle3_pre_norm") or "")
    assert "cannot apply the model's final norm" in (no_norm.refusal("eagle3") or "")
    c = claim(sessions, "vllm-a", no_norm)
    assert c is not None and c.job_id == pre
    c = claim(sessions, "vllm-b", converts)
    assert c is not None and c.job_id == post
    assert claim(sessions, "sglang", sglang).job_id == post


def test_every_waiting_reason_about_layers_names_the_set_to_ask_for(sessions):
    """A default (eagle3) job with only vLLM workers whose checkpoint hsx cannot read: the reason says so
    and names both ways out; an eagle3_pre_norm job with only SGLang names eagle3; a dflash job on a server
    without its taps names what that server serves."""
    problem = "the model's checkpoint /models/llama is not a folder readable where this worker runs: make it so"
    base = {"model_path": "/models/llama", "num_hidden_layers": 8, "layers": [2, 4, 5, 8]}
    vllm = {**base, "model_key": model_key(VLLM_LLAMA), "final_layer": "pre_norm", "final_norm_problem": problem}
    vllm["layer_sets"] = list(Serves.of([2, 4, 5, 8], VLLM_LLAMA).sets)
    register(sessions, "host:/vllm", vllm)
    job = job_with(sessions, 1, layers="eagle3")
    reason = waiting_reason(sessions, job)
    assert reason is not None
    assert "the worker on host reading /vllm gives layers [2, 4, 5, 8] of /models/llama" in reason
    assert "before the final norm, and hsx cannot apply the model's final norm here" in reason
    assert problem in reason and reason.endswith("; or ask for eagle3_pre_norm")
    dflash = job_with(sessions, 1, layers="dflash")
    reason = waiting_reason(sessions, dflash)
    assert "it does not capture layers [3, 6]" in reason and reason.endswith("ask for eagle3_pre_norm or last_pre_norm")


def test_a_job_reading_l_before_the_norm_from_a_server_giving_it_after_names_the_set_to_ask_for(sessions):
    base = {"model_path": "/models/llama", "num_hidden_layers": 8, "layers": [2, 4, 5, 8]}
    sglang = {**base, "model_key": model_key(LLAMA), "final_layer": "post_norm"}
    sglang["layer_sets"] = list(Serves.of([2, 4, 5, 8], LLAMA).sets)
    register(sessions, "host:/sglang", sglang)
    pre = job_with(sessions, 1, layers="eagle3_pre_norm")
    reason = waiting_reason(sessions, pre)
    assert reason is not None and "a norm cannot be undone" in reason and reason.endswith("ask for eagle3")
    both = job_with(sessions, 1, layers="eagle3_pre_norm+dflash_pre_norm")
    assert waiting_reason(sessions, both).endswith("ask for eagle3 or last")


def test_a_job_whose_layers_fit_no_live_workers_model_is_refused_naming_the_sets(sessions):
    """With every live worker's model said, a set needing more layers than any of them has, or an id
    beyond their depth, is refused at creation; without workers, or with one that has not said, it waits."""
    check_layers_fit(sessions, "dflash")
    register(sessions, "host:/small", {"layers": [2, 3, 4, 6], "num_hidden_layers": 6})
    with pytest.raises(InvalidInput) as refused:
        check_layers_fit(sessions, "eagle3+dflash")
    message = refused.value.extra["errors"][0]["message"]
    assert "dflash needs at least 8 decoder layers, the model has 6" in message and "eagle3, eagle3_pre_norm" in message
    with pytest.raises(InvalidInput, match=r"layers \[9\] lie beyond the model's depth"):
        check_layers_fit(sessions, [2, 9])
    check_layers_fit(sessions, "eagle3")
    register(sessions, "host:/big", {"layers": [2, 3, 4, 5, 6, 8], "num_hidden_layers": 8})
    check_layers_fit(sessions, "eagle3+dflash")
    register(sessions, "host:/silent", {"layers": None})
    check_layers_fit(sessions, [2, 40])

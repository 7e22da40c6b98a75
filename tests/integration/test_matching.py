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
from hsx.service.jobs import check_regenerate
from hsx.wire import JobOptions

LLAMA = {"model_path": "/models/llama", "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64}
QWEN = {"model_path": "/models/qwen", "model_type": "qwen2", "num_hidden_layers": 8, "hidden_size": 64}


def job_with(sessions, n: int, layers: list[int] | None = None) -> str:
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
    assert "layers [2, 4]" in reason and "host:/a gives layers [6, 8] of /models/llama" in reason
    assert "host:/b gives layers [2, 4] of /models/qwen" in reason


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
    assert "host:/v runs vllm" in refused.value.extra["errors"][0]["message"]

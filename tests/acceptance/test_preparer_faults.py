"""Conversations that cannot be prepared, on SQLite and Postgres: each such sample fails or is skipped alone,
with its reason, and never holds the others; a template that raises, runs for hours or expands its output
past --prepare-max-mb costs one sample; a turn of megabytes is tokenized only as far as the length limit
needs; a cancelled job's render stops at once and a stopping service does not wait for one; and a preparer
the database keeps refusing shows in /healthz, the worker's /healthz and /metrics until it can go on.

The service runs in front of the reference server, whose model folder carries a tokenizer and chat template
(tests.support.chat); the hostile templates are folders of their own, named by the jobs' `tokenizer`."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from sqlalchemy import text

from hsx.db.engine import make_engine
from tests.support import chat
from tests.support.procs import Process, free_port, hsx_command
from tests.support.stack import VOCAB, make_checkpoint, start_reference, start_service

GOOD = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "answer one"}]
BOOM = [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]
SLOW = [{"role": "user", "content": "slow"}, {"role": "assistant", "content": "x"}]
GROW = [{"role": "user", "content": "grow"}, {"role": "assistant", "content": "x"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_checkpoint(tmp_path_factory.mktemp("preparer-model"))
    return chat.save_chat_tokenizer(folder, chat.LLAMA3, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-templates")
    return {
        name: str(chat.save_chat_tokenizer(root / name, template, vocab_size=VOCAB))
        for name, template in (
            ("boom", chat.RAISES_ON_BOOM),
            ("slow", chat.SLOW_ON_SLOW),
            ("grow", chat.EXPANDS_ON_GROW),
        )
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model):
    ref = start_reference(tmp_path_factory.mktemp("preparer-ref"), model)
    yield ref
    ref.stop()


def roots(hostile) -> list[str]:
    """The flag that lets jobs name the hostile templates' folders as their tokenizer."""
    return ["--tokenizer-roots", os.path.commonpath(list(hostile.values()))]


def samples(*conversations):
    return [{"id": f"s{i}", "messages": m} for i, m in enumerate(conversations)]


def by_id(svc, job_id):
    page = svc.get(f"/v1/jobs/{job_id}/samples", params={"limit": 1000}).json()["data"]
    return {s["id"]: s for s in page}


def wait_for(what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"{what} never held")


def test_batches_without_loss_masks_and_with_bad_samples_end_each_sample_alone(tmp_path, reference, database_url):
    svc = start_service(tmp_path, database_url, backend_url=reference.url, dump_root=reference.dump_root)
    try:
        # loss "all": no sample of the batch has a mask (one opening with its answer needs none either)
        body = {"loss": "all", "samples": samples(*[GOOD] * 10, GOOD[::-1])}
        job = svc.wait_job(svc.post_job(body).json()["id"], timeout=120)
        assert (job["state"], job["counts"]["succeeded"]) == ("succeeded", 11), job
        # the assistant's loss: the one opening with its answer fails, with the reason, the others go on
        job = svc.wait_job(svc.post_job({"samples": samples(*[GOOD] * 10, GOOD[::-1])}).json()["id"], timeout=120)
        assert (job["state"], job["counts"]["succeeded"], job["counts"]["failed"]) == ("partial", 10, 1), job
        assert by_id(svc, job["id"])["s10"]["last_error"].startswith("invalid: messages[0]")
        # a length policy that skips, and a conversation with no answer to learn from
        long = [{"role": "user", "content": "hello there " * 20}, GOOD[1]]
        body = {"max_length": 30, "length_policy": "skip", "samples": samples(long, [GOOD[0]])}
        job = svc.wait_job(svc.post_job(body).json()["id"], timeout=120)
        assert job["state"] == "failed" and job["counts"]["skipped"] == 2, job
        reasons = sorted(s["last_error"].split(":")[0] for s in by_id(svc, job["id"]).values())
        assert reasons == ["no_loss_tokens", "too_long"]
        # a job whose only sample failed says why in its error
        job = svc.wait_job(svc.post_job({"samples": samples(GOOD[::-1])}).json()["id"], timeout=120)
        assert job["state"] == "failed" and job["error"].startswith("nothing stored: 1 failed"), job
        assert "messages[0]" in job["error"]
    finally:
        svc.stop()


def test_a_template_that_raises_fails_only_its_sample(tmp_path, reference, hostile, database_url):
    svc = start_service(
        tmp_path, database_url, backend_url=reference.url, dump_root=reference.dump_root, extra=roots(hostile)
    )
    try:
        body = {"tokenizer": hostile["boom"], "samples": samples(GOOD, BOOM, GOOD)}
        job = svc.wait_job(svc.post_job(body).json()["id"], timeout=120)
        assert (job["state"], job["counts"]["succeeded"], job["counts"]["failed"]) == ("partial", 2, 1), job
        reason = by_id(svc, job["id"])["s1"]["last_error"]
        assert reason.startswith("invalid: messages: the chat template fails") and "ZeroDivisionError" in reason
        skipped = svc.wait_job(svc.post_job({**body, "on_invalid": "skip"}).json()["id"], timeout=120)
        assert (skipped["state"], skipped["counts"]["skipped"]) == ("succeeded", 1), skipped
    finally:
        svc.stop()


def test_a_render_that_runs_too_long_fails_alone(tmp_path, reference, hostile, database_url):
    svc = start_service(
        tmp_path,
        database_url,
        backend_url=reference.url,
        dump_root=reference.dump_root,
        extra=["--prepare-timeout-s", "10", *roots(hostile)],
    )
    try:
        body = {"tokenizer": hostile["slow"], "samples": samples(GOOD, SLOW, GOOD)}
        job = svc.wait_job(svc.post_job(body).json()["id"], timeout=120)
        assert (job["state"], job["counts"]["succeeded"], job["counts"]["failed"]) == ("partial", 2, 1), job
        assert by_id(svc, job["id"])["s1"]["last_error"] == "prepare_timeout: rendering took over 10 s"
    finally:
        svc.stop()


def test_a_render_past_the_memory_bound_fails_alone_and_a_long_turn_is_cut_before_it_is_tokenized(
    tmp_path, reference, hostile, database_url
):
    svc = start_service(
        tmp_path,
        database_url,
        backend_url=reference.url,
        dump_root=reference.dump_root,
        extra=["--prepare-max-mb", "640", *roots(hostile)],
    )
    try:
        # A 2 MB turn, some 350,000 tokens whole: the sample keeps 64 of them, and far fewer are tokenized.
        long = [{"role": "user", "content": "hello there " * 170_000}, GOOD[1]]
        body = {
            "tokenizer": hostile["grow"],
            "max_length": 64,
            "length_policy": "truncate",
            "loss": "all",
            "samples": samples(GROW, GOOD, long, GROW, GOOD),
        }
        job = svc.wait_job(svc.post_job(body).json()["id"], timeout=180)
        assert (job["state"], job["counts"]["succeeded"], job["counts"]["failed"]) == ("partial", 3, 2), job
        stored = by_id(svc, job["id"])
        for failed in ("s0", "s3"):
            assert stored[failed]["last_error"] == (
                "prepare_memory: rendering took more than the 640 MB the rendering process may hold (MemoryError); "
                "--prepare-max-mb sets that bound"
            )
        assert stored["s2"]["expected_tokens"] == 64 and 64 < stored["s2"]["truncated_from"] < 40_000, stored["s2"]
        # Refused for its length, it says its count is a floor: the rest of its text was never tokenized.
        job = svc.wait_job(svc.post_job({"max_length": 64, "samples": samples(long)}).json()["id"], timeout=120)
        reason = by_id(svc, job["id"])["s0"]["last_error"]
        assert reason.startswith("too_long: at least ") and reason.endswith(" tokens exceed max_length of 64"), reason
    finally:
        svc.stop()


def test_cancel_and_shutdown_stop_a_render_at_once(tmp_path, reference, hostile, database_url):
    svc = start_service(
        tmp_path, database_url, backend_url=reference.url, dump_root=reference.dump_root, extra=roots(hostile)
    )
    try:
        stuck = svc.post_job({"tokenizer": hostile["slow"], "samples": samples(SLOW)}).json()["id"]
        time.sleep(3)  # the render has started (the template loads in about a second)
        assert svc.client.post(f"{svc.url}/v1/jobs/{stuck}/cancel").status_code == 200
        assert svc.wait_job(stuck, timeout=30)["state"] == "cancelled"
        # The next conversation job is prepared now, not when the cancelled render would have ended
        # (--prepare-timeout's default, 60 s, bounds it otherwise).
        started = time.monotonic()
        job = svc.wait_job(svc.post_job({"samples": samples(GOOD)}).json()["id"], timeout=120)
        assert job["state"] == "succeeded" and time.monotonic() - started < 40, job

        svc.post_job({"tokenizer": hostile["slow"], "samples": samples(SLOW)})
        time.sleep(3)
        asked = time.monotonic()
        svc.proc.proc.send_signal(signal.SIGTERM)
        svc.proc.proc.wait(timeout=30)
        assert time.monotonic() - asked < 20
    finally:
        svc.stop()


def refuse_prepared_updates(database_url: str, *, over_tokens: int | None) -> None:
    """A database that refuses to move preparing samples on (those of more than `over_tokens` tokens; every
    one when None): the fault a real database gives only by accident."""
    when = f"NEW.num_tokens > {over_tokens}" if over_tokens is not None else "TRUE"
    engine = make_engine(database_url)
    with engine.begin() as conn:
        if conn.dialect.name == "sqlite":
            conn.execute(
                text(
                    "CREATE TRIGGER refuse_prepared BEFORE UPDATE OF state ON samples "
                    f"WHEN OLD.state = 'preparing' AND {when} BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
                )
            )
        else:
            conn.execute(
                text(
                    "CREATE FUNCTION refuse_prepared() RETURNS trigger AS $$ BEGIN "
                    "RAISE EXCEPTION 'refused by the test' USING ERRCODE = 'check_violation'; END $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER refuse_prepared BEFORE UPDATE OF state ON samples FOR EACH ROW "
                    f"WHEN (OLD.state = 'preparing' AND {when}) EXECUTE FUNCTION refuse_prepared()"
                )
            )
    engine.dispose()


def allow_prepared_updates(database_url: str) -> None:
    engine = make_engine(database_url)
    with engine.begin() as conn:
        conn.execute(text("DROP TRIGGER refuse_prepared" + ("" if conn.dialect.name == "sqlite" else " ON samples")))
        if conn.dialect.name != "sqlite":
            conn.execute(text("DROP FUNCTION refuse_prepared()"))
    engine.dispose()


def test_a_sample_the_database_refuses_fails_alone(tmp_path, reference, database_url):
    svc = start_service(tmp_path, database_url, backend_url=reference.url, dump_root=reference.dump_root)
    try:
        long = [{"role": "user", "content": "hello there " * 20}, GOOD[1]]
        refuse_prepared_updates(database_url, over_tokens=40)
        job = svc.wait_job(svc.post_job({"samples": samples(GOOD, long, GOOD)}).json()["id"], timeout=120)
        assert (job["state"], job["counts"]["succeeded"], job["counts"]["failed"]) == ("partial", 2, 1), job
        assert by_id(svc, job["id"])["s1"]["last_error"].startswith("store: the database refused the prepared sample")
    finally:
        svc.stop()


def test_a_preparer_that_cannot_go_on_is_not_ok_until_it_can(tmp_path, reference, database_url):
    api_port, metrics_port = free_port(), free_port()
    common = ["--database-url", database_url, "--output-root", str(tmp_path / "output")]
    api = Process([*hsx_command(), "serve", "--no-writer", "--port", str(api_port), *common], tmp_path / "api.log")
    worker = Process(
        [
            *hsx_command(),
            "worker",
            *common,
            "--backend-url",
            reference.url,
            "--dump-root",
            str(reference.dump_root),
            "--metrics-port",
            str(metrics_port),
        ],
        tmp_path / "worker.log",
    )
    api_url, worker_url = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{metrics_port}"
    try:
        api.wait_http(api_url + "/healthz")
        worker.wait_http(worker_url + "/healthz")
        refuse_prepared_updates(database_url, over_tokens=None)
        job_id = httpx.post(api_url + "/v1/jobs", json={"samples": samples(GOOD, GOOD)}).json()["id"]

        def failing_worker():
            health = httpx.get(api_url + "/healthz").json()
            return (
                health if any((w.get("preparer") or {}).get("state") == "failing" for w in health["writers"]) else None
            )

        health = wait_for(failing_worker, timeout=90)
        assert health["status"] == "degraded"
        reason = next(w["preparer"]["reason"] for w in health["writers"] if w["preparer"]["state"] == "failing")
        assert "refused by the test" in reason
        own = httpx.get(worker_url + "/healthz")
        assert own.status_code == 503 and own.json()["writer"]["preparer"]["state"] == "failing"
        assert 'state="failing"} 1' in httpx.get(worker_url + "/metrics").text
        assert httpx.get(f"{api_url}/v1/jobs/{job_id}").json()["counts"]["preparing"] == 2

        allow_prepared_updates(database_url)
        deadline = time.monotonic() + 120
        while httpx.get(f"{api_url}/v1/jobs/{job_id}").json()["state"] != "succeeded":
            assert time.monotonic() < deadline, "the job never went on"
            time.sleep(0.3)
        wait_for(lambda: httpx.get(worker_url + "/healthz").status_code == 200, timeout=30)
        wait_for(lambda: httpx.get(api_url + "/healthz").json()["status"] == "ok", timeout=30)
    finally:
        worker.stop()
        api.stop()

"""What one request may cost and what it may say, on each database: conversations of millions of
mistyped or too many turns are one error (JSON, NDJSON, JSONL and Parquet alike), a conversation holds
at most MAX_TURNS messages, option numbers are strict, sampling options go with `regenerate`, bodies are
UTF-8, list cursors are refused alike, and a delete with its files removes only a folder hsx made.
Memory itself is measured by `python -m benchmarks.bench_bodies`."""

from __future__ import annotations

import json
import os

import pytest

from hsx.service.intake import MAX_ERRORS
from hsx.wire import MAX_TURNS
from tests.support.api import problem, stored_rows
from tests.support.stack import start_service

OK = {"input_ids": [1, 2, 3]}
NDJSON = {"content-type": "application/x-ndjson"}


def turns(n: int) -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(n)]


@pytest.fixture(scope="module")
def service(api_only):
    """The module's API-only service (tests/acceptance/conftest.py), one per database."""
    return api_only


def post(service, body: dict | bytes, **kw):
    if isinstance(body, bytes):
        return service.client.post(service.url + "/v1/jobs", content=body, **kw)
    return service.post_job(body)


# The bodies that cost gigabytes when every element was an error of its own.
HUGE = {
    "2.7M mistyped messages": ({"id": "t", "messages": [1] * 2_700_000}, "messages.0"),
    "400k mistyped messages": ({"id": "t", "messages": [1] * 400_000}, "messages.0"),
    "400k mistyped conversations": ({"id": "t", "conversations": ["x"] * 400_000}, "conversations.0"),
    "100,000 turns": ({"id": "t", "messages": turns(100_000)}, "messages"),
}


@pytest.mark.parametrize("sample,field", HUGE.values(), ids=HUGE)
@pytest.mark.parametrize("how", ["json", "ndjson", "jsonl"])
def test_a_huge_conversation_is_one_error(service, unchanged, sample, field, how):
    if how == "json":
        resp = post(service, {"samples": [OK, sample]})
    elif how == "ndjson":
        resp = post(service, (json.dumps(OK) + "\n" + json.dumps(sample) + "\n").encode(), headers=NDJSON)
    else:
        (service.input_root / "huge.jsonl").write_text(json.dumps(OK) + "\n" + json.dumps(sample) + "\n")
        resp = post(service, {"input_path": "huge.jsonl"})
    errors = problem(resp, 422)["errors"]
    assert [(e["sample_index"], e["field"]) for e in errors] == [(1, field)], errors[:3]
    assert errors[0].get("line") == (None if how == "json" else 2)


def test_a_huge_parquet_row_is_one_error(service, unchanged):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = {
        "ids.parquet": ({"id": ["t"], "input_ids": [[1] * 10_000_000]}, "input_path"),
        "messages.parquet": ({"id": ["t"], "messages": [[1] * 2_700_000]}, "input_path"),
        "conversations.parquet": ({"id": ["t"], "conversations": [["x"] * 400_000]}, "conversations.0"),
        "turns.parquet": ({"id": ["t"], "messages": [turns(100_000)]}, "messages"),
    }
    for name, (columns, field) in rows.items():
        pq.write_table(pa.table(columns), service.input_root / name)
        errors = problem(post(service, {"input_path": name}), 422)["errors"]
        assert [(e["row"], e["field"]) for e in errors] == [(0, field)], (name, errors[:3])
        if field == "input_path":  # a row whose data is over --max-sample-bytes is refused unread
            assert "--max-sample-bytes" in errors[0]["message"], errors


def test_many_mistyped_conversations_are_a_bounded_list_of_errors(service, unchanged):
    body = {"samples": [{"messages": [1] * 10_000} for _ in range(3 * MAX_ERRORS)]}
    errors = problem(post(service, body), 422)["errors"]
    assert len(errors) == MAX_ERRORS and {e["field"] for e in errors} == {"messages.0"}


def test_a_conversation_holds_at_most_max_turns_messages(service):
    at_most = {"id": "at-most", "messages": turns(MAX_TURNS)}
    over = {"id": "over", "messages": turns(MAX_TURNS + 1)}
    before = stored_rows(service.database_url)
    errors = problem(post(service, {"samples": [at_most, over]}), 422)["errors"]
    assert [(e["sample_index"], e["field"]) for e in errors] == [(1, "messages")]
    assert f"at most {MAX_TURNS}" in errors[0]["message"]
    assert stored_rows(service.database_url) == before, "a refused request stores nothing"
    resp = post(service, {"samples": [at_most, over], "on_invalid": "skip"})
    assert resp.status_code == 202, resp.text
    job = resp.json()
    assert (job["counts"]["preparing"], job["counts"]["skipped"]) == (1, 1)
    skipped = service.get(f"/v1/jobs/{job['id']}/samples", params={"state": "skipped"}).json()["data"]
    assert [s["id"] for s in skipped] == ["invalid-1"]
    assert skipped[0]["last_error"].startswith("invalid: messages: holds more than 512 messages")


def test_the_schema_states_the_turns_limit(service):
    sample = service.get("/openapi.json").json()["components"]["schemas"]["SampleIn"]["properties"]
    for key in ("messages", "conversations"):
        listed = sample[key]["anyOf"][0]
        assert (listed["type"], listed["minItems"], listed["maxItems"]) == ("array", 1, MAX_TURNS)


@pytest.mark.parametrize("value", ["10", True, 2.5])
def test_max_length_is_a_strict_integer(service, unchanged, value):
    errors = problem(post(service, {"samples": [OK], "max_length": value}), 422)["errors"]
    assert errors[0]["field"].startswith("max_length"), errors


@pytest.mark.parametrize(
    "regenerate,field",
    [
        ({"max_new_tokens": "8"}, "regenerate.max_new_tokens"),
        ({"max_new_tokens": 8, "seed": True}, "regenerate.seed"),
        ({"max_new_tokens": 8, "temperature": "0.5"}, "regenerate.temperature"),
    ],
)
def test_regenerate_numbers_are_strict(service, unchanged, regenerate, field):
    body = {"samples": [{"messages": turns(2)}], "regenerate": regenerate}
    assert problem(post(service, body), 422)["errors"][0]["field"] == field


def test_integral_numbers_stay_integers(service):
    resp = post(service, {"samples": [OK], "max_length": 10.0, "length_policy": "truncate"})
    assert resp.status_code == 202, resp.text
    assert resp.json()["options"]["max_length"] == 10


@pytest.mark.parametrize("option", ["temperature=0.5", "top_p=0.9", "seed=3", "seed_ignored=warn", "concurrency=2"])
def test_sampling_options_without_regenerate_are_refused(service, unchanged, option):
    line = (json.dumps({"messages": turns(2)}) + "\n").encode()
    resp = service.client.post(f"{service.url}/v1/jobs?regenerate_{option}", content=line, headers=NDJSON)
    errors = problem(resp, 422)["errors"]
    assert errors[0]["field"] == f"query.regenerate_{option.split('=')[0]}"
    assert "regenerate_max_new_tokens" in errors[0]["message"]


def test_sampling_options_with_regenerate_are_taken(service):
    line = (json.dumps({"messages": turns(2)}) + "\n").encode()
    query = "regenerate_max_new_tokens=4&regenerate_temperature=0.5&regenerate_seed=3"
    resp = service.client.post(f"{service.url}/v1/jobs?{query}", content=line, headers=NDJSON)
    assert resp.status_code == 202, resp.text
    regenerate = resp.json()["options"]["regenerate"]
    assert (regenerate["max_new_tokens"], regenerate["temperature"], regenerate["seed"]) == (4, 0.5, 3)
    assert (regenerate["top_p"], regenerate["concurrency"], regenerate["seed_ignored"]) == (1.0, 8, "refuse")
    resp = service.client.post(
        f"{service.url}/v1/jobs?{query}&regenerate_seed_ignored=warn", content=line, headers=NDJSON
    )
    assert resp.status_code == 202 and resp.json()["options"]["regenerate"]["seed_ignored"] == "warn", resp.text


@pytest.mark.parametrize("media", ["application/json", "application/x-ndjson"])
@pytest.mark.parametrize("charset", ["utf-16", "latin-1", '"UTF-16LE"'])
def test_a_body_in_another_charset_is_415(service, unchanged, media, charset):
    text = json.dumps({"samples": [OK]}) if media == "application/json" else json.dumps(OK) + "\n"
    resp = post(service, text.encode("utf-16"), headers={"content-type": f"{media}; charset={charset}"})
    assert "UTF-8" in problem(resp, 415)["detail"]


@pytest.mark.parametrize("charset", ["utf-8", "UTF-8", '"utf-8"', "utf8"])
def test_a_utf8_body_that_says_so_is_read(service, charset):
    resp = post(
        service,
        json.dumps({"samples": [OK]}).encode(),
        headers={"content-type": f"application/json; charset={charset}"},
    )
    assert resp.status_code == 202, resp.text


def test_both_lists_refuse_a_cursor_they_never_hand_out(service):
    job = service.post_job({"samples": [OK, OK]}).json()
    for path in ("/v1/jobs", f"/v1/jobs/{job['id']}/samples"):
        for cursor in ("zzz", "job_zz", "nope"):
            assert problem(service.get(path, params={"after": cursor}), 422)["errors"][0]["field"] == "after"


def test_a_deleted_jobs_id_still_pages_on(service):
    first, second = (service.post_job({"samples": [OK]}).json() for _ in range(2))
    page = service.get("/v1/jobs", params={"limit": 1, "after": second["id"]}).json()
    assert page["data"][0]["id"] == first["id"]
    service.client.post(f"{service.url}/v1/jobs/{second['id']}/cancel")
    finished(service, second["id"])
    assert service.client.delete(f"{service.url}/v1/jobs/{second['id']}").status_code == 204
    page = service.get("/v1/jobs", params={"limit": 1, "after": second["id"]}).json()
    assert page["data"][0]["id"] == first["id"], "the deleted job's place in the order is kept"
    assert service.get("/v1/jobs", params={"after": "job_00000000000000000000"}).json()["data"] == []


def finished(service, job_id: str) -> dict:
    """A cancelled job, once the API alone has ended it (its manifest written)."""
    return service.wait_job(job_id, timeout=30)


def cancelled_job(service) -> dict:
    job = service.post_job({"samples": [OK]}).json()
    service.client.post(f"{service.url}/v1/jobs/{job['id']}/cancel")
    return finished(service, job["id"])


def test_deleting_a_job_with_its_files_refuses_foreign_files_and_keeps_the_records(service):
    job = cancelled_job(service)
    folder = service.output_root / job["id"]
    (folder / "notes.txt").write_text("mine")
    resp = service.client.delete(f"{service.url}/v1/jobs/{job['id']}", params={"delete_files": "true"})
    refused = problem(resp, 409)
    assert (refused["type"], refused["foreign_files"]) == ("/problems/foreign-files", ["notes.txt"])
    assert service.get(f"/v1/jobs/{job['id']}").status_code == 200, "the records stay too"
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "notes.txt"], "nothing removed"
    (folder / "notes.txt").unlink()
    assert (
        service.client.delete(f"{service.url}/v1/jobs/{job['id']}", params={"delete_files": "true"}).status_code == 204
    )
    assert not folder.exists() and service.get(f"/v1/jobs/{job['id']}").status_code == 404


def test_a_job_folder_that_is_a_symbolic_link_is_refused_and_left(service, tmp_path):
    job = cancelled_job(service)
    folder = service.output_root / job["id"]
    elsewhere = tmp_path / "elsewhere"
    os.rename(folder, elsewhere)
    folder.symlink_to(elsewhere)
    resp = service.client.delete(f"{service.url}/v1/jobs/{job['id']}", params={"delete_files": "true"})
    refused = problem(resp, 409)
    assert refused["foreign_files"] == [job["id"]] and "symbolic link" in refused["detail"]
    assert folder.is_symlink() and (elsewhere / "manifest.json").is_file(), "neither the link nor its target touched"
    assert service.get(f"/v1/jobs/{job['id']}").status_code == 200, "the records stay too"


@pytest.fixture
def rooted(tmp_path, database_url):
    """An API-only service whose jobs may name tokenizers under one root, which does not exist (the API
    never looks)."""
    root = tmp_path / "tokenizers"
    svc = start_service(tmp_path, database_url, extra=["--no-writer", "--tokenizer-roots", f"{root},/srv/other"])
    yield svc, root
    svc.stop()


CONVERSATION = {"messages": turns(2)}


@pytest.mark.parametrize(
    "tokenizer",
    ["/etc", "/proc/self/cwd", "../../../../etc", "/root", "tokenizers/llama", "/srv/other/../../etc", "/srv/otherx"],
)
def test_a_tokenizer_outside_the_roots_is_refused_at_creation(rooted, tokenizer):
    svc, root = rooted
    before = stored_rows(svc)
    for tried in (tokenizer, f"{root}/../../{tokenizer.lstrip('./')}"):
        errors = problem(post(svc, {"samples": [CONVERSATION], "tokenizer": tried}), 422)["errors"]
        assert [e["field"] for e in errors] == ["tokenizer"], errors
        assert f"--tokenizer-roots: {root}, /srv/other" in errors[0]["message"]
        line = (json.dumps(CONVERSATION) + "\n").encode()
        resp = svc.client.post(svc.url + "/v1/jobs", params={"tokenizer": tried}, content=line, headers=NDJSON)
        assert problem(resp, 422)["errors"][0]["field"] == "tokenizer"
    assert stored_rows(svc) == before


def test_a_refusal_says_nothing_of_what_exists(rooted, tmp_path):
    svc, _ = rooted
    (tmp_path / "there").mkdir()
    said = {
        path: problem(post(svc, {"samples": [CONVERSATION], "tokenizer": path}), 422)["errors"][0]["message"]
        for path in (str(tmp_path / "there"), str(tmp_path / "not-there"), "/etc", "/no/such/folder")
    }
    assert len(set(said.values())) == 1, said


@pytest.mark.parametrize("tokenizer", ["/srv/other/llama\x00", "/srv/other/\x00/etc"])
def test_a_tokenizer_holding_a_nul_is_refused(rooted, tokenizer):
    svc, _ = rooted
    errors = problem(post(svc, {"samples": [CONVERSATION], "tokenizer": tokenizer}), 422)["errors"]
    assert errors[0]["field"] == "tokenizer" and "NUL" in errors[0]["message"]


def test_a_tokenizer_under_a_root_is_taken_whether_or_not_it_exists_here(rooted):
    svc, root = rooted
    for tokenizer in (f"{root}/llama", f"{root}/./a/../b/", "/srv/other", "/srv/other/qwen"):
        resp = post(svc, {"samples": [CONVERSATION], "tokenizer": tokenizer})
        assert resp.status_code == 202, (tokenizer, resp.text)
        assert resp.json()["options"]["tokenizer"] == tokenizer
    line = (json.dumps(CONVERSATION) + "\n").encode()
    resp = svc.client.post(svc.url + "/v1/jobs", params={"tokenizer": f"{root}/x"}, content=line, headers=NDJSON)
    assert resp.status_code == 202, resp.text


def test_without_roots_only_the_model_path_is_allowed(service, unchanged):
    errors = problem(post(service, {"samples": [CONVERSATION], "tokenizer": "/models/llama"}), 422)["errors"]
    assert "this service names none (--tokenizer-roots)" in errors[0]["message"]

"""A job's sample policies through the HTTP API in this process (no writer): max_length with truncate,
skip or reject; invalid samples rejected or skipped; conversations accepted for preparation; Parquet
input files; a job whose every sample is skipped ends at once, failed, saying why."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from hsx.api.app import create_app
from hsx.config import Settings
from hsx.manifest import MANIFEST_NAME
from tests.support.api import api_only_settings, problem, stored_rows

NDJSON = {"Content-Type": "application/x-ndjson"}
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> Settings:
    return api_only_settings(tmp_path_factory.mktemp("policies"))


@pytest.fixture(scope="module")
def api(settings):
    with TestClient(create_app(settings)) as client:
        yield client


def created(resp) -> dict:
    assert resp.status_code == 202, resp.text
    return resp.json()


def samples_of(api: TestClient, job_id: str) -> dict[str, dict]:
    page = api.get(f"/v1/jobs/{job_id}/samples", params={"limit": 1000}).json()
    return {s["id"]: s for s in page["data"]}


def test_max_length_truncates_keeping_the_first_tokens_and_their_mask(api):
    body = {
        "max_length": 3,
        "length_policy": "truncate",
        "samples": [
            {"id": "long", "input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 1, 0, 1, 1]},
            {"id": "short", "input_ids": [9]},
        ],
    }
    job = created(api.post("/v1/jobs", json=body))
    assert job["counts"]["queued"] == 2 and job["tokens"]["total"] == 4
    assert job["options"]["max_length"] == 3 and job["options"]["length_policy"] == "truncate"
    sample = api.get(f"/v1/jobs/{job['id']}/samples/long").json()
    assert sample["expected_tokens"] == 3


def test_truncate_turns_cuts_token_ids_after_their_last_whole_answer(api):
    body = {
        "max_length": 7,
        "length_policy": "truncate_turns",
        "samples": [
            {"id": "turns", "input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9], "loss_mask": [0, 1, 1, 0, 0, 1, 1, 1, 0]},
            {"id": "unmasked", "input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9]},
            {"id": "none-fits", "input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9], "loss_mask": [0, 0, 0, 0, 0, 1, 1, 1, 1]},
        ],
    }
    job = created(api.post("/v1/jobs", json=body))
    assert (job["counts"]["queued"], job["counts"]["skipped"], job["counts"]["truncated"]) == (2, 1, 2)
    samples = samples_of(api, job["id"])
    assert (samples["turns"]["expected_tokens"], samples["turns"]["truncated_from"]) == (3, 9)
    assert samples["unmasked"]["expected_tokens"] == 7, "no turns in its mask: cut at max_length"
    assert samples["none-fits"]["last_error"].startswith("no_loss_tokens: cut from 9 to 0 tokens (at most 7)")


def test_a_cut_sample_says_so_and_one_left_without_loss_tokens_is_skipped(api):
    body = {
        "max_length": 3,
        "length_policy": "truncate",
        "samples": [
            {"id": "cut", "input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 1, 0, 1, 1]},
            {"id": "whole", "input_ids": [9, 8]},
            {"id": "no-loss", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 0, 1]},
        ],
    }
    job = created(api.post("/v1/jobs", json=body))
    assert (job["counts"]["queued"], job["counts"]["skipped"], job["counts"]["truncated"]) == (2, 1, 1)
    samples = samples_of(api, job["id"])
    assert (samples["cut"]["truncated_from"], samples["cut"]["expected_tokens"]) == (5, 3)
    assert samples["whole"]["truncated_from"] is None
    assert samples["no-loss"]["state"] == "skipped"
    assert (
        samples["no-loss"]["last_error"]
        == "no_loss_tokens: cut from 4 to 3 tokens (at most 3), no token of the loss mask is left"
    )


def test_max_length_skip_counts_the_sample_skipped_with_its_reason(api):
    body = {
        "max_length": 2,
        "length_policy": "skip",
        "samples": [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "b", "input_ids": [1]}],
    }
    job = created(api.post("/v1/jobs", json=body))
    assert (job["counts"]["total"], job["counts"]["queued"], job["counts"]["skipped"]) == (2, 1, 1)
    assert job["tokens"]["total"] == 1
    skipped = samples_of(api, job["id"])["a"]
    assert skipped["state"] == "skipped"
    assert skipped["last_error"] == "too_long: 3 tokens exceed max_length of 2"
    only = api.get(f"/v1/jobs/{job['id']}/samples", params={"state": "skipped"}).json()["data"]
    assert [s["id"] for s in only] == ["a"]


def test_max_length_reject_refuses_the_request_and_stores_nothing(api, settings):
    before = stored_rows(settings.database_url)
    body = {"max_length": 2, "on_invalid": "skip", "samples": [{"id": "a", "input_ids": [1, 2, 3]}]}
    errors = problem(api.post("/v1/jobs", json=body), 422)["errors"]
    assert errors[0]["sample_id"] == "a" and "3 tokens exceed max_length of 2" in errors[0]["message"]
    assert stored_rows(settings.database_url) == before


def test_invalid_lines_are_skipped_with_their_reasons_when_the_job_says_so(api):
    lines = [
        json.dumps({"id": "good", "input_ids": [1, 2]}),
        "{not json",
        json.dumps({"id": "bad-mask", "input_ids": [1, 2], "loss_mask": [1]}),
        json.dumps({"id": "good", "input_ids": [3]}),  # a duplicate id
        json.dumps({"id": "chat", "messages": [{"role": "robot", "content": "x"}]}),
    ]
    body = ("\n".join(lines) + "\n").encode()
    job = created(api.post("/v1/jobs", params={"on_invalid": "skip"}, content=body, headers=NDJSON))
    assert (job["counts"]["total"], job["counts"]["queued"], job["counts"]["skipped"]) == (5, 1, 4)
    samples = samples_of(api, job["id"])
    assert samples["good"]["state"] == "queued"
    assert samples["bad-mask"]["last_error"] == "invalid: loss_mask: has 1 values, input_ids has 2"
    assert samples["invalid-1"]["last_error"].startswith("invalid: ")
    assert samples["invalid-3"]["last_error"] == "invalid: id: duplicate sample id 'good'"
    assert samples["chat"]["last_error"].startswith("invalid: ") and "robot" in samples["chat"]["last_error"]
    # the same body without the option: refused whole
    problem(api.post("/v1/jobs", content=body, headers=NDJSON), 422)


def test_a_job_whose_every_sample_is_skipped_ends_failed_at_once_with_its_manifest(api, settings):
    body = {"max_length": 1, "length_policy": "skip", "samples": [{"id": "a", "input_ids": [1, 2]}]}
    job = created(api.post("/v1/jobs", json=body))
    assert job["state"] == "failed" and job["finished_at"] is not None
    assert job["error"] == "no sample to extract: all 1 were skipped (see each sample's reason)"
    assert (settings.output_root / job["id"] / MANIFEST_NAME).is_file()


def test_conversations_wait_to_be_prepared_and_regeneration_takes_only_conversations(api):
    body = {
        "samples": [
            {"id": "c1", "messages": CHAT, "source": "ignored"},
            {"id": "c2", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
            {"id": "t", "input_ids": [1, 2]},
        ]
    }
    job = created(api.post("/v1/jobs", json=body))
    assert (job["counts"]["preparing"], job["counts"]["queued"], job["tokens"]["total"]) == (2, 1, 2)
    assert job["estimated_bytes"] is None  # a conversation's length is known once rendered
    c2 = api.get(f"/v1/jobs/{job['id']}/samples/c2").json()
    assert c2["state"] == "preparing" and c2["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    body = {"regenerate": {"max_new_tokens": 8}, "samples": [{"input_ids": [1]}]}
    errors = problem(api.post("/v1/jobs", json=body), 422)["errors"]
    assert "takes conversations" in errors[0]["message"]
    both = {"samples": [{"input_ids": [1], "messages": CHAT}]}
    assert "exactly one of" in problem(api.post("/v1/jobs", json=both), 422)["errors"][0]["message"]


def test_bad_options_are_refused_with_the_field_named(api, settings):
    before = stored_rows(settings.database_url)
    for body, field in (
        ({"max_length": 0, "samples": [{"input_ids": [1]}]}, "max_length"),
        ({"length_policy": "cut", "samples": [{"input_ids": [1]}]}, "length_policy"),
        ({"regenerate": {"max_new_tokens": 0}, "samples": [{"messages": CHAT}]}, "regenerate.max_new_tokens"),
    ):
        errors = problem(api.post("/v1/jobs", json=body), 422)["errors"]
        assert errors[0]["field"] == field, errors
    problem(api.post("/v1/jobs", params={"loss": "nope"}, content=b'{"input_ids":[1]}\n', headers=NDJSON), 422)
    assert stored_rows(settings.database_url) == before


def test_a_parquet_file_under_the_input_root_is_read_row_by_row(api, settings):
    table = pa.table(
        {
            "id": ["p0", "p1", "p2"],
            "input_ids": [[1, 2, 3], [4], None],
            "loss_mask": [[0, 1, 1], None, None],
            "messages": [None, None, CHAT],
        }
    )
    pq.write_table(table, settings.input_root / "data.parquet", row_group_size=2)
    job = created(
        api.post("/v1/jobs", json={"input_path": "data.parquet", "max_length": 2, "length_policy": "truncate"})
    )
    assert (job["counts"]["total"], job["counts"]["queued"], job["counts"]["preparing"]) == (3, 2, 1)
    assert job["tokens"]["total"] == 3
    (settings.input_root / "broken.parquet").write_bytes(b"PAR1 not really")
    errors = problem(api.post("/v1/jobs", json={"input_path": "broken.parquet"}), 422)["errors"]
    assert errors[0]["field"] == "input_path" and "not a Parquet file" in errors[0]["message"]
    pq.write_table(pa.table({"id": ["x"], "input_ids": [[1, np.int64(10**12)]]}), settings.input_root / "big.parquet")
    errors = problem(api.post("/v1/jobs", json={"input_path": "big.parquet"}), 422)["errors"]
    assert errors[0]["row"] == 0 and errors[0]["field"] == "input_ids.1"

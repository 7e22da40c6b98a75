"""`hsx submit`'s sampling flags go with --regenerate: given without it they are a usage error (exit 2)
before anything is sent, never dropped without a word."""

from __future__ import annotations

import argparse

import pytest

from hsx.cli import main
from hsx.cli.client import submit
from hsx.wire import JobOptions

# Nothing listens here: a request would be a connection error (exit 1), not the usage error expected.
NOWHERE = "http://127.0.0.1:9"


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--temperature", "0.7"], "--temperature"),
        (["--top-p", "0.9"], "--top-p"),
        (["--seed", "3", "--temperature", "0"], "--temperature, --seed"),
        (["--seed-ignored", "warn"], "--seed-ignored"),
    ],
)
def test_sampling_flags_without_regenerate_are_a_usage_error(tmp_path, capsys, flags, named):
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert main(["submit", str(data), "--url", NOWHERE, *flags]) == 2
    assert capsys.readouterr().err == f"hsx submit: {named}: only with --regenerate N\n"


def test_sampling_flags_with_regenerate_are_sent_and_the_rest_are_the_apis_defaults():
    parser = argparse.ArgumentParser()
    submit.add_arguments(parser)
    args = parser.parse_args(["x.jsonl", "--regenerate", "16", "--seed", "3"])
    checked = JobOptions.model_validate(submit.job_options(args))
    assert checked.regenerate is not None
    assert (checked.regenerate.max_new_tokens, checked.regenerate.seed) == (16, 3)
    assert (checked.regenerate.temperature, checked.regenerate.top_p) == (0.0, 1.0)
    assert checked.regenerate.seed_ignored == "refuse"
    args = parser.parse_args(
        ["x.jsonl", "--regenerate", "16", "--seed", "3", "--temperature", "1", "--seed-ignored", "warn"]
    )
    assert JobOptions.model_validate(submit.job_options(args)).regenerate.seed_ignored == "warn"

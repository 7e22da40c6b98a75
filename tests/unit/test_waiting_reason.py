"""Why a job waits, as the API's waiting_reason and the dashboard's "Waiting: ..." show it: each
fitting writer that is not ready, said once."""

from __future__ import annotations

from types import SimpleNamespace

from hsx.matching import NO_WRITER, Waiting, describe_writer

JOB = SimpleNamespace(layers_key=None, model_key=None, model_info=None, n_preparing=0, options=None)


def writer(identity: str, state: str, reason: str | None) -> SimpleNamespace:
    return SimpleNamespace(identity=identity, state=state, reason=reason, server=None)


def test_a_waiting_writer_is_not_said_to_be_waiting_twice():
    reason = Waiting([writer("host:/dumps", "waiting", "model server not ready: GET /health: ConnectError")]).reason(
        JOB
    )
    assert reason == "the worker on host reading /dumps: model server not ready: GET /health: ConnectError"
    assert f"Waiting: {reason}".lower().count("waiting") == 1


def test_other_states_are_said_with_their_reason():
    writers = [
        writer("a:/d", "refusing", "the server returns only the last row"),
        writer("b:/d", "starting", None),
        writer("c:/d", "waiting", None),
    ]
    assert (
        Waiting(writers).reason(JOB) == "the worker on a reading /d: refusing: the server returns only the last row; "
        "the worker on b reading /d: starting; the worker on c reading /d: waiting"
    )
    assert Waiting([writer("a:/d", "ready", None), *writers]).reason(JOB) is None
    assert Waiting([]).reason(JOB) == NO_WRITER


def test_writers_are_named_in_words_with_what_they_read():
    """host:/dump root stays the identity machines read; a message names the worker, its host, its dump root
    and the engine it reads from."""
    vllm = SimpleNamespace(identity="vm:/data/dumps1", state="refusing", reason="no hsx-vllm.json", server=None)
    assert Waiting([vllm]).reason(JOB) == "the worker on vm reading /data/dumps1: refusing: no hsx-vllm.json"
    dumps = SimpleNamespace(identity="vm:/data/dumps1", state="ready", reason=None, server={"source": "dumps"})
    assert describe_writer(dumps) == "the worker on vm reading /data/dumps1 (SGLang dumps)"
    assert describe_writer(SimpleNamespace(identity="odd", server={"source": "elsewhere"})) == "the worker odd"

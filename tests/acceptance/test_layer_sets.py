"""A ready writer whose server gives other layers than the default set, for real: the reference server dumping
layer L alone (`--layers 8`, the `last` set) beside `hsx serve`, on SQLite and Postgres. /healthz stays ok and
lists the writer's layer sets, says it serves no default job, and warns with the set to ask for; a default job
waits, one asking for `last` is stored."""

from __future__ import annotations

import time

from tests.support.samples import make_samples
from tests.support.stack import start_reference, start_service


def test_a_writer_of_other_layers_than_the_default_is_ready_and_healthz_says_what_to_ask_for(
    tmp_path, database_url, checkpoint
):
    ref = start_reference(tmp_path, checkpoint, extra=["--layers", "8"])
    svc = start_service(tmp_path, database_url, backend_url=ref.url, dump_root=ref.dump_root)
    try:
        deadline = time.monotonic() + 60
        while not (health := svc.get("/healthz").json())["writers"] or health["writers"][0]["state"] != "ready":
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
        assert health["status"] == "ok" and health["writer"]["server"]["layer_sets"] == ["last"]
        (writer,) = health["writers"]
        assert (writer["layer_sets"], writer["serves_default"]) == (["last"], False)
        (warning,) = health["warnings"]
        assert "default layers eagle3" in warning and "hsx submit --layers last" in warning, warning
        (worker,) = svc.get("/v1/workers").json()["data"]
        assert (worker["layer_sets"], worker["serves_default"]) == (["last"], False)

        default = svc.post_job({"samples": make_samples(1, seed=3)}).json()
        last = svc.wait_job(svc.post_job({"samples": make_samples(2, seed=4), "layers": "last"}).json()["id"])
        assert last["state"] == "succeeded"
        waiting = svc.get(f"/v1/jobs/{default['id']}").json()
        assert waiting["state"] == "queued" and "no live worker serves this job" in waiting["waiting_reason"]
        assert "(SGLang dumps) gives layers [8]" in waiting["waiting_reason"], waiting["waiting_reason"]
    finally:
        svc.stop()
        ref.stop()

"""Layer L from the answers of a real SGLang 0.5.23 (--enable-return-hidden-states, no plugin), in
each dtype a server runs: a float32 checkpoint served in float32 (exact), the same checkpoint under
--dtype auto (SGLang runs it in float16: the shards must say so and hold it), and a bfloat16
checkpoint under --dtype auto. One server per case, the module's fixture parametrized."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.real_sglang import SGLang, run_and_check, sglang_python
from tests.support.stack import start_service
from tests.support.tiny_llama import NUM_LAYERS, make_model

pytestmark = pytest.mark.slow  # a real SGLang per case: 30-95 s to start

# (checkpoint dtype, --dtype, what SGLang runs, the largest difference from a float32 recomputation
# of the checkpoint's own weights: 0 where the arithmetic is transformers' own, else its rounding)
CASES = {
    "float32": ("float32", "float32", "float32", 1e-5),
    "float32-auto": ("float32", "auto", "float16", 0.05),
    "bfloat16-auto": ("bfloat16", "auto", "bfloat16", 0.1),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SGLang, torch.nn.Module, str, float]]:
    saved, served, runs, bound = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    m = make_model(tmp / "model", saved)
    flags = ["--enable-return-hidden-states"]
    s = SGLang(sglang_python(), tmp, tmp / "model", flags, dtype=served).start()
    yield s, m, runs, bound
    s.stop()


def test_layer_l_from_the_answers_in_the_dtype_the_server_runs(tmp_path, case):
    server, m, runs, bound = case
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=server.url, dump_root=tmp_path / "d")
    try:
        _, worst = run_and_check(svc, m, [NUM_LAYERS], n=12, seed=2, dtype=runs)
        print(f"{runs}: max abs difference {worst:.3g}")
        assert worst <= bound, worst
        assert svc.get("/healthz").json()["writer"]["server"]["identity"] == "response"
    finally:
        svc.stop()

"""The SGLang container of deploy/k8s against the SGLang release the plugin supports, read from its wheel:
every flag of its launch command is one `python -m sglang.launch_server` of 0.5.23 accepts, and it has
the flags deploy/sglang/README.md says the plugin needs."""

from __future__ import annotations

from pathlib import Path

from tests.support.deploy import DEPLOY, yaml_documents
from tests.support.sglang import release_check

NEEDED = {
    "--enable-return-aux-hidden-states": None,
    "--speculative-algorithm": "EAGLE3",
    "--chunked-prefill-size": "-1",
    "--disable-prefill-cuda-graph": None,
}


def test_the_kubernetes_sglang_container_launches_with_flags_of_the_supported_release(supported_wheel: Path) -> None:
    (pod,) = [d for d in yaml_documents(DEPLOY / "k8s" / "sglang-worker.yaml") if d["kind"] == "Deployment"]
    (sglang,) = [c for c in pod["spec"]["template"]["spec"]["containers"] if c["name"] == "sglang"]
    args = sglang["args"]
    flags = {a for a in args if a.startswith("--")}
    assert flags - release_check.cli_flags_of(supported_wheel) == set()
    for flag, value in NEEDED.items():
        assert flag in flags, flag
        if value is not None:
            assert args[args.index(flag) + 1] == value, flag
    assert set(NEEDED) <= set(release_check.readme_launch_flags())

"""The deployment files (deploy/compose.yaml, deploy/k8s, deploy/systemd, the Dockerfiles): valid by
check-jsonschema (the Compose Specification), kubernetes-validate (Kubernetes 1.32, strict) and
`systemd-analyze verify`, wired as hsx needs (the worker
and its model server share the dump root, the API and the workers the output root and the database),
and every hsx command line and HSX_* variable in them is one hsx takes."""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.deploy import (
    DEPLOY,
    compose_errors,
    env_file,
    kubernetes_errors,
    process_problems,
    unit_entries,
    yaml_documents,
)

COMPOSE = DEPLOY / "compose.yaml"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
# Each Dockerfile and the folder it is built from (its header says so).
DOCKERFILES = {DEPLOY / "Dockerfile": DEPLOY.parent, DEPLOY / "sglang" / "Dockerfile": DEPLOY / "sglang"}


def compose() -> dict[str, Any]:
    return yaml_documents(COMPOSE)[0]


def k8s_objects() -> list[dict[str, Any]]:
    return [doc for path in K8S for doc in yaml_documents(path)]


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    return next(o for o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name)


def env_value(container: dict[str, Any], name: str) -> Any:
    entry = next(e for e in container.get("env", []) if e["name"] == name)
    return entry.get("value", entry.get("valueFrom"))


def mount_of(path: str, mounts: list[tuple[str, str]]) -> str:
    """The volume whose mount point holds `path` (the longest match)."""
    held = [(t, volume) for volume, t in mounts if path == t or path.startswith(t.rstrip("/") + "/")]
    assert held, f"{path} is on no mounted volume"
    return max(held)[1]


# ---------------------------------------------------------------------------------------------------
# schemas


def test_the_compose_file_is_valid_by_the_compose_specification() -> None:
    spec = compose()
    assert spec["services"]
    assert compose_errors(spec) == []


def test_the_compose_check_catches_a_misspelt_key() -> None:
    broken = copy.deepcopy(compose())
    broken["services"]["worker"]["enviroment"] = broken["services"]["worker"].pop("environment")
    assert any("enviroment" in e for e in compose_errors(broken))


@pytest.mark.parametrize("path", K8S, ids=lambda p: p.name)
def test_every_kubernetes_object_is_valid_by_the_api_schema(path: Path) -> None:
    objects = yaml_documents(path)
    assert objects
    for obj in objects:
        assert kubernetes_errors(obj) == [], f"{obj['kind']} {obj['metadata']['name']}"


def test_the_kubernetes_check_catches_a_misspelt_field_and_a_wrong_type() -> None:
    # Separate copies: the check reports one error per object.
    misspelt = copy.deepcopy(k8s_object("Deployment", "hsx-sglang"))
    worker = misspelt["spec"]["template"]["spec"]["containers"][1]
    worker["volumeMount"] = worker.pop("volumeMounts")
    errors = kubernetes_errors(misspelt)
    assert len(errors) == 1 and "volumeMount" in errors[0], errors
    wrong_type = copy.deepcopy(k8s_object("Deployment", "hsx-sglang"))
    wrong_type["spec"]["replicas"] = "two"
    errors = kubernetes_errors(wrong_type)
    assert len(errors) == 1 and errors[0].startswith("spec/replicas"), errors
    unknown = {"apiVersion": "hsx.example/v1", "kind": "Nothing", "metadata": {"name": "x"}}
    assert kubernetes_errors(unknown), "an object without a schema must not pass unchecked"


# ---------------------------------------------------------------------------------------------------
# every process: command line and variables


ProcessFound = tuple[str, list[str], set[str]]  # where, argv, names of the environment variables it gets


def processes() -> list[ProcessFound]:
    """Every process the files start."""
    return [*compose_processes(), *k8s_processes(), *unit_processes(), *dockerfile_processes()]


def compose_processes() -> list[ProcessFound]:
    return [
        (f"compose {name}", svc["command"], set(svc.get("environment") or {}))
        for name, svc in compose()["services"].items()
        if "command" in svc
    ]


def k8s_processes() -> list[ProcessFound]:
    return [
        (f"k8s {c['name']}", c["command"] + c.get("args", []), {e["name"] for e in c["env"]})
        for obj in k8s_objects()
        if obj["kind"] == "Deployment"
        for c in obj["spec"]["template"]["spec"]["containers"]
    ]


def unit_processes() -> list[ProcessFound]:
    found = []
    for unit in UNITS:
        entries = unit_entries(unit)
        env: set[str] = set()
        for file in [v for _, k, v in entries if k == "EnvironmentFile"]:
            env |= set(env_file(example_of(file)))
        found.append((unit.name, shlex.split(next(v for _, k, v in entries if k == "ExecStart")), env))
    return found


def dockerfile_processes() -> list[ProcessFound]:
    return [
        (str(dockerfile.relative_to(DEPLOY)), json.loads(line[4:]), set())
        for dockerfile in DOCKERFILES
        for line in dockerfile.read_text(encoding="utf-8").splitlines()
        if line.startswith("CMD ")
    ]


def example_of(environment_file: str) -> Path:
    """/etc/hsx/NAME's example in deploy/systemd (an instance's: worker-0.env for worker-%i.env)."""
    assert environment_file.startswith("/etc/hsx/"), environment_file
    return DEPLOY / "systemd" / (Path(environment_file.replace("%i", "0")).name + ".example")


def test_every_hsx_command_line_parses_and_every_variable_is_a_setting_it_takes() -> None:
    found = processes()
    commands = {(Path(argv[0]).name, argv[1]) for _, argv, _ in found}
    assert {("hsx", "serve"), ("hsx", "worker"), ("hsx", "reference-server"), ("python3", "-m")} <= commands
    problems = [p for where, argv, env in found for p in process_problems(where, argv, env)]
    assert problems == []


def test_the_process_check_catches_a_bad_flag_and_a_foreign_variable() -> None:
    assert process_problems("x", ["hsx", "worker", "--port", "8000"], set())  # an API flag
    assert process_problems("x", ["hsx", "worker"], {"HSX_PORT"}) == ["x: hsx worker takes no setting HSX_PORT"]
    assert process_problems("x", ["hsx", "serve"], {"HSX_DATABSE_URL"})
    assert process_problems("x", ["python3", "-m", "sglang.launch_server"], {"HSX_DATABASE_URL"})
    assert process_problems("x", ["hsx", "serve", "--no-writer"], {"HSX_DATABASE_URL", "HSX_API_TOKENS"}) == []


# ---------------------------------------------------------------------------------------------------
# compose: what is shared


def compose_mounts(svc: dict[str, Any]) -> list[tuple[str, str]]:
    return [tuple(v.split(":")[:2]) for v in svc.get("volumes", [])]  # type: ignore[misc]


def test_compose_shares_the_dump_root_with_the_model_server_and_the_output_root_with_the_api() -> None:
    spec = compose()
    api, worker, server = (spec["services"][n] for n in ("api", "worker", "model-server"))
    dump_root = worker["environment"]["HSX_DUMP_ROOT"]
    server_dump_root = server["command"][server["command"].index("--dump-root") + 1]
    assert server_dump_root == dump_root
    dumps = mount_of(dump_root, compose_mounts(worker))
    assert dumps == mount_of(server_dump_root, compose_mounts(server))
    assert spec["volumes"][dumps]["driver_opts"]["type"] == "tmpfs"
    output = worker["environment"]["HSX_OUTPUT_ROOT"]
    assert output == api["environment"]["HSX_OUTPUT_ROOT"]
    assert mount_of(output, compose_mounts(worker)) == mount_of(output, compose_mounts(api))
    assert worker["environment"]["HSX_DATABASE_URL"] == api["environment"]["HSX_DATABASE_URL"]
    port = server["command"][server["command"].index("--port") + 1]
    assert worker["environment"]["HSX_BACKEND_URL"] == f"http://model-server:{port}"
    assert "/healthz" in " ".join(api["healthcheck"]["test"])


def test_the_compose_worker_is_healthy_by_its_own_metrics_port() -> None:
    worker = compose()["services"]["worker"]
    env = worker["environment"]
    port = env["HSX_METRICS_PORT"]
    assert env["HSX_METRICS_HOST"] == "0.0.0.0", "a Prometheus on the project's network reaches it"
    assert port in [str(p) for p in worker["expose"]] and "ports" not in worker, "not published on the host"
    assert f"http://127.0.0.1:{port}/healthz" in " ".join(worker["healthcheck"]["test"])


# ---------------------------------------------------------------------------------------------------
# kubernetes: what is shared, secrets, probes


def test_the_sglang_pod_shares_a_memory_backed_dump_root_with_its_worker() -> None:
    pod = k8s_object("Deployment", "hsx-sglang")["spec"]["template"]["spec"]
    sglang, worker = pod["containers"]
    assert sglang["command"] == ["python3", "-m", "sglang.launch_server"]
    assert env_value(sglang, "SGLANG_PLUGINS") == "hsx_dump"
    dump_root = env_value(worker, "HSX_DUMP_ROOT")
    assert env_value(sglang, "HSX_DUMP_ROOT") == dump_root
    volume = mount_of(dump_root, [(m["name"], m["mountPath"]) for m in worker["volumeMounts"]])
    assert volume == mount_of(dump_root, [(m["name"], m["mountPath"]) for m in sglang["volumeMounts"]])
    assert next(v for v in pod["volumes"] if v["name"] == volume)["emptyDir"]["medium"] == "Memory"
    port = sglang["args"][sglang["args"].index("--port") + 1]
    assert env_value(worker, "HSX_BACKEND_URL") == f"http://127.0.0.1:{port}"
    assert (
        pod["securityContext"]["runAsUser"]
        == k8s_object("Deployment", "hsx-api")["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    ), "the API deletes what the workers write"


def test_the_api_and_the_workers_share_the_output_claim_and_the_database_secret() -> None:
    claims = {o["metadata"]["name"] for o in k8s_objects() if o["kind"] == "PersistentVolumeClaim"}
    outputs, databases = set(), []
    for name in ("hsx-api", "hsx-sglang"):
        pod = k8s_object("Deployment", name)["spec"]["template"]["spec"]
        hsx = next(c for c in pod["containers"] if c["command"][0] == "hsx")
        volume = mount_of(env_value(hsx, "HSX_OUTPUT_ROOT"), [(m["name"], m["mountPath"]) for m in hsx["volumeMounts"]])
        claim = next(v for v in pod["volumes"] if v["name"] == volume)["persistentVolumeClaim"]["claimName"]
        outputs.add((env_value(hsx, "HSX_OUTPUT_ROOT"), claim))
        databases.append(env_value(hsx, "HSX_DATABASE_URL"))
    (_, claim), *others = outputs
    assert not others and claim in claims
    assert next(o for o in k8s_objects() if o["metadata"]["name"] == claim)["spec"]["accessModes"] == ["ReadWriteMany"]
    assert all(d == {"secretKeyRef": {"name": "hsx-database", "key": "url"}} for d in databases), databases


def test_the_api_is_ready_by_healthz_and_its_service_reaches_it() -> None:
    deployment = k8s_object("Deployment", "hsx-api")
    (api,) = deployment["spec"]["template"]["spec"]["containers"]
    assert api["command"][:3] == ["hsx", "serve", "--no-writer"]
    (port,) = api["ports"]
    for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
        assert api[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}, probe
    assert api["command"][api["command"].index("--port") + 1] == str(port["containerPort"])
    service = k8s_object("Service", "hsx-api")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [port["name"]]


def test_the_worker_is_ready_by_its_own_healthz_on_its_metrics_port() -> None:
    template = k8s_object("Deployment", "hsx-sglang")["spec"]["template"]
    worker = next(c for c in template["spec"]["containers"] if c["command"] == ["hsx", "worker"])
    (port,) = worker["ports"]
    assert str(port["containerPort"]) == env_value(worker, "HSX_METRICS_PORT")
    assert env_value(worker, "HSX_METRICS_HOST") == "0.0.0.0", "the kubelet probes the pod's address"
    assert worker["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert "livenessProbe" not in worker, "a restart fixes neither a refused server nor a wait"
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port["containerPort"])
    assert annotations["prometheus.io/path"] == "/metrics"


# ---------------------------------------------------------------------------------------------------
# systemd


def test_the_units_run_hsx_as_their_own_user_with_a_restart_policy_and_a_sandbox() -> None:
    for unit in UNITS:
        entries = {(s, k): v for s, k, v in unit_entries(unit)}
        assert entries[("Service", "User")] == "hsx", unit.name
        assert entries[("Service", "Restart")] == "on-failure", unit.name
        assert entries[("Service", "RestartPreventExitStatus")] == "2", unit.name
        assert entries[("Service", "ProtectSystem")] == "strict", unit.name
        assert entries[("Service", "NoNewPrivileges")] == "yes", unit.name
        assert entries[("Service", "CapabilityBoundingSet")] == "", unit.name
        assert entries[("Install", "WantedBy")] == "multi-user.target", unit.name
        # A leak or a runaway body ends in a restart, not in the machine's OOM killer choosing a victim.
        high, top = (entries[("Service", k)] for k in ("MemoryHigh", "MemoryMax"))
        assert memory_bytes(high) < memory_bytes(top), unit.name
        for _, key, value in unit_entries(unit):
            if key == "EnvironmentFile":
                assert example_of(value).exists(), f"{unit.name}: no example for {value}"


def memory_bytes(value: str) -> int:
    """A systemd memory size (1536M, 4G) in bytes."""
    number, unit = re.fullmatch(r"(\d+)([KMG]?)", value).groups()  # type: ignore[union-attr]
    return int(number) << {"": 0, "K": 10, "M": 20, "G": 30}[unit]


def test_the_worker_template_reads_its_instances_settings() -> None:
    entries = unit_entries(DEPLOY / "systemd" / "hsx-worker@.service")
    files = [v for _, k, v in entries if k == "EnvironmentFile"]
    assert files[-1] == "/etc/hsx/worker-%i.env", "the instance's file comes last, so it wins"
    instance = env_file(example_of(files[-1]))
    assert {"HSX_BACKEND_URL", "HSX_DUMP_ROOT"} <= set(instance)
    assert "%i" in next(v for _, k, v in entries if k == "Description")


def test_each_worker_instance_has_a_metrics_port_of_its_own() -> None:
    instance = env_file(DEPLOY / "systemd" / "worker-0.env.example")
    shared = env_file(DEPLOY / "systemd" / "worker.env.example")
    assert "HSX_METRICS_PORT" in instance and "HSX_METRICS_PORT" not in shared, "one port per instance"
    assert instance["HSX_METRICS_PORT"] != env_file(DEPLOY / "systemd" / "api.env.example")["HSX_PORT"]


def installed_hsx() -> Path:
    exe = Path(sys.executable).parent / "hsx"
    if not exe.exists():
        pytest.skip("the hsx console script is not installed beside this interpreter")
    return exe


def systemd_copies(tmp_path: Path) -> list[Path]:
    """The units, ExecStart pointing at the installed hsx (verify checks the program exists), the
    template as its instance 0."""
    copies = []
    for unit in UNITS:
        target = tmp_path / unit.name.replace("@.", "@0.")
        target.write_text(unit.read_text(encoding="utf-8").replace("/opt/hsx/.venv/bin/hsx", str(installed_hsx())))
        copies.append(target)
    return copies


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_finds_nothing(tmp_path: Path) -> None:
    for unit in systemd_copies(tmp_path):
        done = subprocess.run(
            ["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, cwd=tmp_path
        )
        # verify exits 0 on unknown keys and bad values too, with a warning: any output is a finding.
        assert (done.returncode, done.stdout + done.stderr) == (0, ""), unit.name


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_rates_every_unit_ok(tmp_path: Path) -> None:
    for unit in systemd_copies(tmp_path):
        done = subprocess.run(
            ["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True, text=True, cwd=tmp_path
        )
        level = re.search(r"Overall exposure level for \S+: ([\d.]+) (\w+)", done.stdout)
        assert level, done.stdout + done.stderr
        print(f"{unit.name}: exposure {level[1]} {level[2]}")
        assert float(level[1]) <= 2.0, done.stdout


# ---------------------------------------------------------------------------------------------------
# nginx (TLS in front of the API)


NGINX = DEPLOY / "nginx" / "hsx.conf"


def nginx_directives(name: str) -> list[str]:
    """The arguments of every `name ...;` directive of the sample, in order."""
    text = "\n".join(ln.split("#")[0] for ln in NGINX.read_text(encoding="utf-8").splitlines())
    return [m.strip() for m in re.findall(rf"(?m)^\s*{name}\s+([^;]*);", text)]


def test_the_nginx_sample_streams_to_the_api_with_hsxs_body_limit() -> None:
    from hsx.config import Settings

    assert nginx_directives("proxy_request_buffering") == ["off"]
    assert nginx_directives("proxy_buffering") == ["off"]
    assert nginx_directives("proxy_http_version") == ["1.1"], "else a chunked body is buffered whole"
    (upstream,) = nginx_directives("proxy_pass")
    api = env_file(DEPLOY / "systemd" / "api.env.example")
    assert upstream == f"http://127.0.0.1:{api['HSX_PORT']}"
    (size,) = nginx_directives("client_max_body_size")
    assert size.endswith("g") and int(size[:-1]) << 30 == Settings.model_fields["max_ndjson_bytes"].default
    (timeout,) = nginx_directives("proxy_read_timeout")
    assert int(timeout.rstrip("s")) >= Settings.model_fields["body_timeout_s"].default


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed (a certificate for nginx -t)")
def test_nginx_accepts_the_sample(tmp_path: Path) -> None:
    # nginx -t loads the certificate and key: a throwaway self-signed pair in their place.
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=hsx.example.org",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    sample = NGINX.read_text(encoding="utf-8")
    for directive, path in (("ssl_certificate ", cert), ("ssl_certificate_key ", key)):
        sample = re.sub(rf"(?m)^(\s*{directive}\s*)\S+;", rf"\g<1>{path};", sample)
    (tmp_path / "hsx.conf").write_text(sample, encoding="utf-8")
    # The sample as /etc/nginx/conf.d/ holds it: inside `http`; everything nginx writes under tmp_path.
    temp = " ".join(f"{d}_temp_path {tmp_path / d};" for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (tmp_path / "nginx.conf").write_text(
        f"pid {tmp_path / 'nginx.pid'};\nerror_log stderr;\nevents {{}}\n"
        f"http {{ access_log off; {temp} include {tmp_path / 'hsx.conf'}; }}\n",
        encoding="utf-8",
    )
    done = subprocess.run(
        ["nginx", "-t", "-q", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")], capture_output=True, text=True
    )
    assert (done.returncode, done.stderr) == (0, "")
    broken = tmp_path / "broken.conf"
    broken.write_text(sample.replace("proxy_buffering off", "proxy_bufering off"), encoding="utf-8")
    (tmp_path / "nginx.conf").write_text((tmp_path / "nginx.conf").read_text().replace("hsx.conf", "broken.conf"))
    done = subprocess.run(
        ["nginx", "-t", "-q", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")], capture_output=True, text=True
    )
    assert done.returncode != 0 and "proxy_bufering" in done.stderr, "the check must catch a misspelt directive"


# ---------------------------------------------------------------------------------------------------
# images


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_dockerfile_copies_what_its_build_context_holds(dockerfile: Path) -> None:
    context = DOCKERFILES[dockerfile]
    copied = [
        word
        for line in dockerfile.read_text(encoding="utf-8").splitlines()
        if line.startswith("COPY ")
        for word in line.split()[1:-1]
    ]
    assert copied
    assert [w for w in copied if not (context / w).exists()] == []


# ---------------------------------------------------------------------------------------------------
# deploy/README.md


def test_the_readmes_commands_name_files_that_exist_and_hsx_lines_that_parse() -> None:
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    lines = [
        ln.split("  #")[0].strip()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for ln in block.splitlines()
    ]
    hsx_lines = [shlex.split(ln) for ln in lines if ln.startswith("hsx ")]
    assert len(hsx_lines) >= 2
    assert [p for argv in hsx_lines for p in process_problems("deploy/README.md", argv, set())] == []
    named = set(re.findall(r"\bdeploy/[\w./@-]+", "\n".join(lines)))
    assert named and [n for n in named if not (DEPLOY.parent / n.rstrip("/")).exists()] == []
    enabled = re.findall(r"systemctl enable --now (\S+)", text)
    assert enabled and all(
        (DEPLOY / "systemd" / re.sub(r"@\w+$", "@", u)).with_suffix(".service").exists() for u in enabled
    )

"""The deployment files under deploy/, read for their tests: YAML documents, JSON Schema validators built
from the vendored schemas (deploy/schemas: nothing is downloaded), systemd units and environment files,
and the checks every process they start must pass: its hsx command line parses, and each HSX_* variable
it is given is a setting that command takes."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import shlex
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from hsx.cli import COMMANDS, build_parser
from hsx.config import Settings
from hsx_sglang import settings as plugin_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCHEMAS = DEPLOY / "schemas"
K8S_SCHEMAS = SCHEMAS / "kubernetes-v1.32.0"

# What the hsx-sglang plugin reads from the model server's environment (HSX_SGLANG_BOOT_ID is its own).
PLUGIN_ENV = {plugin_settings.ENV_DUMP_ROOT, plugin_settings.ENV_RID_PREFIX, plugin_settings.ENV_MAX_PENDING}


def yaml_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def compose_validator() -> Draft202012Validator:
    return Draft202012Validator(_load(SCHEMAS / "compose-spec.json"))


def kubernetes_validator(obj: dict[str, Any]) -> Draft202012Validator:
    """The strict schema of the object's kind and API version; its references into _definitions.json
    resolve to the vendored copy, registered under that file's own $id."""
    # Files are named <kind>-<group's first label>-<version>.json, or <kind>-<version>.json for the core group.
    group, _, version = obj["apiVersion"].rpartition("/")
    suffix = f"{group.split('.', 1)[0]}-{version}" if group else version
    path = K8S_SCHEMAS / f"{obj['kind'].lower()}-{suffix}.json"
    assert path.exists(), f"no vendored schema for {obj['kind']} {obj['apiVersion']} (deploy/schemas/README.md)"
    definitions = _load(K8S_SCHEMAS / "_definitions.json")
    registry = Registry().with_resource(definitions["$id"], Resource.from_contents(definitions))
    return Draft202012Validator(_load(path), registry=registry)


def schema_errors(validator: Draft202012Validator, doc: Any) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(doc))


# ---------------------------------------------------------------------------------------------------
# systemd


def unit_entries(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment of a unit file, in order."""
    entries, section = [], ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not an assignment: {raw!r}"
        entries.append((section, key.strip(), value.strip()))
    return entries


def env_file(path: Path) -> dict[str, str]:
    """An EnvironmentFile=: KEY=VALUE lines, comments and blank lines ignored."""
    env = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {raw!r}"
            env[key] = value
    return env


# ---------------------------------------------------------------------------------------------------
# the processes the files start


def command_settings(name: str) -> set[str]:
    """The settings `hsx <name>` takes, as flags and so as HSX_<FLAG> variables."""
    module = next(m for m in map(importlib.import_module, COMMANDS) if name == m.NAME)
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return {action.dest for action in parser._actions} & set(Settings.model_fields)


def process_problems(where: str, argv: list[str], env_names: set[str]) -> list[str]:
    """An hsx command line must parse with hsx's own parser, and every HSX_* variable must be a setting
    of that command; any other process (a model server) may only be given the plugin's variables."""
    problems = []
    hsx_vars = {n for n in env_names if n.startswith("HSX_")}
    if argv and Path(argv[0]).name == "hsx":
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = build_parser().parse_args(argv[1:])
        except SystemExit:
            return [f"{where}: {shlex.join(argv)} does not parse: {err.getvalue().strip()}"]
        taken = {f"HSX_{name.upper()}" for name in command_settings(args.command)}
        problems += [f"{where}: hsx {args.command} takes no setting {n}" for n in sorted(hsx_vars - taken)]
    else:
        problems += [f"{where}: {n} is not a variable of the hsx-sglang plugin" for n in sorted(hsx_vars - PLUGIN_ENV)]
    return problems

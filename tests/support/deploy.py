"""The deployment files under deploy/, read for their tests: YAML documents, their validation by the
validators themselves (check-jsonschema's builtin Compose Specification schema, kubernetes-validate's
strict Kubernetes schemas, both shipped in their wheels: nothing is downloaded), systemd units and
environment files, and the checks every process they start must pass: its hsx command line parses, and
each HSX_* variable it is given is a setting that command takes."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml
from check_jsonschema.formats import FormatOptions
from check_jsonschema.regex_variants import RegexImplementation, RegexVariantName
from check_jsonschema.schema_loader import BuiltinSchemaLoader

from hsx.cli import COMMANDS, build_parser
from hsx.config import Settings
from hsx_sglang import settings as plugin_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# The oldest Kubernetes API the manifests are checked against: they use nothing newer.
KUBERNETES_VERSION = "1.32.0"

# What the hsx-sglang plugin reads from the model server's environment (HSX_SGLANG_BOOT_ID is its own).
PLUGIN_ENV = {plugin_settings.ENV_DUMP_ROOT, plugin_settings.ENV_RID_PREFIX, plugin_settings.ENV_MAX_PENDING}


def yaml_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]


def compose_errors(doc: dict[str, Any]) -> list[str]:
    """Every error of a Compose file, by the validator `check-jsonschema --builtin-schema
    vendor.compose-spec` uses: built by its own loader, so with its format checks and its ECMA-262
    regular expressions (what the specification's patterns are written in), not Python's."""
    regex = RegexImplementation(RegexVariantName.default)
    loader = BuiltinSchemaLoader("vendor.compose-spec")
    validator = loader.get_validator(DEPLOY / "compose.yaml", doc, FormatOptions(regex_impl=regex), regex, False)
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(doc))


def kubernetes_errors(obj: dict[str, Any]) -> list[str]:
    """kubernetes-validate's strict check of one object (an unknown field is an error): nothing, or the
    one error it reports (jsonschema's best match). A kind it has no schema for is an error too, where
    its command line only warns: every object must be checked."""
    try:
        checked = kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'/'.join(map(str, e.path)) or '(top)'}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [e.message]
    # Without that version's schemas it would quietly use the newest older ones it has.
    assert KUBERNETES_VERSION.startswith(f"{checked}."), f"checked against {checked}, not {KUBERNETES_VERSION}"
    return []


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

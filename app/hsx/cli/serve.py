"""`hsx serve`: settings from flags and HSX_* variables, the database migrated, the output root checked
against the database's, the dump-root lock, then uvicorn.

The flags are generated from Settings: one per field, named after it, its description as the help."""

from __future__ import annotations

import argparse
import enum
import sys
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from hsx.cli import logs
from hsx.config import Settings

if TYPE_CHECKING:  # imported by main() only: --help stays fast
    from hsx.extraction import Writer

NAME = "serve"
HELP = "run the extraction service (API + dump-root writer)"
DESCRIPTION = (
    "Run the extraction service: the HTTP API plus the single writer for one dump root. "
    "Every flag can also be set by an environment variable named HSX_<FLAG> (e.g. HSX_DATABASE_URL)."
)

# A setting that is on by default is given a switch that turns it off, named after what it turns off.
OFF_SWITCHES = {"run_writer": "--no-writer"}


def _env_var(name: str) -> str:
    return f"{Settings.model_config.get('env_prefix', '')}{name}".upper()


def _value_type(field: FieldInfo) -> type:
    """Numbers are parsed here, so that a bad one is a usage error (exit 2); Settings converts the rest."""
    kinds = [k for k in get_args(field.annotation) if k is not type(None)] or [field.annotation]
    return kinds[0] if kinds[0] in (int, float) else str


def _choices(field: FieldInfo) -> list[str] | None:
    """The values a setting made of literals and enums takes (--source: auto and each engine); None for others."""
    kinds = get_args(field.annotation) or (field.annotation,)
    choices: list[str] = []
    for kind in kinds:
        if get_origin(kind) is Literal:
            choices += [str(v) for v in get_args(kind)]
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            choices += [str(m.value) for m in kind]
        else:
            return None
    return choices


def _shown(default: Any) -> str:
    return "unset" if default in (None, "") else str(default)


# What only `hsx worker` uses: `hsx serve` answers /metrics and /healthz on its API port.
WORKER_SETTINGS = {"metrics_port", "metrics_host"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, exclude=WORKER_SETTINGS)


def add_settings(
    parser: argparse.ArgumentParser, exclude: frozenset[str] | set[str] = frozenset(), *, access_log: bool = True
) -> None:
    """One flag per setting but those in `exclude`, and the logging flags."""
    for name, field in Settings.model_fields.items():
        if name in exclude:
            continue
        text = (field.description or "").replace("%", "%%")
        if name in OFF_SWITCHES:
            parser.add_argument(
                OFF_SWITCHES[name],
                dest=name,
                action="store_const",
                const=False,
                default=None,
                help=f"do not {text} (env {_env_var(name)}=false)",
            )
            continue
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=_value_type(field),
            choices=_choices(field),
            default=None,
            help=f"{text} (env {_env_var(name)}; default {_shown(field.default)})",
        )
    logs.add_arguments(parser, access_log=access_log)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The flags given win over the environment, which wins over the defaults."""
    given = {name: getattr(args, name) for name in Settings.model_fields if getattr(args, name, None) is not None}
    return Settings(**given)


def setting_errors(exc: ValidationError) -> list[str]:
    """Each refused setting as its flag, its variable and why; never the value, which may be a secret."""
    lines = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else ""
        flag = OFF_SWITCHES.get(name, f"--{name.replace('_', '-')}")
        why = err["msg"].removeprefix("Value error, ")
        lines.append(f"{flag} ({_env_var(name)}): {why}")
    return lines


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from hsx.api.app import create_app

    settings = prepare(args, "hsx serve")
    if isinstance(settings, int):
        return settings
    if not made_input_root(settings, "hsx serve"):
        return 2
    writer = None
    if settings.run_writer:
        writer = acquired_writer(settings, "hsx serve")
        if writer is None:
            return 2
    app = create_app(settings, writer)
    # log_config=None: uvicorn's records go through the handler hsx.cli.logs set up, in its format.
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        access_log=args.access_log,
        log_config=None,
    )
    return 0


def prepare(args: argparse.Namespace, prog: str) -> Settings | int:
    """What `hsx serve` and `hsx worker` do first: logging, the settings, the database migrated, the
    output root checked as this database's (marked if it has none). An exit code when one fails."""
    from hsx.db.engine import make_engine, session_factory, upgrade
    from hsx.extraction.output_root import shared_output_root
    from hsx.storage.output_root import OutputRootMismatch

    logs.configure(args.log_level, args.log_format)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        for line in setting_errors(exc):
            print(f"{prog}: {line}", file=sys.stderr)
        return 2
    engine = make_engine(settings.database_url)
    try:
        upgrade(engine)
        with session_factory(engine).begin() as session:
            shared_output_root(session, settings.output_root, mark=True)
    except OutputRootMismatch as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.dispose()
    return settings


def made_input_root(settings: Settings, prog: str) -> bool:
    """Create the input root when it is missing, so that there is a folder to put the first job's
    files in; False (said on stderr) when it cannot be."""
    try:
        settings.input_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"{prog}: cannot create the input root {settings.input_root}: {exc.strerror or exc}", file=sys.stderr)
        return False
    return True


def acquired_writer(settings: Settings, prog: str) -> Writer | None:
    """The writer for the dump root, its lock taken; None (said on stderr) when another process holds it."""
    from hsx.backends.dumps import DumpRootBusy
    from hsx.db.engine import session_factory
    from hsx.extraction import Writer, writer_engine

    writer = Writer(settings, session_factory(writer_engine(settings)))
    try:
        writer.acquire()
    except DumpRootBusy as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    return writer

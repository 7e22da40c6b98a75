"""The model server: its engines, the HTTP clients they speak with, and the dump root.

hsx.sources.Source is the registry of engines; hsx.backends.engine is what every engine is, and
hsx/backends/engines/ holds one module for each. `engine_class(source)` loads the class the registry
names, `discover` looks at the server with the engine chosen (or with each in the registry's order,
for auto), and `limits` asks it what it accepts.
"""

from __future__ import annotations

import importlib

from hsx.backends.engine import CaptureProblem, Engine, Limits, Look, Server
from hsx.sources import Source, SourceChoice


def engine_class(source: Source) -> type[Engine]:
    module, name = source.engine.rsplit(".", 1)
    cls: type[Engine] = getattr(importlib.import_module(module), name)
    return cls


def engines_for(choice: SourceChoice) -> list[type[Engine]]:
    """The engine chosen, or for auto every engine in the registry's order."""
    return [engine_class(choice)] if isinstance(choice, Source) else [engine_class(s) for s in Source]


def discover(server: Server, choice: SourceChoice, *, after_outage: bool = False) -> Engine:
    """The engine for the server as it is now, bound to what it captures. Raises BackendUnavailable (not
    ready), BackendRejected, or CaptureProblem (it cannot give whole samples, or no engine finds it)."""
    look = Look(server, auto=not isinstance(choice, Source), after_outage=after_outage)
    for cls in engines_for(choice):
        engine = cls.discover(look)
        if engine is not None:
            return engine
    raise CaptureProblem(f"none of the engines ({', '.join(Source)}) finds its model server at {server.url}")


def limits(server: Server, choice: SourceChoice) -> Limits:
    """What the server accepts and captures, from the first engine that can tell; unknown when none can.
    Raises BackendUnavailable, BackendRejected or ValueError when the server does not answer."""
    for cls in engines_for(choice):
        found = cls.limits(server)
        if found is not None:
            return found
    return Limits()

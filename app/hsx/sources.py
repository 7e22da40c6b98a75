"""Where a writer takes hidden states from: the one registry of engines.

An engine is a kind of model server and the way hsx takes a sample's hidden states from it: an
`hsx.backends.engine.Engine` subclass in a module of its own under `hsx/backends/engines/`. Each is one
member of `Source` here, one line: its value (what `--source` and HSX_SOURCE take, what /healthz and
/v1/workers report), its class, a few words that name it in messages meant for people (`label`), and what
it is (the help of `hsx serve --source`). `--source auto`
tries them in this order and takes the first whose server it finds (`hsx.backends.discover`).
"""

from __future__ import annotations

from typing import Literal

from hsx.states import StrEnum


class Source(StrEnum):
    engine: str  # the Engine subclass, as "module.Class"
    label: str  # what a person reads: "the worker on vm reading /dumps (SGLang dumps)"
    description: str

    def __new__(cls, value: str, engine: str = "", label: str = "", description: str = "") -> Source:
        member = str.__new__(cls, value)
        member._value_ = value
        member.engine = engine
        member.label = label
        member.description = description
        return member

    VLLM = (
        "vllm",
        "hsx.backends.engines.vllm.VLLMEngine",
        "vLLM's hidden-states files",
        "the files vLLM's extract_hidden_states writes, through hsx's connector (deploy/vllm) or vLLM's own "
        "ExampleHiddenStatesConnector (then with --capture-layers); auto takes it when an hsx-vllm.json is in the "
        "dump root, or when --capture-layers is given and the server's /v1/models says vLLM",
    )
    RESPONSE = (
        "response",
        "hsx.backends.engines.sglang_answers.AnswersEngine",
        "SGLang's answers",
        "a stock SGLang's return_hidden_states answers, no plugin; auto takes it when the server returns every "
        "prompt row and neither it nor an hsx-plugin.json in the dump root describes dumps",
    )
    DUMPS = (
        "dumps",
        "hsx.backends.engines.sglang_dumps.DumpsEngine",
        "SGLang dumps",
        "files in the dump root, from SGLang's hsx-sglang plugin or another server that writes them (the "
        "reference server); auto takes it otherwise",
    )


AUTO: Literal["auto"] = "auto"
# What a writer is told to use: one engine, or auto.
SourceChoice = Literal["auto"] | Source


def source_label(value: str | None) -> str | None:
    """The words that name an engine's source in messages meant for people; None for no or an unknown value."""
    if value is None:
        return None
    try:
        return Source(value).label
    except ValueError:
        return None


def source_help() -> str:
    """What `--source` takes, each choice with what it is."""
    engines = " ".join(f"{s.value}: {s.description}." for s in Source)
    return f"where hidden states come from. {AUTO}: the first engine below that finds its server. {engines}"

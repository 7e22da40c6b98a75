"""Chat templates run in a process of their own, so that no conversation can hold up the caller.

A chat template is a program that came with the model, and a conversation is data that came with the
job: between them, one render can raise anything, loop for minutes or take gigabytes. A preparer that
rendered in its own thread would share the GIL and the memory of the API beside it, and could neither
stop a render nor be stopped during one. Here every render is a request to a child process (`python -m
hsx.chat.process`), answered in a frame of JSON; the caller waits at most `timeout_s` for each, and asks
`abort()` (a cancelled job, a writer stopping) every tenth of a second meanwhile. The child holds at most
`max_mb` of memory (hsx.chat.memory). A render that runs over its time, is aborted, or needs more memory
is ended by killing the child, which the next request starts anew; one that raises fails that
conversation alone, with the reason.

The child keeps the last few templates it loaded (a tokenizer costs seconds to load), keyed by the
folder's resolved path, so spellings of one folder share an entry.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from hsx.chat.formats import ConversationError, Message
from hsx.chat.memory import StderrTail, bound_data
from hsx.chat.render import ChatTemplate, ChatTemplateError

TEMPLATES_KEPT = 4  # templates the child keeps loaded
POLL_S = 0.1
STARTUP_S = 120.0  # the longest a child may take to import what renders need, on a busy host
_HEADER = struct.Struct("<I")


class RenderFailed(Exception):
    """A render that gave no result: `code` says why (`timeout`, `aborted`, `memory`, `crashed`, `error`)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class RenderedIds:
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8
    whole: bool = True  # every token of the text; False: its first ones only, more than the limit (render's)


@dataclass(frozen=True)
class TemplateFacts:
    fingerprint: str
    stop_ids: list[int]  # ids that end an assistant turn, for generation to stop at
    end_of_turn: list[int]  # what the template writes after a turn's content (Llama 3's <|eot_id|>)


Abort = Callable[[], bool]


def _never() -> bool:
    return False


class TemplateProcess:
    """Renders in a child process of at most `max_mb` MiB of memory; not thread-safe (one caller at a time)."""

    def __init__(self, *, timeout_s: float, max_mb: int):
        self.timeout_s = timeout_s
        self.max_mb = max_mb
        self._child: subprocess.Popen[bytes] | None = None
        self._stderr: StderrTail | None = None
        self._loaded: set[str] = set()  # folders the running child has loaded

    def facts(self, folder: str, abort: Abort = _never) -> TemplateFacts:
        """Load the template in `folder`; ChatTemplateError when it cannot render conversations."""
        out = self._call({"op": "facts", "folder": folder}, abort)
        return TemplateFacts(out["fingerprint"], out["stop_ids"], out["end_of_turn"])

    def render(
        self, folder: str, messages: list[Message], loss: str, abort: Abort = _never, limit: int | None = None
    ) -> RenderedIds:
        """The conversation's ids and loss mask (hsx.chat.render.ChatTemplate.render, `limit` as there)."""
        request = {"op": "render", "folder": folder, "messages": messages, "loss": loss, "limit": limit}
        out = self._call(request, abort)
        return RenderedIds(_ids(out["input_ids"], np.int32), _ids(out["loss_mask"], np.uint8), bool(out["whole"]))

    def continuation(
        self,
        folder: str,
        messages: list[Message],
        *,
        generation_prompt: bool,
        abort: Abort = _never,
        limit: int | None = None,
    ) -> list[int]:
        """The ids of what the template writes after the last assistant turn of `messages` (its content and
        end of turn), through the end of their rendering: the whole rendering when no assistant turn is there
        (hsx.chat.render.ChatTemplate.continuation, `limit` as there)."""
        request = {
            "op": "continuation",
            "folder": folder,
            "messages": messages,
            "generation_prompt": generation_prompt,
            "limit": limit,
        }
        return _ids(self._call(request, abort)["ids"], np.int32).tolist()

    def decode(self, folder: str, ids: list[int], abort: Abort = _never) -> str:
        """Generated ids as text, up to the first stop id, special tokens left out."""
        return str(self._call({"op": "decode", "folder": folder, "ids": _packed(ids, np.int32)}, abort)["text"])

    def close(self) -> None:
        child, self._child = self._child, None
        self._stderr = None  # its thread ends with the child's stderr
        if child is not None:
            child.kill()
            child.wait()
            for stream in (child.stdin, child.stdout):
                if stream is not None:
                    stream.close()

    def _call(self, request: dict[str, Any], abort: Abort) -> dict[str, Any]:
        what = "loading the template" if request["op"] == "facts" else "rendering"
        try:
            child = self._started(abort)
            assert child.stdin is not None and child.stdout is not None
            if request["op"] != "facts" and request["folder"] not in self._loaded:
                # A template loads in its own request, under its own bound: what a render is given is
                # the render's alone.
                self._call({"op": "facts", "folder": request["folder"]}, abort)
            _write_frame(child.stdin, request)
            answer = self._answer(child.stdout, abort, self.timeout_s, what)
        except (BrokenPipeError, EOFError) as exc:
            raise self._ended(what, exc) from exc
        if request["op"] == "facts" and answer.get("status") == "ok":
            self._loaded.add(request["folder"])
        status = answer.get("status")
        if status == "ok":
            return dict(answer["result"])
        if status == "conversation":
            raise ConversationError(answer["field"], answer["message"])
        if status == "template":
            raise ChatTemplateError(answer["message"])
        if status == "memory":
            # What failed to allocate may have left any library's state half made: the next request
            # gets a fresh child.
            self.close()
            raise self._over(what, str(answer.get("message")))
        raise RenderFailed("error", str(answer.get("message")))

    def _ended(self, what: str, exc: BaseException) -> RenderFailed:
        """Why the child ended without answering: an allocation its memory bound refused (its allocator
        said so on stderr), else a crash, with how it ended."""
        child, stderr = self._child, self._stderr
        self.close()
        refused = stderr.allocation_failed() if stderr is not None else None
        if refused is not None:
            return self._over(what, refused)
        code = child.returncode if child is not None else None
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
        return RenderFailed("crashed", f"the rendering process ended while {what} ({how}; {exc or 'no answer'})")

    def _over(self, what: str, detail: str) -> RenderFailed:
        return RenderFailed(
            "memory", f"{what} took more than the {self.max_mb} MB the rendering process may hold ({detail})"
        )

    def _answer(self, stdout: IO[bytes], abort: Abort, timeout_s: float, what: str = "rendering") -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        fd = stdout.fileno()
        while True:
            if abort():
                self.close()
                raise RenderFailed("aborted", f"stopped while {what} (the job was cancelled or the writer stopped)")
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise RenderFailed("timeout", f"{what} took over {timeout_s:g} s")
            ready, _, _ = select.select([fd], [], [], min(POLL_S, left))
            if ready:
                # The child writes each frame whole; once it starts, the rest follows at once.
                return _read_frame(stdout)

    def _started(self, abort: Abort) -> subprocess.Popen[bytes]:
        """The child, started and ready (its libraries imported, which takes seconds and is no render's
        time) when it was not running."""
        if self._child is not None and self._child.poll() is None:
            return self._child
        self.close()
        self._loaded = set()
        self._child = subprocess.Popen(
            [sys.executable, "-m", "hsx.chat.process", "--max-mb", str(self.max_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,  # passed on to ours as it comes, watched for a failed allocation (hsx.chat.memory)
            start_new_session=True,  # a Ctrl-C meant for the service is the service's to pass on
        )
        assert self._child.stdout is not None and self._child.stderr is not None
        self._stderr = StderrTail(self._child.stderr)
        what = "starting the rendering process"
        ready = self._answer(self._child.stdout, abort, max(STARTUP_S, self.timeout_s), what)
        if ready.get("status") == "memory":
            self.close()
            raise self._over(what, str(ready.get("message")))
        return self._child


def _packed(ids: Any, dtype: type) -> str:
    return base64.b64encode(np.asarray(ids, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()).decode()


def _ids(packed: str, dtype: type) -> np.ndarray:
    return np.frombuffer(base64.b64decode(packed), dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)


def _write_frame(stream: IO[bytes], message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_frame(stream: IO[bytes]) -> dict[str, Any]:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("no answer")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("a cut-off answer")
    return dict(json.loads(data))


# The child's side.


class _Templates:
    """The templates loaded here, the last TEMPLATES_KEPT used."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, ChatTemplate] = OrderedDict()

    def get(self, folder: str) -> ChatTemplate:
        key = str(Path(folder).resolve())
        template = self._kept.pop(key, None)
        if template is None:
            template = ChatTemplate.load(key)
        self._kept[key] = template
        while len(self._kept) > TEMPLATES_KEPT:
            self._kept.popitem(last=False)
        return template


def _handle(templates: _Templates, request: dict[str, Any]) -> dict[str, Any]:
    # MemoryError first: the process's bound (hsx.chat.memory), reached by whatever the request did, is no
    # template's or conversation's error.
    try:
        template = templates.get(request["folder"])
    except MemoryError as exc:
        return {"status": "memory", "message": _what(exc)}
    except Exception as exc:
        return {"status": "template", "message": _unusable(request["folder"], exc)}
    try:
        return _run(template, request)
    except MemoryError as exc:
        return {"status": "memory", "message": _what(exc)}
    except ConversationError as exc:
        return {"status": "conversation", "field": exc.field, "message": exc.message}
    except Exception as exc:  # anything a template or tokenizer raises is this conversation's failure
        return {"status": "error", "message": f"the chat template fails on this conversation: {_what(exc)}"}


def _unusable(folder: str, exc: Exception) -> str:
    """Why a folder's template cannot be used: one that raises while loading is as unusable as a missing one."""
    if isinstance(exc, ChatTemplateError):
        return str(exc)
    return f"{folder}: the chat template fails: {_what(exc)}"


def _run(template: ChatTemplate, request: dict[str, Any]) -> dict[str, Any]:
    """The answer to the request's operation."""
    op = request["op"]
    if op == "facts":
        result: dict[str, Any] = {
            "fingerprint": template.fingerprint,
            "stop_ids": template.eos_ids,
            "end_of_turn": template.end_of_turn_ids,
        }
    elif op == "render":
        rendered = template.render(request["messages"], request["loss"], request.get("limit"))
        result = {
            "input_ids": _packed(rendered.input_ids, np.int32),
            "loss_mask": _packed(rendered.loss_mask, np.uint8),
            "whole": rendered.whole,
        }
    elif op == "continuation":
        ids = template.continuation(
            request["messages"], generation_prompt=request["generation_prompt"], limit=request.get("limit")
        )
        result = {"ids": _packed(ids, np.int32)}
    elif op == "decode":
        result = {"text": template.decode(_ids(request["ids"], np.int32).tolist())}
    else:
        return {"status": "error", "message": f"unknown operation {op!r}"}
    return {"status": "ok", "result": result}


def _what(exc: BaseException) -> str:
    said = str(exc)[:500]
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


def serve(stdin: IO[bytes], stdout: IO[bytes], max_mb: int | None = None) -> None:
    """Say it is ready (its memory bounded to `max_mb` MiB), then answer requests until stdin closes."""
    # The seconds transformers and its tokenizers take to import are paid here, before any render is timed,
    # and before the bound, which would make a library it cannot map look like one not installed; without
    # them, loading a template says what is missing.
    with contextlib.suppress(ImportError):
        from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401
    try:
        if max_mb is not None:
            bound_data(max_mb)
    except MemoryError as exc:  # a bound below what the libraries need
        _write_frame(stdout, {"status": "memory", "message": _what(exc)})
        return
    _write_frame(stdout, {"status": "ready"})
    templates = _Templates()
    while True:
        try:
            request = _read_frame(stdin)
        except EOFError:
            return
        answer = _handle(templates, request)
        try:
            _write_frame(stdout, answer)  # encoded whole before any byte is written
        except MemoryError as exc:  # an answer too large to encode within the bound
            del answer
            _write_frame(stdout, {"status": "memory", "message": _what(exc)})


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m hsx.chat.process", description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-mb", type=int, required=True, help="the most memory this process may hold, in MiB")
    args = parser.parse_args()
    # Renders are one text at a time: the tokenizers library's pool of a thread per core would add nothing
    # but a stack per core, counted against the bound, whatever the host.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Frames go to the original stdout; anything a library prints goes to stderr instead.
    frames = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, frames, args.max_mb)


if __name__ == "__main__":
    main()

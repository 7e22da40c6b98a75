"""The one error of a shard whose contents fail a check: every reader raises it, with where it lies.

A reader checks what it reads before it trusts it (hsx.storage.encoding): a layer's index against the
shard's rows and the block limit, each zstd frame's declared size and checksum, each fp8 scale, where
the shard places a sample against where the manifest does. What fails is not the request's fault but
the file's, so it says which file, which layer and, where the reader knows it, which sample.
"""

from __future__ import annotations

import os


class ShardError(ValueError):
    """A shard that fails a check on its contents. `problem` says what; `shard` (its file), `layer` (the
    layer or tensor) and `sample` (the sample being read) say where, each where known."""

    def __init__(
        self,
        problem: str,
        *,
        shard: str | os.PathLike[str] | None = None,
        layer: str | None = None,
        sample: str | None = None,
    ):
        self.problem = problem
        self.shard = None if shard is None else str(shard)
        self.layer = layer
        self.sample = sample
        super().__init__(self._message())

    def __reduce__(self) -> tuple[object, tuple[str | None, ...]]:
        # whole across a process boundary (an export's worker raises it, the parent reports it)
        return _rebuilt, (self.problem, self.shard, self.layer, self.sample)

    def _message(self) -> str:
        where = [self.shard or "", self.layer or "", "" if self.sample is None else f"sample {self.sample!r}"]
        placed = ", ".join(w for w in where if w)
        return f"{placed}: {self.problem}" if placed else self.problem

    def at(
        self, *, shard: str | os.PathLike[str] | None = None, layer: str | None = None, sample: str | None = None
    ) -> ShardError:
        """The same problem, placed by what a caller further out knows (what was known already stays)."""
        return ShardError(
            self.problem,
            shard=self.shard or shard,
            layer=self.layer or layer,
            sample=self.sample if self.sample is not None else sample,
        )


def _rebuilt(problem: str, shard: str | None, layer: str | None, sample: str | None) -> ShardError:
    return ShardError(problem, shard=shard, layer=layer, sample=sample)

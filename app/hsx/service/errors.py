"""Business errors, each with the HTTP status and RFC 9457 problem fields the API answers with."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, TypedDict

from hsx.storage.errors import ShardError


class _Field(TypedDict):
    field: str
    message: str


class FieldError(_Field, total=False):
    """One entry of an invalid-input problem's `errors`: the field and what is wrong with it, and where
    known the sample's index and id and the line it came from."""

    sample_index: int
    line: int
    row: int
    sample_id: str


class Where(TypedDict, total=False):
    """Where a sample came from besides its index: its line in a JSONL body or file, its row in a
    Parquet file."""

    line: int
    row: int


class ServiceError(Exception):
    """A refused request: its status, the problem's type, title and detail, and extra members."""

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        type_: str | None = None,
        title: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ):
        super().__init__(detail)
        self.status = status
        self.headers = headers
        self.detail = detail
        self.type = type_ or f"/problems/{HTTPStatus(status).phrase.lower().replace(' ', '-')}"
        self.title = title or HTTPStatus(status).phrase
        self.extra = extra


class InvalidInput(ServiceError):
    """Input that fails its checks; `errors` name each failing field (and sample, and line)."""

    def __init__(self, errors: list[FieldError], detail: str | None = None):
        first = errors[0]
        where = f"sample {first['sample_index']} " if first.get("sample_index") is not None else ""
        super().__init__(
            422,
            detail or f"{len(errors)} invalid field(s); first: {where}{first['field']}: {first['message']}",
            type_="/problems/invalid-input",
            title="Invalid input",
            errors=errors,
        )

    @classmethod
    def from_pydantic(cls, errs: Any) -> InvalidInput:
        """Pydantic's errors as problem entries; a sample's errors name its index and field."""
        errors: list[FieldError] = []
        for err in errs:
            loc = [p for p in err.get("loc", ()) if p != "body"]
            entry: FieldError = {"field": ".".join(str(p) for p in loc) or "body", "message": err.get("msg", "invalid")}
            if len(loc) >= 2 and loc[0] == "samples" and isinstance(loc[1], int):
                entry["sample_index"] = loc[1]
                entry["field"] = ".".join(str(p) for p in loc[2:]) or "sample"
            errors.append(entry)
        return cls(errors or [{"field": "body", "message": "invalid request"}])


class NotFound(ServiceError):
    def __init__(self, what: str):
        super().__init__(404, f"{what} not found")


class InvalidTransition(ServiceError):
    """The action is not allowed in the job's present state."""

    def __init__(self, detail: str):
        super().__init__(409, detail, type_="/problems/invalid-transition")


class ForeignFiles(ServiceError):
    """A job's folder holds files hsx did not write there, or is not a folder hsx made (`why`): it is
    left for a person to look at, and the job's records, when it has any, stay too."""

    def __init__(self, folder: str, names: list[str], why: str | None = None):
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        what = why or f"holds what hsx does not write there ({shown})"
        super().__init__(
            409,
            f"the job folder {folder} under the output root {what}; nothing was removed: look at it and remove "
            "it by hand",
            type_="/problems/foreign-files",
            foreign_files=names,
        )


class NotStored(ServiceError):
    """The sample has no stored rows (yet, or ever)."""

    def __init__(self, sample_id: str, state: str):
        super().__init__(409, f"sample {sample_id!r} is {state}, not stored")


class ShardsMissing(ServiceError):
    """Shards the database records are not in the output root: deleted or moved since they were written."""

    def __init__(self, job_id: str, names: list[str]):
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(
            410,
            f"job {job_id}: {len(names)} recorded shard file(s) no longer in the output root: {shown}",
            type_="/problems/shard-missing",
            missing_shards=names,
        )


class ShardsDeleted(ServiceError):
    """Shards retention deleted (retention acked: every consumer had read them); their records stay."""

    def __init__(self, job_id: str, names: list[str]):
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(
            410,
            f"job {job_id}: retention deleted {shown} once every consumer had read it (retention: acked)",
            type_="/problems/shard-deleted",
            deleted_shards=names,
        )


class ShardDamaged(ServiceError):
    """A shard on disk fails a check on what it holds (hsx.storage.errors.ShardError), or no longer is
    the file its record describes: the stored data is bad, not the request, and asking again will not
    help. `error`'s shard is named by its file name; hsx verify checks the whole job."""

    def __init__(self, job_id: str, name: str, error: ShardError):
        named = ShardError(error.problem, shard=name, layer=error.layer, sample=error.sample)
        where: dict[str, Any] = {"layer": error.layer, "sample_id": error.sample}
        super().__init__(
            500,
            f"job {job_id}: {named}; hsx verify checks the whole job",
            type_="/problems/shard-damaged",
            title="Shard damaged",
            shard=name,
            **{k: v for k, v in where.items() if v is not None},
        )


class IdempotencyKeyReused(ServiceError):
    def __init__(self) -> None:
        super().__init__(
            422,
            "this Idempotency-Key was already used with a different request",
            type_="/problems/idempotency-key-reused",
            field="Idempotency-Key",
        )


class OutsideInputRoot(ServiceError):
    """An input_path that is absolute or leads out of the service's input root."""

    def __init__(self, detail: str):
        super().__init__(403, detail, field="input_path")


class InsufficientStorage(ServiceError):
    """The output volume cannot hold the new job on top of what active jobs still have to write."""

    def __init__(self, detail: str, *, needed: int, pending: int, free: int):
        super().__init__(
            507,
            detail,
            type_="/problems/insufficient-storage",
            needed_bytes=needed,
            pending_bytes=pending,
            free_bytes=free,
        )


class ContentTooLarge(ServiceError):
    """A request body, or one line of a streamed body, over its configured limit; nothing was stored."""

    def __init__(self, detail: str, *, limit: int, line: int | None = None, sample_index: int | None = None):
        """`line` or `sample_index`: the one sample that is too long, when it is one."""
        where: dict[str, Any] = {"line": line, "sample_index": sample_index}
        super().__init__(
            413,
            detail,
            type_="/problems/content-too-large",
            title="Content too large",
            limit_bytes=limit,
            **{k: v for k, v in where.items() if v is not None},
        )


class UnsupportedBody(ServiceError):
    """A body in a media type or content coding the service does not read."""

    def __init__(self, detail: str, headers: dict[str, str] | None = None):
        super().__init__(415, detail, type_="/problems/unsupported-media-type", headers=headers)


class BodyTimeout(ServiceError):
    """A request body stopped arriving, or took too long in all; nothing was stored."""

    def __init__(self, detail: str):
        super().__init__(
            408, detail, type_="/problems/request-timeout", title="Request timeout", headers={"Connection": "close"}
        )


class Busy(ServiceError):
    """Too many requests of a kind at once (large bodies, or requests for the database's connections); the
    same request can be sent again later, nothing having changed."""

    def __init__(self, detail: str, retry_after_s: int):
        super().__init__(503, detail, type_="/problems/busy", title="Busy", headers={"Retry-After": str(retry_after_s)})


class RangeNotSatisfiable(ServiceError):
    """No range of a Range header lies inside the file."""

    def __init__(self, size: int):
        super().__init__(
            416,
            f"no requested range starts inside the {size}-byte file",
            headers={"Content-Range": f"bytes */{size}"},
            size_bytes=size,
        )

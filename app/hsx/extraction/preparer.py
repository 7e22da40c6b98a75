"""A writer's preparer: turns a job's conversation samples into token ids before extraction.

It runs on a thread of its own beside the request loops, so that the model server never waits for
a chat template: it claims a batch of a job's `preparing` samples, regenerates their answers with
the model server when the job asks (several requests in flight: generation is decode-bound),
renders them with the model's own chat template, applies the job's length policy, and queues them.
The tokenizer is the job's `tokenizer` folder, or the model path the server reports; one that
cannot be loaded fails the job, saying why.

Templates run in a process of their own (hsx.chat.process): a render is bounded by
--prepare-timeout-s and --prepare-max-mb, stopped when its job is cancelled or the writer stops, and
whatever a template raises fails that sample alone. A batch whose store fails is stored sample by
sample, so that one sample the database refuses fails alone and never holds the others. What the
preparer last did (`health`) shows in /healthz and /metrics: a preparer that keeps failing is not `ok`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np

from hsx.chat.formats import ConversationError, Message
from hsx.chat.process import RenderedIds, RenderFailed, TemplateFacts, TemplateProcess
from hsx.chat.regenerate import GenerationUnavailable, RegenerationError, Sampling, regenerate
from hsx.chat.render import ChatTemplateError
from hsx.config import Settings, tokenizer_within_roots
from hsx.db import repository as repo
from hsx.extraction.database import Database
from hsx.extraction.finishing import JobFinisher
from hsx.extraction.server_watch import ServerWatch
from hsx.lengths import kept_tokens
from hsx.matching import SEED_IGNORED, Serves, ignores_seed, prepares
from hsx.states import JobState, SampleState
from hsx.wire import NO_LOSS_TOKENS, JobOptions

log = logging.getLogger("hsx.writer")

BATCH = 64  # samples claimed at a time: small enough that a restart redoes little
POLL_S = 1.0
FACTS_KEPT = 16  # template folders whose facts are remembered
CANCEL_CHECK_S = 1.0  # how often a batch in progress asks whether its job was cancelled


@dataclass
class PreparerHealth:
    """What the preparer last did, for /healthz and /metrics."""

    state: str = "idle"  # idle | preparing | failing
    reason: str | None = None  # why it is failing
    since: float = field(default_factory=time.time)
    prepared: int = 0  # samples it moved on since the writer started
    failures: int = 0  # steps that raised since the writer started

    def set(self, state: str, reason: str | None = None) -> None:
        if (state, reason) != (self.state, self.reason):
            self.state, self.reason, self.since = state, reason, time.time()

    def as_dict(self) -> dict[str, object]:
        return {"state": self.state, "reason": self.reason, "since": self.since, "prepared": self.prepared}


class _JobAbort:
    """Whether work on a job's batch must stop: the writer stopping, or the job no longer active (asked
    of the database at most every CANCEL_CHECK_S). Called from the render wait and generation alike."""

    def __init__(self, stop: threading.Event, db: Database, job_id: str):
        self.stop, self.db, self.job_id = stop, db, job_id
        self._checked = time.monotonic()
        self._gone = False
        self._lock = threading.Lock()

    def __call__(self) -> bool:
        if self.stop.is_set():
            return True
        with self._lock:
            if not self._gone and time.monotonic() - self._checked >= CANCEL_CHECK_S:
                self._checked = time.monotonic()
                job = self.db.run(lambda s: repo.get_job(s, self.job_id))
                self._gone = job is None or job.state not in (JobState.QUEUED, JobState.RUNNING)
            return self._gone


class Preparer:
    def __init__(
        self,
        *,
        settings: Settings,
        identity: str,
        db: Database,
        server: ServerWatch,
        finisher: JobFinisher,
        queued: Callable[[], None],
        stop: threading.Event,
    ):
        self.settings = settings
        self.identity = identity
        self.db = db
        self.server = server
        self.finisher = finisher
        self.queued = queued  # wakes the request loops once samples are queued
        self.stop = stop
        self.templates = TemplateProcess(timeout_s=settings.prepare_timeout_s, max_mb=settings.prepare_max_mb)
        self._facts: OrderedDict[str, TemplateFacts] = OrderedDict()
        self.health = PreparerHealth()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    busy = self.step()
                except repo.LeaseLost:
                    raise
                except Exception as exc:  # the thread must outlive any one failure; claims are released at restart
                    log.exception("preparing conversations failed")
                    self.health.failures += 1
                    self.health.set("failing", f"{type(exc).__name__}: {str(exc)[:300]}")
                    self.stop.wait(POLL_S)
                    continue
                if not busy:
                    self.health.set("idle")
                    self.stop.wait(POLL_S)
        finally:
            self.templates.close()

    def step(self) -> bool:
        """Prepare one batch of the oldest job with conversations left; whether there was one."""
        # What model the server runs (whose template, which jobs), as the request loops last checked it:
        # the preparer never checks the server itself, whose verdict those loops report.
        model_key = Serves.of(self.server.layers, self.server.model_info).model
        said = {"regenerates": self.server.regenerates, "applies_seed": self.server.applies_seed}
        for job_id, raw in self.db.run(lambda s: repo.jobs_to_prepare(s, model_key)):
            if not prepares(said, raw):
                continue  # its answers need a server that generates them (with its seed): the job says so
            options = JobOptions.model_validate(raw or {})
            folder = options.tokenizer or self._model_path()
            if folder is None:
                continue  # the server has not said its model yet
            if not self._may_load(job_id, folder):
                continue
            abort = _JobAbort(self.stop, self.db, job_id)
            facts = self._template_facts(job_id, folder, abort)
            if facts is None:
                continue
            if options.tokenizer is None:  # rendered for this worker's model: the job is that model's
                self.db.run(lambda s, j=job_id: repo.pin_job_model(s, j, model_key))  # type: ignore[misc]
            batch = self.db.run(lambda s, j=job_id: repo.claim_preparing(s, j, self.identity, BATCH))  # type: ignore[misc]
            if not batch:
                continue
            self._prepare_batch(job_id, batch, folder, facts, options, abort)
            return True
        return False

    def _prepare_batch(
        self,
        job_id: str,
        batch: list[repo.ToPrepare],
        folder: str,
        facts: TemplateFacts,
        options: JobOptions,
        abort: _JobAbort,
    ) -> None:
        """Prepare and store one claimed batch; its samples left unstored are released."""
        if self.health.state != "failing":  # a retry stays failing until it gets through: no flapping
            self.health.set("preparing")
        said = {"applies_seed": self.server.applies_seed}
        if ignores_seed(said, options.model_dump(mode="json")):
            self.db.run(lambda s: repo.warn_job(s, job_id, SEED_IGNORED))
        try:
            results = self._prepare(batch, folder, facts, options, abort)
            self._store(job_id, results)
        except BaseException:
            self._release(batch)  # what was not stored is prepared again, here or by another writer
            raise
        self.health.set("preparing")
        self._release([item for item in batch if item.pk not in {r.pk for r in results}])
        self.health.prepared += len(results)
        if any(r.state == SampleState.QUEUED for r in results):
            self.queued()
        self.finisher.finish(job_id)  # a last batch that queued nothing ends its job here

    def _template_facts(self, job_id: str, folder: str, abort: _JobAbort) -> TemplateFacts | None:
        """The job's template, loaded; None when it cannot be (the job then fails with the reason) or the
        job was cancelled meanwhile."""
        facts = self._facts.get(folder)
        if facts is not None:
            self._facts.move_to_end(folder)
            return facts
        try:
            facts = self.templates.facts(folder, abort)
        except RenderFailed as exc:
            if exc.code == "aborted":
                return None
            reason = f"tokenizer: the chat template could not be loaded: {exc}{_bound(exc)}"
        except ChatTemplateError as exc:
            reason = f"tokenizer: cannot render conversations with it: {exc}"
        else:
            self._facts[folder] = facts
            while len(self._facts) > FACTS_KEPT:
                self._facts.popitem(last=False)
            return facts
        log.warning("job %s: %s", job_id, reason)
        self.db.run(lambda s: repo.fail_job(s, job_id, reason))
        self.finisher.finish(job_id)
        return None

    def _may_load(self, job_id: str, folder: str) -> bool:
        """Whether this writer may load the job's tokenizer folder: its server's model path, or a folder
        under --tokenizer-roots with its symbolic links followed (the API checked the text only). A job
        that names another fails, saying the same whether or not the folder exists."""
        if folder == self._model_path() or tokenizer_within_roots(folder, self.settings.tokenizer_root_list()):
            return True
        reason = (
            f"tokenizer: {folder} is neither this writer's model path nor under its --tokenizer-roots "
            "(symbolic links followed)"
        )
        log.warning("job %s: %s", job_id, reason)
        self.db.run(lambda s: repo.fail_job(s, job_id, reason))
        self.finisher.finish(job_id)
        return False

    def _model_path(self) -> str | None:
        path = self.server.model_info.get("model_path")
        return str(path) if path else None

    def _prepare(
        self,
        batch: list[repo.ToPrepare],
        folder: str,
        facts: TemplateFacts,
        options: JobOptions,
        abort: _JobAbort,
    ) -> list[repo.Prepared]:
        """What became of each sample of the batch, in order, up to the first one not prepared because
        the job was cancelled or the writer is stopping (those are given back)."""
        if options.regenerate is not None:
            return asyncio.run(self._regenerate(batch, folder, facts, options, abort))
        results = []
        limit, _ = self._length_limit(options)  # what is cut off needs no turns found (hsx.chat.spans)
        for item in batch:
            if abort():
                break
            try:
                rendered = self.templates.render(folder, _messages(item), options.loss, abort, limit)
            except RenderFailed as exc:
                if exc.code == "aborted":
                    break
                results.append(_failed(item.pk, exc))
                continue
            except ConversationError as exc:
                results.append(_invalid(item.pk, exc, options))
                continue
            except ChatTemplateError as exc:  # the folder changed under a running job
                results.append(repo.Prepared(item.pk, SampleState.FAILED, reason=f"tokenizer: {exc}"))
                continue
            results.append(self._fitted(item.pk, rendered, options, conversation=None))
        return results

    def _fitted(
        self, pk: int, rendered: RenderedIds, options: JobOptions, *, conversation: str | None
    ) -> repo.Prepared:
        """The rendered sample under the job's length policy: queued (cut to fit under truncate), skipped
        or failed; skipped as well when no token of it is left for the loss (a trainer would learn
        nothing from it)."""
        n = len(rendered.input_ids)
        limit, which = self._length_limit(options)
        ids, mask = rendered.input_ids, rendered.loss_mask
        truncated_from = None
        if limit is not None and n > limit:
            # A render with a limit tokenizes a long text only so far (hsx.chat.prefix): n is then a floor.
            why = f"too_long: {n if rendered.whole else f'at least {n}'} tokens exceed {which} of {limit}"
            if options.length_policy == "skip":
                return repo.Prepared(pk, SampleState.SKIPPED, reason=why, conversation=conversation)
            if options.length_policy == "reject":
                return repo.Prepared(pk, SampleState.FAILED, reason=why, conversation=conversation)
            kept = kept_tokens(mask, limit, options.length_policy)
            ids, mask, truncated_from = ids[:kept], mask[:kept], n
        if options.loss != "all" and not mask.any():
            why = NO_LOSS_TOKENS + (
                f": cut from {n} to {len(ids)} tokens (at most {limit}), no assistant token is left"
                if truncated_from is not None
                else ": the conversation has no assistant turn to learn from"
            )
            return repo.Prepared(pk, SampleState.SKIPPED, reason=why, conversation=conversation)
        return _queued(pk, ids, mask, conversation, truncated_from)

    def _length_limit(self, options: JobOptions) -> tuple[int | None, str]:
        """The most tokens a sample may keep, and what sets it: the job's max_length or the model server's
        limit, whichever is less (a longer prompt would only be refused by the server)."""
        server = self.server.limits.max_tokens
        if server is not None and (options.max_length is None or server < options.max_length):
            return server, "the model server's limit"
        return options.max_length, "max_length"

    async def _regenerate(
        self,
        batch: list[repo.ToPrepare],
        folder: str,
        facts: TemplateFacts,
        options: JobOptions,
        abort: _JobAbort,
    ) -> list[repo.Prepared]:
        spec = options.regenerate
        assert spec is not None
        sampling = Sampling(spec.max_new_tokens, spec.temperature, spec.top_p, spec.seed)
        gate = asyncio.Semaphore(spec.concurrency)
        renderer = _ProcessRenderer(self.templates, folder, facts, abort)
        timeout = httpx.Timeout(self.settings.request_timeout_s)
        async with httpx.AsyncClient(base_url=self.settings.backend_url, timeout=timeout) as client:

            async def one(item: repo.ToPrepare) -> repo.Prepared | None:
                async with gate:
                    if abort():
                        return None
                    return await self._regenerate_one(client, renderer, item, sampling, options)

            tasks = [asyncio.ensure_future(one(item)) for item in batch]
            watch = asyncio.ensure_future(_cancel_on_abort(tasks, abort))
            try:
                done = await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                watch.cancel()
        for outcome in done:
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                raise outcome
        return [outcome for outcome in done if isinstance(outcome, repo.Prepared)]

    async def _regenerate_one(
        self,
        client: httpx.AsyncClient,
        renderer: _ProcessRenderer,
        item: repo.ToPrepare,
        sampling: Sampling,
        options: JobOptions,
    ) -> repo.Prepared | None:
        """One sample regenerated and fitted to the job's length policy; None when stopped (aborted)."""
        try:
            limit, _ = self._length_limit(options)
            new = await regenerate(client, renderer, _messages(item), sampling, options.loss, limit)
        except RenderFailed as exc:
            return None if exc.code == "aborted" else _failed(item.pk, exc)
        except ConversationError as exc:
            return _invalid(item.pk, exc, options)
        except ChatTemplateError as exc:
            return repo.Prepared(item.pk, SampleState.FAILED, reason=f"tokenizer: {exc}")
        except GenerationUnavailable as exc:
            # The server's outage, not the conversation's: given back unspent, as a sample's request is, and
            # nothing is generated until the request loops find the server ready again.
            log.warning("regenerating %s: model server unavailable (%s); given back", item.pk, exc)
            self.server.lost()
            return None
        except (RegenerationError, ValueError, KeyError) as exc:
            return repo.Prepared(item.pk, SampleState.FAILED, reason=f"regenerate: {type(exc).__name__}: {exc}")
        # Generation, and the template's pieces, stop once the sample is over the limit: its count is a floor.
        rendered = RenderedIds(new.input_ids, new.loss_mask, whole=limit is None or len(new.input_ids) <= limit)
        return self._fitted(item.pk, rendered, options, conversation=json.dumps(new.messages))

    def _store(self, job_id: str, results: list[repo.Prepared]) -> None:
        """Store the batch; when that fails, each sample alone, so that one the database refuses fails with
        the reason and holds none of the others."""
        try:
            self.db.run(lambda s: repo.store_prepared(s, job_id, self.identity, results))
            return
        except repo.LeaseLost:
            raise
        except Exception as exc:
            log.warning(
                "job %s: storing %d prepared samples at once failed (%s); one by one now", job_id, len(results), exc
            )
        for result in results:
            try:
                self.db.run(lambda s, r=result: repo.store_prepared(s, job_id, self.identity, [r]))  # type: ignore[misc]
            except repo.LeaseLost:
                raise
            except Exception as exc:
                why = f"store: the database refused the prepared sample: {type(exc).__name__}: {str(exc)[:300]}"
                failed = repo.Prepared(result.pk, SampleState.FAILED, reason=why)
                self.db.run(lambda s, f=failed: repo.store_prepared(s, job_id, self.identity, [f]))  # type: ignore[misc]

    def _release(self, items: list[repo.ToPrepare]) -> None:
        """Give back claimed samples still preparing (best effort: a writer's restart releases them too)."""
        if not items:
            return
        pks = [item.pk for item in items]
        try:
            self.db.run(lambda s: repo.release_preparing(s, self.identity, pks))
        except Exception:
            log.warning("could not give back %d claimed conversations; they are released at restart", len(pks))


class _ProcessRenderer:
    """hsx.chat.regenerate's Renderer over the template process: one call at a time, off the event loop."""

    def __init__(self, templates: TemplateProcess, folder: str, facts: TemplateFacts, abort: _JobAbort):
        self.templates, self.folder, self.abort = templates, folder, abort
        self.stop_ids, self.end_of_turn = facts.stop_ids, facts.end_of_turn
        self._lock = asyncio.Lock()

    async def continuation(
        self, messages: list[Message], *, generation_prompt: bool, limit: int | None = None
    ) -> list[int]:
        async with self._lock:
            return await asyncio.to_thread(
                self.templates.continuation,
                self.folder,
                messages,
                generation_prompt=generation_prompt,
                abort=self.abort,
                limit=limit,
            )

    async def decode(self, ids: list[int]) -> str:
        async with self._lock:
            return await asyncio.to_thread(self.templates.decode, self.folder, ids, self.abort)


async def _cancel_on_abort(tasks: Sequence[asyncio.Future[repo.Prepared | None]], abort: _JobAbort) -> None:
    """Generation in flight stops once the job is cancelled or the writer stops."""
    while not all(t.done() for t in tasks):
        if await asyncio.to_thread(abort):
            for t in tasks:
                t.cancel()
            return
        await asyncio.sleep(0.2)


def _messages(item: repo.ToPrepare) -> list[Message]:
    """The sample's turns; a record that does not parse is an invalid conversation, as the template would
    find an empty one."""
    try:
        turns = json.loads(item.conversation)
    except ValueError as exc:
        raise ConversationError("messages", f"the stored conversation does not parse: {exc}") from exc
    return list(turns) if isinstance(turns, list) else []


def _invalid(pk: int, exc: ConversationError, options: JobOptions) -> repo.Prepared:
    state = SampleState.SKIPPED if options.on_invalid == "skip" else SampleState.FAILED
    return repo.Prepared(pk, state, reason=f"invalid: {exc.field}: {exc.message}")


def _failed(pk: int, exc: RenderFailed) -> repo.Prepared:
    code = {"timeout": "prepare_timeout", "memory": "prepare_memory"}.get(exc.code, "prepare_failed")
    return repo.Prepared(pk, SampleState.FAILED, reason=f"{code}: {exc.message}{_bound(exc)}")


def _bound(exc: RenderFailed) -> str:
    """The setting behind a render stopped at its memory bound, for the operator who reads the reason."""
    return "; --prepare-max-mb sets that bound" if exc.code == "memory" else ""


def _queued(
    pk: int, ids: np.ndarray, mask: np.ndarray, conversation: str | None, truncated_from: int | None
) -> repo.Prepared:
    ids = np.asarray(ids, dtype="<i4")
    mask = np.asarray(mask, dtype=np.uint8)
    packed_mask = None if mask.all() else mask.tobytes()
    return repo.Prepared(
        pk,
        SampleState.QUEUED,
        ids.tobytes(),
        packed_mask,
        len(ids),
        conversation=conversation,
        truncated_from=truncated_from,
    )

"""A writer's preparer: turns a job's conversation samples into token ids before extraction.

It runs on a thread of its own beside the request loops, so that the model server never waits for
a chat template: it claims a batch of a job's `preparing` samples, regenerates their answers with
the model server when the job asks (several requests in flight: generation is decode-bound),
renders them with the model's own chat template (hsx.chat), applies the job's length policy, and
queues them. The tokenizer is the job's `tokenizer` folder, or the model path the server reports;
one that cannot be loaded fails the job, saying why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable

import httpx
import numpy as np

from hsx.chat.formats import ConversationError, Message
from hsx.chat.regenerate import Sampling, regenerate
from hsx.chat.render import ChatTemplate, ChatTemplateError, Rendered
from hsx.config import Settings
from hsx.db import repository as repo
from hsx.extraction.database import Database
from hsx.extraction.finishing import JobFinisher
from hsx.extraction.server_watch import ServerWatch
from hsx.matching import Serves
from hsx.states import SampleState
from hsx.wire import JobOptions

log = logging.getLogger("hsx.writer")

BATCH = 64  # samples claimed at a time: small enough that a restart redoes little
POLL_S = 1.0


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
    ):
        self.settings = settings
        self.identity = identity
        self.db = db
        self.server = server
        self.finisher = finisher
        self.queued = queued  # wakes the request loops once samples are queued
        self._templates: dict[str, ChatTemplate] = {}
        self.prepared = 0  # samples this preparer moved on, for its status

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                if not self.step():
                    stop.wait(POLL_S)
            except repo.LeaseLost:
                raise
            except Exception:  # the thread must outlive any one failure; the claim is released at restart
                log.exception("preparing conversations failed")
                stop.wait(POLL_S)

    def step(self) -> bool:
        """Prepare one batch of the oldest job with conversations left; whether there was one."""
        # What model the server runs (whose template, which jobs), as the request loops last checked it:
        # the preparer never checks the server itself, whose verdict those loops report.
        model_key = Serves.of(self.server.layers, self.server.model_info).model
        for job_id, raw in self.db.run(lambda s: repo.jobs_to_prepare(s, model_key)):
            options = JobOptions.model_validate(raw or {})
            template = self._template(job_id, options)
            if template is None:
                continue
            if options.tokenizer is None:  # rendered for this worker's model: the job is that model's
                self.db.run(lambda s, j=job_id: repo.pin_job_model(s, j, model_key))  # type: ignore[misc]
            batch = self.db.run(lambda s, j=job_id: repo.claim_preparing(s, j, self.identity, BATCH))  # type: ignore[misc]
            if not batch:
                continue
            results = self._prepare(batch, template, options)
            self.db.run(lambda s, j=job_id, r=results: repo.store_prepared(s, j, self.identity, r))  # type: ignore[misc]
            self.prepared += len(results)
            if any(r.state == SampleState.QUEUED for r in results):
                self.queued()
            self.finisher.finish(job_id)  # a last batch that queued nothing ends its job here
            return True
        return False

    def _template(self, job_id: str, options: JobOptions) -> ChatTemplate | None:
        """The job's chat template; None while the model server has not said its model yet, or when it
        cannot be loaded (the job then fails with the reason)."""
        path = options.tokenizer or self._model_path()
        if path is None:
            return None
        template = self._templates.get(path)
        if template is not None:
            return template
        try:
            template = ChatTemplate.load(path)
        except ChatTemplateError as exc:
            reason = f"tokenizer: cannot render conversations with {path}: {exc}"
            log.warning("job %s: %s", job_id, reason)
            self.db.run(lambda s: repo.fail_job(s, job_id, reason))
            self.finisher.finish(job_id)
            return None
        self._templates[path] = template
        return template

    def _model_path(self) -> str | None:
        path = self.server.model_info.get("model_path")
        return str(path) if path else None

    def _prepare(self, batch: list[repo.ToPrepare], template: ChatTemplate, options: JobOptions) -> list[repo.Prepared]:
        conversations: list[list[Message] | None] = [json.loads(item.conversation) for item in batch]
        regenerated: list[list[Message] | str | None] = [None] * len(batch)
        if options.regenerate is not None:
            regenerated = asyncio.run(self._regenerate(conversations, template, options))
        results = []
        for item, turns, new in zip(batch, conversations, regenerated):
            if isinstance(new, str):  # generation failed: the sample fails with the reason
                results.append(repo.Prepared(item.pk, SampleState.FAILED, reason=new))
                continue
            messages = new if new is not None else turns
            results.append(self._render(item.pk, messages or [], template, options, regenerated=new is not None))
        return results

    def _render(
        self, pk: int, messages: list[Message], template: ChatTemplate, options: JobOptions, *, regenerated: bool
    ) -> repo.Prepared:
        try:
            rendered = template.render(messages, options.loss)
        except ConversationError as exc:
            state = SampleState.SKIPPED if options.on_invalid == "skip" else SampleState.FAILED
            return repo.Prepared(pk, state, reason=f"invalid: {exc.field}: {exc.message}")
        conversation = json.dumps(messages) if regenerated else None
        limit = options.max_length
        if limit is not None and len(rendered.input_ids) > limit:
            why = f"too_long: {len(rendered.input_ids)} tokens exceed max_length of {limit}"
            if options.length_policy == "skip":
                return repo.Prepared(pk, SampleState.SKIPPED, reason=why, conversation=conversation)
            if options.length_policy == "reject":
                return repo.Prepared(pk, SampleState.FAILED, reason=why, conversation=conversation)
            rendered = Rendered(rendered.input_ids[:limit], rendered.loss_mask[:limit], rendered.text)
        return _queued(pk, rendered, conversation)

    async def _regenerate(
        self, conversations: list[list[Message] | None], template: ChatTemplate, options: JobOptions
    ) -> list[list[Message] | str | None]:
        assert options.regenerate is not None
        spec = options.regenerate
        sampling = Sampling(spec.max_new_tokens, spec.temperature, spec.top_p, spec.seed)
        gate = asyncio.Semaphore(spec.concurrency)
        timeout = httpx.Timeout(self.settings.request_timeout_s)
        async with httpx.AsyncClient(base_url=self.settings.backend_url, timeout=timeout) as client:

            async def one(turns: list[Message] | None) -> list[Message] | str:
                async with gate:
                    try:
                        messages, _ids = await regenerate(client, template, turns or [], sampling)
                    except (httpx.HTTPError, ValueError, KeyError) as exc:
                        return f"regenerate: {type(exc).__name__}: {exc}"
                    return messages

            return list(await asyncio.gather(*(one(t) for t in conversations)))


def _queued(pk: int, rendered: Rendered, conversation: str | None) -> repo.Prepared:
    ids = np.asarray(rendered.input_ids, dtype="<i4")
    mask = np.asarray(rendered.loss_mask, dtype=np.uint8)
    packed_mask = None if mask.all() else mask.tobytes()
    return repo.Prepared(pk, SampleState.QUEUED, ids.tobytes(), packed_mask, len(ids), conversation=conversation)

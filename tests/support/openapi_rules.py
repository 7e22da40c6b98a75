"""Schemathesis hooks (loaded through SCHEMATHESIS_HOOKS) for the API's rules that JSON Schema cannot
state: a request that fits the document can still be refused with a 422 for one of these, as the
operations' descriptions say. Each positive case (one the document calls valid) is brought in line
with them, so that positive_data_acceptance still fails on any other 422; negative cases are sent
as generated.

- a sample is token ids or a conversation, not both, and a loss_mask goes with token ids, one value per id
  (here every sample is made token ids: a conversation's turns must have known roles and text, which the
  document cannot state);
- a job that regenerates answers takes conversations, and an NDJSON body's regenerate_<field> query
  parameters go with regenerate_max_new_tokens (here: none regenerates);
- a job's tokenizer lies under the service's tokenizer roots (here: none is named, the test's service has no
  roots);
- a sample longer than max_length refuses the request unless length_policy is truncate or skip (here:
  truncate);
- sample ids are unique within a job (an absent id is the sample's index);
- a job's layers are ascending;
- input_path names a file under the service's input root (the test puts INPUT_FILE there);
- an Idempotency-Key used again must come with the same body, byte for byte;
- a samples page's `after` names a sample of that job;
- retention acked and max_unread_bytes need consumers, each named once (the query's comma-separated names
  each within the names' limit), and max_unread_bytes is at least one
  shard (--shard-max-bytes; here every consumer-paced job gets a limit far above it);
- the commit feed's `after` and an acknowledged `seq` are positions the job has recorded (here: 0, nothing is
  recorded), an acknowledging rank is below its world_size and its epoch not past its epochs; a feed
  request's `wait` is cut to half a second (a valid wait of a minute on a job that records nothing would hold
  the run for that minute).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import schemathesis

from hsx.names import MAX_LENGTH
from hsx.wire import MAX_CONSUMERS

INPUT_FILE = "fuzz.jsonl"
IDEMPOTENCY_KEY_MAX = 255


# Registered for the operations these rules concern only: with a case hook, schemathesis 4.32 fails
# hypothesis' filter_too_much health check on operations whose one input is a path parameter.
@schemathesis.hook("map_case").apply_to(operation_id=["create_job", "list_samples", "list_samples_head"])
def follow_rules(context: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return case
    if isinstance(case.body, dict):
        _follow_job_rules(case.body)
        _key_per_body(case.headers, case.body)
    if case.query:
        case.query.pop("after", None)
        for key in [k for k in case.query if k.startswith("regenerate_")]:
            case.query.pop(key)
        case.query.pop("tokenizer", None)
        if case.query.get("max_length") is not None and case.query.get("length_policy") in (None, "reject"):
            case.query["length_policy"] = "truncate"
        _follow_feed_rules(case.query, query=True)
    return case


def _follow_job_rules(body: dict[str, Any]) -> None:
    samples = body.get("samples")
    if isinstance(samples, list):
        for sample in samples:
            sample.pop("messages", None)
            sample.pop("conversations", None)
            if not isinstance(sample.get("input_ids"), list) or not sample["input_ids"]:
                sample["input_ids"] = [1]
            ids, mask = sample["input_ids"], sample.get("loss_mask")
            if isinstance(mask, list) and len(mask) != len(ids):
                sample["loss_mask"] = (mask + [1] * len(ids))[: len(ids)]
        effective = [str(s["id"]) if s.get("id") is not None else str(i) for i, s in enumerate(samples)]
        if len(set(effective)) != len(effective):
            for i, sample in enumerate(samples):
                sample["id"] = str(i)
    body.pop("regenerate", None)
    body.pop("tokenizer", None)
    if body.get("max_length") is not None and body.get("length_policy") in (None, "reject"):
        body["length_policy"] = "truncate"
    layers = body.get("layers")
    if isinstance(layers, list):
        # Ids ascending, and sets that read layer L on one side of the final norm (a job stores it once).
        post = [x for x in layers if isinstance(x, str) and not x.endswith("_pre_norm")]
        pre = [x for x in layers if isinstance(x, str) and x.endswith("_pre_norm")]
        body["layers"] = [*(post or pre), *sorted(x for x in layers if not isinstance(x, str))]
    if isinstance(body.get("input_path"), str):
        body["input_path"] = INPUT_FILE
    _follow_feed_rules(body)


def _follow_feed_rules(options: dict[str, Any], *, query: bool = False) -> None:
    """A job's consumers, retention and back-pressure, in a JSON body or an NDJSON body's `query`."""
    consumers = options.get("consumers")
    if isinstance(consumers, str):  # the query's comma-separated names, each within the names' limit
        consumers = [c[:MAX_LENGTH] for c in consumers.split(",") if c][:MAX_CONSUMERS]
    if isinstance(consumers, list):
        consumers = list(dict.fromkeys(consumers)) or None
    wants = options.get("retention") == "acked" or options.get("max_unread_bytes") is not None
    if wants and not consumers:
        consumers = ["train"]
    if consumers is None:
        options.pop("consumers", None)
    else:
        options["consumers"] = ",".join(consumers) if query else consumers
    if options.get("max_unread_bytes") is not None:
        options["max_unread_bytes"] = 2**40


@schemathesis.hook("map_case").apply_to(operation_id=["list_shards", "list_shards_head", "acknowledge"])
def follow_feed_positions(context: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return case
    if case.query:
        case.query.pop("after", None)
        if case.query.get("wait") is not None:
            case.query["wait"] = min(float(case.query["wait"]), 0.5)
    if isinstance(case.body, dict):
        case.body["seq"] = 0
        for low, high in (("rank", "world_size"), ("epoch", "epochs")):
            value, bound = case.body.get(low), case.body.get(high, 1)
            if isinstance(value, (int, float)) and isinstance(bound, (int, float)) and value >= bound:
                case.body[low] = bound - 1 if low == "rank" else bound
    return case


def _key_per_body(headers: dict[str, Any] | None, body: dict[str, Any]) -> None:
    key = (headers or {}).get("idempotency-key")
    if isinstance(key, str):
        # The service compares the body's bytes: the same keys in another order are another request.
        digest = hashlib.sha256(json.dumps(body).encode()).hexdigest()[:16]
        headers["idempotency-key"] = f"{key[: IDEMPOTENCY_KEY_MAX - 17]}-{digest}"  # type: ignore[index]

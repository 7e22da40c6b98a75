"""From a chat dataset to stored hidden states, as a user runs it: a JSONL file of ShareGPT conversations
submitted with `hsx submit ... --max-length N --wait` to a service in front of the reference server, whose
model folder carries a tokenizer and a Llama-3-style chat template. Every stored sample's ids equal
transformers' own `apply_chat_template`, its loss mask covers exactly the assistant's answers and their
end-of-turn tokens, over-long conversations are truncated, invalid lines counted as skipped, and the
tensors are the model's for those ids. Then the same with regenerated answers."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from hsx.chat import ChatTemplate
from hsx.chat.regenerate import cut_at_stop
from hsx.exports import export_job
from hsx.manifest import load_manifest, read_sample
from tests.support.chat import LLAMA3, apply_chat_template_ids, save_chat_tokenizer
from tests.support.procs import hsx_command
from tests.support.stack import VOCAB, Recompute, make_checkpoint, start_reference, start_service

WORDS = [
    "answer",
    "one",
    "two",
    "three",
    "question",
    "hello",
    "there",
    "how",
    "are",
    "you",
    "the",
    "quick",
    "brown",
    "fox",
    "what",
    "is",
    "a",
    "model",
]
MAX_LENGTH = 96


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The tiny checkpoint with a tokenizer and chat template in its folder, as a model ships."""
    folder = make_checkpoint(tmp_path_factory.mktemp("chat-model"))
    return save_chat_tokenizer(folder, LLAMA3, vocab_size=VOCAB)


def sharegpt(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))

    out = []
    for i in range(n):
        turns = [{"from": "system", "value": text()}] if i % 5 == 0 else []
        for _ in range(rng.randint(1, 3)):
            turns += [{"from": "human", "value": text()}, {"from": "gpt", "value": text()}]
        out.append({"id": f"c{i}", "conversations": turns, "source": "made-up"})
    return out


def as_messages(turns: list[dict]) -> list[dict]:
    role = {"system": "system", "human": "user", "gpt": "assistant"}
    return [{"role": role[t["from"]], "content": t["value"]} for t in turns]


def hsx_cli(url: str, *argv: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HSX_URL": url}
    return subprocess.run(hsx_command() + [str(a) for a in argv], capture_output=True, text=True, env=env, timeout=900)


def first_answer_at(tokenizer, messages: list[dict]) -> int:
    """Where the first assistant answer's tokens start: the length of what comes before it, with the
    header a model is given to write it."""
    first = next(k for k, m in enumerate(messages) if m["role"] == "assistant")
    return len(apply_chat_template_ids(tokenizer, messages[:first], add_generation_prompt=True))


def expected_mask(messages: list[dict]) -> str:
    """What the mask must select, independently of hsx: each assistant answer as the template trims it,
    followed by its end-of-turn token."""
    return "".join(m["content"].strip() + "<|eot_id|>" for m in messages if m["role"] == "assistant")


def check_stored(job_dir, manifest, conversations, no_loss, tokenizer, recompute) -> int:
    """Every stored sample's ids are the template's (cut to MAX_LENGTH, saying so), its mask the assistant's
    answers, and every 100th sample's tensors the model's; returns how many were cut."""
    truncated = 0
    entries = {s.id: s for s in manifest.samples}
    for i, conversation in enumerate(c for c in conversations if c["id"] not in no_loss):
        messages = as_messages(conversation["conversations"])
        full = apply_chat_template_ids(tokenizer, messages)
        stored = read_sample(job_dir, manifest, conversation["id"])
        ids, mask = stored["input_ids"].tolist(), stored["loss_mask"].tolist()
        assert ids == full[:MAX_LENGTH], conversation["id"]
        cut = len(full) > MAX_LENGTH
        assert entries[conversation["id"]].truncated_from == (len(full) if cut else None), conversation["id"]
        truncated += cut
        if not cut:
            kept = [t for t, m in zip(ids, mask) if m]
            assert tokenizer.decode(kept) == expected_mask(messages), conversation["id"]
        if i % 100 == 0:  # the tensors are the model's for exactly these ids
            truth = recompute(ids)
            for layer in manifest.layers or []:
                assert torch.equal(stored[f"layer_{layer}"], truth[layer])
    return truncated


def check_specforge_export(job_dir, manifest, out) -> None:
    """SpecForge's offline files carry the template's ids and the assistant mask as its trainer reads them."""
    export_job("specforge", job_dir, out)
    for ckpt in sorted(out.rglob("data_*.ckpt"))[:50]:
        data = torch.load(ckpt, weights_only=True)
        stored = read_sample(job_dir, manifest, manifest.samples[int(ckpt.stem.split("_")[1])].id)
        assert data["input_ids"].tolist() == stored["input_ids"].tolist()
        assert data["loss_mask"].tolist() == stored["loss_mask"].tolist()


def test_a_sharegpt_file_becomes_a_finished_job_with_the_templates_ids_and_masks(tmp_path, chat_model, database_url):
    conversations = sharegpt(1000, seed=3)
    path = tmp_path / "conversations.jsonl"
    lines = [json.dumps(c) for c in conversations]
    lines.insert(10, "{broken json")
    lines.insert(500, json.dumps({"id": "empty", "conversations": []}))
    path.write_text("\n".join(lines) + "\n")
    ref = start_reference(tmp_path, chat_model)
    svc = start_service(tmp_path, database_url, backend_url=ref.url, dump_root=ref.dump_root)
    try:
        done = hsx_cli(
            svc.url,
            "submit",
            path,
            "--name",
            "x",
            "--max-length",
            MAX_LENGTH,
            "--length-policy",
            "truncate",
            "--on-invalid",
            "skip",
            "--wait",
            "--json",
        )
        assert done.returncode == 0, done.stderr[-3000:]
        job = json.loads(done.stdout.strip().splitlines()[-1])
        assert job["state"] == "succeeded", job
        tokenizer = AutoTokenizer.from_pretrained(chat_model, local_files_only=True)
        # A conversation whose first answer starts past the cut keeps no token to learn from: skipped.
        no_loss = {
            c["id"] for c in conversations if first_answer_at(tokenizer, as_messages(c["conversations"])) >= MAX_LENGTH
        }
        counts = job["counts"]
        expected = (1002, 1000 - len(no_loss), 2 + len(no_loss), 0)
        assert (counts["total"], counts["succeeded"], counts["skipped"], counts["failed"]) == expected
        skipped = svc.get(f"/v1/jobs/{job['id']}/samples", params={"state": "skipped", "limit": 1000}).json()["data"]
        assert sorted(s["id"] for s in skipped) == sorted(["empty", "invalid-10", *no_loss])
        assert all(
            s["last_error"].startswith("no_loss_tokens: " if s["id"] in no_loss else "invalid: ") for s in skipped
        )

        job_dir = svc.output_root / job["id"]
        manifest = load_manifest(job_dir)
        assert [s.id for s in manifest.samples] == [c["id"] for c in conversations if c["id"] not in no_loss]
        truncated = check_stored(job_dir, manifest, conversations, no_loss, tokenizer, Recompute(chat_model))
        assert truncated > 0, "some conversations must be longer than --max-length"
        assert job["counts"]["truncated"] == manifest.num_truncated == truncated
        cut = next(s for s in manifest.samples if s.truncated_from)
        assert svc.get(f"/v1/jobs/{job['id']}/samples/{cut.id}").json()["truncated_from"] == cut.truncated_from
        assert job["tokens"]["total"] == sum(s.num_tokens for s in manifest.samples)
        detail = svc.get(f"/v1/jobs/{job['id']}/samples/c1").json()
        assert detail["messages"] == as_messages(conversations[1]["conversations"])
        check_specforge_export(job_dir, manifest, tmp_path / "sf")
    finally:
        svc.stop()
        ref.stop()


def test_regenerated_answers_are_the_models_own_ids_and_their_hidden_states_are_stored(
    tmp_path, chat_model, database_url
):
    conversations = [{"id": f"r{i}", "messages": as_messages(c["conversations"])} for i, c in enumerate(sharegpt(6, 9))]
    ref = start_reference(tmp_path, chat_model)
    svc = start_service(tmp_path, database_url, backend_url=ref.url, dump_root=ref.dump_root)
    try:
        resp = svc.post_job({"name": "regen", "samples": conversations, "regenerate": {"max_new_tokens": 5}})
        assert resp.status_code == 202, resp.text
        job = svc.wait_job(resp.json()["id"])
        assert job["state"] == "succeeded", job
        tokenizer = AutoTokenizer.from_pretrained(chat_model, local_files_only=True)
        template = ChatTemplate.load(chat_model)
        model = Recompute(chat_model).model
        job_dir = svc.output_root / job["id"]
        manifest = load_manifest(job_dir)
        recompute = Recompute(chat_model)
        for conversation in conversations:
            regenerated = svc.get(f"/v1/jobs/{job['id']}/samples/{conversation['id']}").json()["messages"]
            assert [m["role"] for m in regenerated] == [m["role"] for m in conversation["messages"]]
            stored = read_sample(job_dir, manifest, conversation["id"])
            ids, mask = stored["input_ids"].tolist(), stored["loss_mask"].tolist()
            first = next(k for k, m in enumerate(regenerated) if m["role"] == "assistant")
            answers = [m for m in regenerated if m["role"] == "assistant"]
            starts = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
            assert len(starts) == len(answers)
            assert ids[: starts[0]] == apply_chat_template_ids(
                tokenizer, regenerated[:first], add_generation_prompt=True
            )
            # Each answer is, id for id, the model's greedy continuation of exactly the ids stored before it.
            for start, message in zip(starts, answers):
                with torch.inference_mode():
                    out = model.generate(torch.tensor([ids[:start]]), max_new_tokens=5, do_sample=False)
                generated = cut_at_stop(out[0, start:].tolist(), template.eos_ids)
                assert ids[start : start + len(generated)] == generated
                assert mask[start : start + len(generated)] == [1] * len(generated)
                stopped = generated[-1] in template.eos_ids
                assert message["finish"] == ("stop" if stopped else "length")
                assert message["content"] == template.decode(generated)
            truth = recompute(ids)
            for layer in manifest.layers or []:
                assert torch.equal(stored[f"layer_{layer}"], truth[layer])
    finally:
        svc.stop()
        ref.stop()


def test_a_server_outage_while_answers_are_regenerated_spends_nothing(tmp_path, chat_model):
    """The server answers 503 for a few seconds just as regeneration starts: the conversations are given back
    unspent, as a sample's request is, and regenerated once the server is back; none fails."""
    conversations = [{"id": f"o{i}", "messages": as_messages(c["conversations"])} for i, c in enumerate(sharegpt(4, 3))]
    ref = start_reference(tmp_path, chat_model, extra=["--enable-fault-injection"])
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=ref.url, dump_root=ref.dump_root)
    met = "model server unavailable (POST /generate: HTTP 503); given back"
    try:
        httpx.post(f"{ref.url}/admin/faults", json={"unavailable": {"seconds": 300}}).raise_for_status()
        resp = svc.post_job({"name": "outage", "samples": conversations, "regenerate": {"max_new_tokens": 5}})
        assert resp.status_code == 202, resp.text
        deadline = time.monotonic() + 120
        while met not in svc.proc.log():  # the preparer has met the outage (its template process started first)
            assert time.monotonic() < deadline, "regeneration never met the outage"
            time.sleep(0.2)
        waiting = svc.get(f"/v1/jobs/{resp.json()['id']}").json()
        assert waiting["counts"]["failed"] == 0 and waiting["counts"]["preparing"] == len(conversations), waiting
        httpx.delete(f"{ref.url}/admin/faults").raise_for_status()  # the server is back
        job = svc.wait_job(resp.json()["id"])
        assert job["state"] == "succeeded", job
        samples = svc.get(f"/v1/jobs/{job['id']}/samples").json()["data"]
        assert len(samples) == len(conversations), samples
        assert all(s["state"] == "succeeded" and s["attempts"] == 1 for s in samples), samples
    finally:
        svc.stop()
        ref.stop()


def test_truncate_turns_keeps_whole_answers(tmp_path, chat_model, database_url):
    """Under truncate_turns a conversation over max_length is cut after its last answer (end-of-turn token
    included) that ends within the limit, never inside one; one whose first answer does not fit is skipped."""
    tokenizer = AutoTokenizer.from_pretrained(chat_model, local_files_only=True)
    exchanges = [("question one", "answer one two three"), ("question two", "answer four five six seven")]
    messages = [m for q, a in exchanges for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
    full = apply_chat_template_ids(tokenizer, messages)
    first = apply_chat_template_ids(tokenizer, messages[:2])
    # the first answer ends where the second user turn's text begins: its end-of-turn token is the last mask 1
    first_end = next(k for k in range(len(first), 0, -1) if tokenizer.decode(first[:k]).endswith("<|eot_id|>"))
    limit = first_end + 3  # inside the second exchange
    assert limit < len(full)
    ref = start_reference(tmp_path, chat_model)
    svc = start_service(tmp_path, database_url, backend_url=ref.url, dump_root=ref.dump_root)
    try:
        body = {
            "max_length": limit,
            "length_policy": "truncate_turns",
            "samples": [{"id": "two", "messages": messages}, {"id": "tiny", "messages": messages[:1] + messages[1:2]}],
        }
        job = svc.wait_job(svc.post_job(body).json()["id"])
        assert job["state"] == "succeeded" and job["counts"]["truncated"] == 1, job
        manifest = load_manifest(svc.output_root / job["id"])
        stored = read_sample(svc.output_root / job["id"], manifest, "two")
        ids, mask = stored["input_ids"].tolist(), stored["loss_mask"].tolist()
        assert ids == full[:first_end] and mask[-1] == 1, "cut right after the first answer's end-of-turn token"
        assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "answer one two three<|eot_id|>"
        assert svc.get(f"/v1/jobs/{job['id']}/samples/two").json()["truncated_from"] == len(full)

        short = {**body, "max_length": first_end - 1, "samples": body["samples"][:1]}
        skipped = svc.wait_job(svc.post_job(short).json()["id"])
        only = svc.get(f"/v1/jobs/{skipped['id']}/samples/two").json()
        assert only["state"] == "skipped" and only["last_error"].startswith("no_loss_tokens: cut from"), only
    finally:
        svc.stop()
        ref.stop()


def test_a_seed_the_server_ignores_is_refused_or_run_with_a_warning_as_the_job_says(tmp_path, chat_model, database_url):
    """The reference server, like SGLang without --enable-deterministic-inference, applies no sampling seed."""
    conversations = [{"id": f"w{i}", "messages": as_messages(c["conversations"])} for i, c in enumerate(sharegpt(2, 4))]
    ref = start_reference(tmp_path, chat_model)
    svc = start_service(tmp_path, database_url, backend_url=ref.url, dump_root=ref.dump_root)
    try:
        deadline = time.monotonic() + 60
        while ((svc.get("/healthz").json().get("writer") or {}).get("server") or {}).get("applies_seed") is None:
            assert time.monotonic() < deadline, "the writer never said what its server is"
            time.sleep(0.2)
        assert svc.get("/healthz").json()["writer"]["server"]["applies_seed"] is False
        seeded = {"max_new_tokens": 4, "temperature": 0.7, "seed": 7}
        refused = svc.post_job({"samples": conversations, "regenerate": seeded})
        assert refused.status_code == 422, refused.text
        assert refused.json()["errors"][0]["field"] == "regenerate.seed"
        assert "seed_ignored to warn" in refused.json()["errors"][0]["message"]

        resp = svc.post_job({"samples": conversations, "regenerate": {**seeded, "seed_ignored": "warn"}})
        assert resp.status_code == 202, resp.text
        job = svc.wait_job(resp.json()["id"])
        assert job["state"] == "succeeded" and job["warning"].startswith("regenerate.seed was ignored"), job
        shown = hsx_cli(svc.url, "status", job["id"])
        assert shown.returncode == 0 and f"warning: {job['warning']}" in shown.stdout, shown.stdout
        assert svc.get(f"/v1/jobs/{job['id']}/manifest").json()["warning"] == job["warning"]

        greedy = svc.post_job({"samples": conversations, "regenerate": {"max_new_tokens": 4, "seed": 7}})
        assert greedy.status_code == 202, "a seed under greedy decoding changes nothing: never refused"
        greedy_job = svc.wait_job(greedy.json()["id"])
        assert greedy_job["warning"] is None
        assert svc.get(f"/v1/jobs/{greedy_job['id']}/manifest").json()["warning"] is None
    finally:
        svc.stop()
        ref.stop()

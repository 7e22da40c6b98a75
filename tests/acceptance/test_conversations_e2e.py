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

import pytest
import torch
from transformers import AutoTokenizer

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


def expected_mask(messages: list[dict]) -> str:
    """What the mask must select, independently of hsx: each assistant answer as the template trims it,
    followed by its end-of-turn token."""
    return "".join(m["content"].strip() + "<|eot_id|>" for m in messages if m["role"] == "assistant")


def test_a_sharegpt_file_becomes_a_finished_job_with_the_templates_ids_and_masks(tmp_path, chat_model):
    conversations = sharegpt(1000, seed=3)
    path = tmp_path / "conversations.jsonl"
    lines = [json.dumps(c) for c in conversations]
    lines.insert(10, "{broken json")
    lines.insert(500, json.dumps({"id": "empty", "conversations": []}))
    path.write_text("\n".join(lines) + "\n")
    ref = start_reference(tmp_path, chat_model)
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=ref.url, dump_root=ref.dump_root)
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
        counts = job["counts"]
        assert (counts["total"], counts["succeeded"], counts["skipped"], counts["failed"]) == (1002, 1000, 2, 0)
        skipped = svc.get(f"/v1/jobs/{job['id']}/samples", params={"state": "skipped"}).json()["data"]
        assert sorted(s["id"] for s in skipped) == ["empty", "invalid-10"]
        assert all(s["last_error"].startswith("invalid: ") for s in skipped)

        tokenizer = AutoTokenizer.from_pretrained(chat_model, local_files_only=True)
        job_dir = svc.output_root / job["id"]
        manifest = load_manifest(job_dir)
        assert [s.id for s in manifest.samples] == [c["id"] for c in conversations]
        recompute = Recompute(chat_model)
        truncated = 0
        for i, conversation in enumerate(conversations):
            messages = as_messages(conversation["conversations"])
            full = apply_chat_template_ids(tokenizer, messages)
            stored = read_sample(job_dir, manifest, conversation["id"])
            ids, mask = stored["input_ids"].tolist(), stored["loss_mask"].tolist()
            assert ids == full[:MAX_LENGTH], conversation["id"]
            truncated += len(full) > MAX_LENGTH
            if len(full) <= MAX_LENGTH:
                kept = [t for t, m in zip(ids, mask) if m]
                assert tokenizer.decode(kept) == expected_mask(messages), conversation["id"]
            if i % 100 == 0:  # the tensors are the model's for exactly these ids
                truth = recompute(ids)
                for layer in manifest.layers or []:
                    assert torch.equal(stored[f"layer_{layer}"], truth[layer])
        assert truncated > 0, "some conversations must be longer than --max-length"
        assert job["tokens"]["total"] == sum(s.num_tokens for s in manifest.samples)
        detail = svc.get(f"/v1/jobs/{job['id']}/samples/c1").json()
        assert detail["messages"] == as_messages(conversations[1]["conversations"])
        # SpecForge's offline files carry the template's ids and the assistant mask as its trainer reads them
        export_job("specforge", job_dir, tmp_path / "sf")
        for ckpt in sorted((tmp_path / "sf").rglob("data_*.ckpt"))[:50]:
            data = torch.load(ckpt, weights_only=True)
            index = int(ckpt.stem.split("_")[1])
            stored = read_sample(job_dir, manifest, conversations[index]["id"])
            assert data["input_ids"].tolist() == stored["input_ids"].tolist()
            assert data["loss_mask"].tolist() == stored["loss_mask"].tolist()
    finally:
        svc.stop()
        ref.stop()


def test_regenerated_answers_are_the_models_own_and_their_hidden_states_are_stored(tmp_path, chat_model):
    conversations = [{"id": f"r{i}", "messages": as_messages(c["conversations"])} for i, c in enumerate(sharegpt(6, 9))]
    ref = start_reference(tmp_path, chat_model)
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=ref.url, dump_root=ref.dump_root)
    try:
        resp = svc.post_job({"name": "regen", "samples": conversations, "regenerate": {"max_new_tokens": 5}})
        assert resp.status_code == 202, resp.text
        job = svc.wait_job(resp.json()["id"])
        assert job["state"] == "succeeded", job
        tokenizer = AutoTokenizer.from_pretrained(chat_model, local_files_only=True)
        model = Recompute(chat_model).model
        job_dir = svc.output_root / job["id"]
        manifest = load_manifest(job_dir)
        for conversation in conversations:
            detail = svc.get(f"/v1/jobs/{job['id']}/samples/{conversation['id']}").json()
            regenerated = detail["messages"]
            assert [m["role"] for m in regenerated] == [m["role"] for m in conversation["messages"]]
            # each answer is the model's greedy continuation of what came before it
            for k, message in enumerate(regenerated):
                if message["role"] != "assistant":
                    continue
                prompt = apply_chat_template_ids(tokenizer, regenerated[:k], add_generation_prompt=True)
                with torch.inference_mode():
                    out = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)
                answer = tokenizer.decode(out[0, len(prompt) :].tolist(), skip_special_tokens=True)
                assert message["content"] == answer.split("<|eot_id|>")[0]
            stored = read_sample(job_dir, manifest, conversation["id"])
            assert stored["input_ids"].tolist() == apply_chat_template_ids(tokenizer, regenerated)
    finally:
        svc.stop()
        ref.stop()

"""Chat samples rendered into token ids and loss masks (hsx.chat), in one process and in worker processes.

    python -m benchmarks.bench_chat                          # 100,000 conversations, workers 1 and 2
    python -m benchmarks.bench_chat --conversations 10000 --workers 1 2 4
    python -m benchmarks.bench_chat --long-turn-mb 4          # one 4 MB turn, with a limit of 4,096 and none

A JSON-lines file of ShareGPT conversations (2 to 4 turns, human then gpt, made-up words drawn by
Zipf's law: questions of 20-150 words, answers of 50-400) is written first, untimed. Each run then reads
it line by line as intake would: json.loads, conversation_of, render_many with a locally trained
byte-level BPE (32,000 ids) and a template in the style of Llama 3.1's (a system header with dates, a
default empty system prompt, trimmed contents). Its time includes starting the worker processes (each
imports transformers and loads the template once). Prints conversations/s, tokens/s and the projected
time for 100,000 conversations.

With --long-turn-mb, one conversation instead: a user turn of that many MB of random letters, digits and
punctuation (about a token a character) and a short answer, rendered as the service renders it, in the
template process (hsx.chat.process), once with each --limit (a token limit, or `none`) in a fresh
process. Prints the seconds, the tokens the render gave, and the process's resident memory once the
template is loaded and at its peak (VmHWM).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.report import Column, Report, Table, add_json_argument
from hsx.chat import ConversationError, Message, conversation_of, render_many
from hsx.chat.process import TemplateProcess
from tests.support import chat

# After Llama 3.1's template (without tools): a system header with the knowledge and today's dates always
# comes first, the system message in it when the conversation opens with one.
LLAMA31_STYLE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
PROJECTED = 100_000
LONG_TURN_BOUND_MB = 16_384  # the template process's bound in the long-turn runs: what a render takes is measured


def write_conversations(path: Path, n: int, seed: int = 0) -> int:
    """n ShareGPT lines of 2-4 turns; the bytes written."""
    rng = random.Random(seed)
    words = chat.made_up_words(40_000, seed)
    # Zipf's law, as words in text have it: the tokenizer's cache of words sees what it sees on real text.
    ranks = list(itertools.accumulate(1 / r for r in range(1, len(words) + 1)))
    size = 0
    with path.open("w") as f:
        for k in range(n):
            turns = []
            for _ in range(rng.randint(1, 2)):
                turns.append(
                    {
                        "from": "human",
                        "value": " ".join(rng.choices(words, cum_weights=ranks, k=rng.randint(20, 150))) + "?",
                    }
                )
                turns.append(
                    {
                        "from": "gpt",
                        "value": " ".join(rng.choices(words, cum_weights=ranks, k=rng.randint(50, 400))) + ".",
                    }
                )
            line = json.dumps({"id": f"c{k}", "conversations": turns}) + "\n"
            size += len(line)
            f.write(line)
    return size


def read_conversations(path: Path) -> Iterator[list[Message]]:
    with path.open() as f:
        for line in f:
            conversation = conversation_of(json.loads(line))
            assert conversation is not None
            yield conversation


def run(folder: Path, data: Path, workers: int) -> tuple[int, int, float]:
    """(conversations, tokens, seconds) of rendering the whole file."""
    started = time.perf_counter()
    count = tokens = 0
    for result in render_many(folder, read_conversations(data), "assistant", workers=workers):
        if isinstance(result, ConversationError):
            raise SystemExit(f"conversation {count} refused: {result}")
        count += 1
        tokens += len(result.input_ids)
    return count, tokens, time.perf_counter() - started


def peak_mb(pid: int) -> tuple[float, float]:
    """(resident now, resident at its peak) of a process, in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def long_turn(folder: Path, mb: float, limits: list[int | None], table: Table) -> None:
    """One conversation with a user turn of `mb` MB, rendered in a fresh template process per limit."""
    rng = random.Random(0)
    text = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789.,;:!?-", k=int(mb * 1_000_000)))
    conversation: list[Message] = [{"role": "user", "content": text}, {"role": "assistant", "content": "Noted."}]
    for limit in limits:
        templates = TemplateProcess(timeout_s=3600, max_mb=LONG_TURN_BOUND_MB)
        try:
            templates.facts(str(folder))
            assert templates._child is not None
            pid = templates._child.pid
            loaded, _ = peak_mb(pid)
            started = time.perf_counter()
            rendered = templates.render(str(folder), conversation, "assistant", limit=limit)
            seconds = time.perf_counter() - started
            table.add(
                limit="none" if limit is None else limit,
                seconds=seconds,
                tokens=len(rendered.input_ids),
                whole=rendered.whole,
                loaded_mib=loaded,
                peak_mib=peak_mb(pid)[1],
            )
        finally:
            templates.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=PROJECTED, help="how many (default 100,000)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="the runs' worker counts")
    parser.add_argument(
        "--long-turn-mb", type=float, help="render one conversation with a user turn of this many MB instead"
    )
    parser.add_argument(
        "--limit",
        nargs="+",
        type=lambda v: None if v == "none" else int(v),
        default=[4096, None],
        help="with --long-turn-mb: the token limits to render it with, `none` for no limit (default 4096 none)",
    )
    add_json_argument(parser)
    args = parser.parse_args()
    report = Report("bench_chat", args)
    with tempfile.TemporaryDirectory(prefix="hsx-chat-") as tmp_name:
        tmp = Path(tmp_name)
        folder = chat.save_chat_tokenizer(
            tmp / "tokenizer", LLAMA31_STYLE, vocab_size=32_000, lines=40_000, words=40_000
        )
        if args.long_turn_mb is not None:
            print(f"one conversation with a user turn of {args.long_turn_mb:g} MB, in the template process")
            table = report.table(
                "long_turn",
                Column("limit", "limit"),
                Column("seconds", "seconds", ".2f"),
                Column("tokens", "tokens"),
                Column("whole", "whole"),
                Column("loaded_mib", "loaded MiB", ".0f"),
                Column("peak_mib", "peak MiB", ".0f"),
            )
            long_turn(folder, args.long_turn_mb, args.limit, table)
            report.write()
            return
        data = tmp / "conversations.jsonl"
        size = write_conversations(data, args.conversations)
        print(f"{args.conversations} ShareGPT conversations of 2-4 turns, {size / 1e6:.0f} MB of JSON lines")
        table = report.table(
            "runs",
            Column("workers", "workers"),
            Column("seconds", "seconds", ".1f"),
            Column("conversations_s", "conv/s", ".0f"),
            Column("tokens_per_conversation", "tokens/conv", ".0f"),
            Column("mtokens_s", "Mtokens/s", ".2f"),
            Column("projected_s", f"{PROJECTED // 1000}k in", ".0f|s"),
        )
        for workers in args.workers:
            count, tokens, seconds = run(folder, data, workers)
            rate = count / seconds
            table.add(
                workers=workers,
                conversations=count,
                seconds=seconds,
                conversations_s=rate,
                tokens_per_conversation=tokens / count,
                mtokens_s=tokens / seconds / 1e6,
                projected_s=PROJECTED / rate,
            )
    report.write()


if __name__ == "__main__":
    main()

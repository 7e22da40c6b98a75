"""The flushers' book of staged samples: batches are taken oldest first up to the size bound, several
batches of one job can be written at once, a sample is in one batch at a time, and what could not be
written waits again in its place."""

from __future__ import annotations

from hsx.extraction.staged import Staged, StagedSamples


def book(sizes: list[int], bound: int = 100, job: str = "j") -> StagedSamples:
    staged = StagedSamples(bound)
    for pk, size in enumerate(sizes):
        staged.add(job, pk, Staged(size, float(pk)))
    return staged


def test_batches_are_cut_oldest_first_up_to_the_bound_and_taken_by_several_flushers():
    staged = book([40] * 7)
    assert staged.waiting_bytes == 280
    first, second = staged.take("j"), staged.take("j")
    assert first is not None and second is not None
    assert list(first.samples) == [0, 1] and list(second.samples) == [2, 3], "each batch fits the bound"
    assert first.nbytes == 80 and staged.waiting_bytes == 120 and staged.writing("j") == 2
    [w] = staged.waiting(now=10.0)
    assert (w.job_id, w.nbytes, w.oldest) == ("j", 120, 4.0)
    assert not staged.done(first) and not staged.done(second), "samples still wait"
    rest = staged.take("j")
    assert rest is not None and list(rest.samples) == [4, 5]
    last = staged.take("j")
    assert last is not None and list(last.samples) == [6]
    assert staged.take("j") is None
    assert not staged.done(rest), "another batch of the job is still being written"
    assert staged.done(last) and not staged.holds("j") and staged.waiting_bytes == 0


def test_a_sample_larger_than_the_bound_is_a_batch_of_its_own():
    staged = book([30, 250, 30])
    batches = [staged.take("j") for _ in range(3)]
    assert [list(b.samples) for b in batches if b] == [[0], [1], [2]]


def test_what_could_not_be_written_waits_again_in_its_place_and_not_before_its_time():
    staged = book([40] * 5)
    batch = staged.take("j")
    assert batch is not None and list(batch.samples) == [0, 1]
    staged.add("j", 9, Staged(40, 20.0))
    assert not staged.done(batch, back=[1], not_before=30.0)
    assert staged.waiting(now=29.0) == [], "a failed job is not tried again before its time"
    [w] = staged.waiting(now=30.0)
    assert w.oldest == 1.0 and w.nbytes == 40 * 5, "the given-back sample keeps its staging time"
    again = staged.take("j")
    assert again is not None and list(again.samples) == [1, 2]


def test_a_sample_staged_again_while_it_is_being_written_waits_for_that_batch():
    staged = book([40] * 2)
    batch = staged.take("j")
    assert batch is not None and list(batch.samples) == [0, 1]
    staged.add("j", 1, Staged(40, 5.0))  # extracted anew after the writer lost its lease
    assert staged.take("j") is None, "a sample is in one batch at a time"
    assert not staged.done(batch)
    again = staged.take("j")
    assert again is not None and list(again.samples) == [1]


def test_jobs_are_offered_longest_waiting_first():
    staged = StagedSamples(100)
    staged.add("late", 1, Staged(10, 5.0))
    staged.add("early", 2, Staged(10, 1.0))
    assert [w.job_id for w in staged.waiting(now=6.0)] == ["early", "late"]

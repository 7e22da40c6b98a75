"""What a length policy keeps of a sample over its limit (hsx.lengths)."""

from __future__ import annotations

import numpy as np
import pytest

from hsx.lengths import kept_tokens

#                 prompt  answer1   prompt answer2
MASK = np.array([0, 0, 0, 1, 1, 0, 0, 1, 1, 1], np.uint8)


@pytest.mark.parametrize(("limit", "kept"), [(9, 5), (7, 5), (5, 5), (4, 0), (3, 0), (2, 0)])
def test_truncate_turns_cuts_after_the_last_answer_that_ends_within_the_limit(limit, kept):
    assert kept_tokens(MASK, limit, "truncate_turns") == kept


def test_an_answer_ending_exactly_at_the_limit_is_kept_whole():
    mask = np.array([0, 1, 1, 0, 1, 1, 1], np.uint8)
    assert kept_tokens(mask, 3, "truncate_turns") == 3
    assert kept_tokens(mask, 6, "truncate_turns") == 3, "the second answer runs past 6: cut before it"


@pytest.mark.parametrize("mask", [None, np.ones(10, np.uint8)])
def test_without_turns_in_the_mask_it_cuts_at_the_limit(mask):
    assert kept_tokens(mask, 4, "truncate_turns") == 4


def test_truncate_keeps_the_first_tokens_whatever_the_mask():
    assert kept_tokens(MASK, 4, "truncate") == 4

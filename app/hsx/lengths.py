"""How many tokens a sample over its length limit keeps, under the job's length policy.

`truncate` keeps the first `limit` tokens. `truncate_turns` keeps whole turns: it cuts after the last
run of the loss mask (an assistant turn, its end-of-turn token included) that ends within the limit, so
no sample is stored with half an answer. A mask of ones throughout (token ids without a mask, or
`loss: all`) shows no turn to cut at: such a sample is cut at the limit, as under `truncate`.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

LengthPolicy = Literal["truncate", "truncate_turns", "skip", "reject"]


def kept_tokens(mask: np.ndarray | None, limit: int, policy: LengthPolicy) -> int:
    """The tokens a sample longer than `limit` (so `mask`, when given, has more than `limit` values) keeps
    under a cutting `policy`; 0 when no turn ends within the limit."""
    if policy != "truncate_turns" or mask is None:
        return limit
    head = mask[: limit + 1]
    if head.all():
        return limit
    # p ends a run of the mask when mask[p - 1] is 1 and mask[p] is 0; p = limit is the last place a cut may fall
    ends = np.flatnonzero((head[:-1] == 1) & (head[1:] == 0)) + 1
    return int(ends[-1]) if len(ends) else 0

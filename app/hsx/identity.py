"""What proved that a stored sample's tensors are its own: the one list of proofs, weakest first.

- count:    the dump carried neither input ids nor the request's rid; it was taken because it was
            the only dump of the sample's length while hsx had the dump root to itself (clear-and-scan).
            Another client of the same server sending a prompt of the same length defeats it.
- rid:      the dump was named by, or recorded, the rid hsx sent with this very request.
- response: the rows came in the model server's answer to hsx's own request.
- ids:      the dump carried the prompt's token ids (input_ids.safetensors or input_ids_sha256),
            equal to the sample's.

A job's identity is its weakest sample's: what every stored tensor of it is proven by.
"""

from __future__ import annotations

from collections.abc import Iterable

from hsx.states import StrEnum


class Identity(StrEnum):
    COUNT = "count"
    RID = "rid"
    RESPONSE = "response"
    IDS = "ids"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Identity.COUNT: 0, Identity.RID: 1, Identity.RESPONSE: 1, Identity.IDS: 2}


def weakest(identities: Iterable[str | None]) -> Identity | None:
    """The weakest of these proofs; None when there is none, or when one is unknown (recorded before
    hsx kept it): a job is only as proven as its least proven sample."""
    known = [None if i is None else Identity(i) for i in identities]
    if not known or None in known:
        return None
    return min((i for i in known if i is not None), key=lambda i: i.rank)

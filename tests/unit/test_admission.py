"""The API's slots for database work (hsx.api.admission): a request waits in line for one up to the
wait, then is refused 503 with Retry-After; checks of streams hold at most half of them."""

from __future__ import annotations

import time

import anyio
import pytest

from hsx.api.admission import Admission
from hsx.service.errors import Busy


def run(test) -> None:
    anyio.run(test, backend="asyncio")


def test_a_free_slot_is_taken_at_once_even_with_no_wait():
    async def test() -> None:
        admission = Admission(2, wait_s=0)
        async with admission.slot(), admission.slot():
            with pytest.raises(Busy) as refused:
                async with admission.slot():
                    pass
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
        assert "--connection-wait-s" in refused.value.detail
        async with admission.slot():  # given back: free again
            pass

    run(test)


def test_a_request_waits_in_line_for_a_slot_given_back_within_the_wait():
    async def test() -> None:
        admission = Admission(2, wait_s=5)
        order: list[str] = []

        async def holder(name: str, seconds: float) -> None:
            async with admission.slot():
                order.append(f"{name} in")
                await anyio.sleep(seconds)

        async with anyio.create_task_group() as tg:
            tg.start_soon(holder, "a", 0.2)
            tg.start_soon(holder, "b", 0.2)
            await anyio.sleep(0.05)
            tg.start_soon(holder, "c", 0)
            await anyio.sleep(0.05)
            tg.start_soon(holder, "d", 0)
        assert order == ["a in", "b in", "c in", "d in"]  # first come, first served

    run(test)


def test_a_request_is_refused_once_the_wait_is_over():
    async def test() -> None:
        admission = Admission(2, wait_s=0.3)
        async with admission.slot(), admission.slot():
            started = time.monotonic()
            with pytest.raises(Busy) as refused:
                async with admission.slot():
                    pass
            assert 0.25 < time.monotonic() - started < 3
        assert refused.value.headers == {"Retry-After": "1"}
        assert Admission(4, wait_s=2.5).retry_after_s == 3

    run(test)


def test_checks_hold_at_most_half_the_slots_and_requests_keep_the_rest():
    async def test() -> None:
        admission = Admission(6, wait_s=0.2)
        async with admission.check(), admission.check(), admission.check():
            with pytest.raises(Busy):  # a fourth check: checks hold half at most
                async with admission.check():
                    pass
            async with admission.slot(), admission.slot(), admission.slot():  # requests get the other half
                with pytest.raises(Busy):
                    async with admission.slot():
                        pass
        async with admission.check(), admission.check(), admission.check():  # all given back
            pass

    run(test)


def test_a_check_that_finds_no_slot_gives_its_check_back():
    async def test() -> None:
        admission = Admission(2, wait_s=0.1)
        async with admission.slot(), admission.slot():
            with pytest.raises(Busy):
                async with admission.check():
                    pass
        async with admission.check():  # the check's own place was not kept
            pass

    run(test)

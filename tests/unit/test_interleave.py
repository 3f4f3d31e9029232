"""`kinds.llm.text.interleave`: the LLM service's merge of a request's choices. One choice (n = 1) is read
directly; several are merged as items arrive. Either way: each choice's order is kept, an error ends it
all, and closing the merge early closes every choice's generator (its `finally` runs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from inferd.kinds.llm.text import interleave


class Choice:
    """An async generator of `items` (a pause before each), recording whether it was closed."""

    def __init__(self, items: list[int], fail_after: int | None = None) -> None:
        self.items = items
        self.fail_after = fail_after
        self.closed = False

    async def gen(self) -> AsyncIterator[int]:
        try:
            for k, item in enumerate(self.items):
                if k == self.fail_after:
                    raise RuntimeError("choice failed")
                await asyncio.sleep(0)
                yield item
        finally:
            self.closed = True


async def _all(choices: list[Choice]) -> list[tuple[int, int]]:
    return [pair async for pair in interleave([c.gen() for c in choices])]


@pytest.mark.parametrize("n", [1, 3])
def test_every_item_once_in_each_choice_order(n: int) -> None:
    choices = [Choice([10 * i + k for k in range(5)]) for i in range(n)]
    got = asyncio.run(_all(choices))
    assert sorted(got) == [(i, 10 * i + k) for i in range(n) for k in range(5)]
    for i in range(n):
        assert [item for j, item in got if j == i] == choices[i].items
    assert all(c.closed for c in choices)


@pytest.mark.parametrize("n", [1, 2])
def test_an_error_ends_it_all(n: int) -> None:
    choices = [Choice([1, 2, 3], fail_after=1 if i == 0 else None) for i in range(n)]
    with pytest.raises(RuntimeError, match="choice failed"):
        asyncio.run(_all(choices))


@pytest.mark.parametrize("n", [1, 2])
def test_closing_early_closes_every_choice(n: int) -> None:
    choices = [Choice(list(range(100))) for _ in range(n)]

    async def first_only() -> tuple[int, int]:
        merged = interleave([c.gen() for c in choices])
        first = await anext(merged)
        await merged.aclose()  # the client went away after one event
        assert all(c.closed for c in choices), "closed by the merge, not later by the loop's shutdown"
        return first

    assert asyncio.run(first_only())[1] == 0

"""The models' bounded caches: a planner sweep asks for the same states, calls and tasks of a shape many times, so
each is made once and kept in a dict that starts over when it is full (no sweep holds every shape it ever saw)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

_Key = TypeVar("_Key", bound=Hashable)
_Made = TypeVar("_Made")


def kept(cache: dict[_Key, _Made], key: _Key, make: Callable[[], _Made], limit: int) -> _Made:
    """`make()` kept in `cache` under `key`; the cache is emptied first when it holds `limit` entries."""
    found = cache.get(key)
    if found is None:
        if len(cache) >= limit:
            cache.clear()
        found = cache[key] = make()
    return found

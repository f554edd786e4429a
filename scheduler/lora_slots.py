"""Which LoRA adapters one worker holds: an exact LRU kept by that worker's Scheduler. Stdlib only.

The Scheduler alone decides what its worker runs, so it knows the worker's adapters exactly,
as it knows its block table: an adapter is loaded on the worker when a step's `lora_loads`
names it and dropped when a step's `lora_unloads` does (scheduler/outputs.py), and the
worker applies both before that step's forward (unloads first).

    slots = LoraSlots(max_loaded=8)
    plan = slots.plan(name, path, pinned)   # None: every slot is pinned, the request waits
    slots.commit(plan)                      # once the request is admitted

- At most `max_loaded` (the app's max_cpu_loras) adapters are loaded at a time.
- `pinned`: the adapters that running requests use (the Scheduler passes them; they are
  derived from its running list, so they are never out of date). A pinned adapter is never
  evicted.
- A name loaded from another path (unloaded, then loaded again from elsewhere) is a miss: the
  old copy is evicted and the new one loaded, in the same step; while requests still use
  the old copy it is pinned, and the new request waits.
- When the request needs a slot and none is free, the least recently used unpinned adapter
  is evicted. Recency is the last step that scheduled one of the adapter's requests
  (`touch`), or its load.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SlotPlan:
    """What admitting a request of adapter `name` costs this worker."""

    name: str
    path: str
    load: bool  # False: the adapter is loaded already (a hit)
    evict: tuple[str, ...] = ()  # adapters to unload first, least recently used first


@dataclass(slots=True)
class LoraSlotCounts:
    num_hits: int = 0  # admissions whose adapter was loaded already
    num_loads: int = 0  # adapters loaded (a step's lora_loads)
    num_evictions: int = 0  # adapters unloaded to make room or because they were removed
    loads_per_adapter: dict[str, int] = field(default_factory=dict)  # name -> loads


class LoraSlots:
    def __init__(self, max_loaded: int) -> None:
        assert max_loaded >= 1, max_loaded
        self.max_loaded = max_loaded
        self._loaded: OrderedDict[str, str] = OrderedDict()  # name -> path, least recently used first
        self.counts = LoraSlotCounts()

    def __contains__(self, name: object) -> bool:
        return name in self._loaded

    def loaded(self) -> list[str]:
        """The loaded adapters, least recently used first."""
        return list(self._loaded)

    def has_free_slot(self) -> bool:
        """Whether one more adapter fits without an eviction."""
        return len(self._loaded) < self.max_loaded

    def path_of(self, name: str) -> str | None:
        return self._loaded.get(name)

    def plan(self, name: str, path: str, pinned: Collection[str]) -> SlotPlan | None:
        """What loading `name` from `path` takes, or None if it cannot be done now (every
        adapter that would have to go is pinned). Changes nothing: see commit."""
        held = self._loaded.get(name)
        if held == path:
            return SlotPlan(name, path, load=False)
        evict: list[str] = []
        if held is not None:  # the same name from another path: the old copy goes first
            if name in pinned:
                return None
            evict.append(name)
        num_over = len(self._loaded) - len(evict) + 1 - self.max_loaded
        for victim in self._loaded:  # least recently used first
            if num_over <= 0:
                break
            if victim not in pinned and victim not in evict:
                evict.append(victim)
                num_over -= 1
        if num_over > 0:
            return None
        return SlotPlan(name, path, load=True, evict=tuple(evict))

    def commit(self, plan: SlotPlan) -> None:
        """Applies a plan made in the same step (nothing changed in between)."""
        for victim in plan.evict:
            del self._loaded[victim]
        self.counts.num_evictions += len(plan.evict)
        if plan.load:
            self.counts.num_loads += 1
            self.counts.loads_per_adapter[plan.name] = self.counts.loads_per_adapter.get(plan.name, 0) + 1
        else:
            self.counts.num_hits += 1
        self._loaded[plan.name] = plan.path
        self._loaded.move_to_end(plan.name)
        assert len(self._loaded) <= self.max_loaded, self._loaded

    def touch(self, name: str) -> None:
        """The adapter was used by a step: it becomes the most recently used."""
        if name in self._loaded:
            self._loaded.move_to_end(name)

    def discard(self, name: str) -> bool:
        """Forgets a loaded adapter (its name was removed from the server); True if it was
        loaded. The caller makes sure no running request uses it, and unloads it."""
        if self._loaded.pop(name, None) is None:
            return False
        self.counts.num_evictions += 1
        return True

    def reset(self) -> list[str]:
        """Forgets every adapter (the worker's state is gone or unknown); returns their names."""
        names = list(self._loaded)
        self._loaded.clear()
        return names

"""Which LoRA adapters the engine knows, and which of them sit in the device's slots this step.

A request names its adapter with a ``LoRARequest`` (vLLM's: a name, an integer id, a PEFT folder). The
manager reads each adapter once, on the host, when it is first named (so a bad adapter fails that request
only, before anything is queued), and keeps it until it is removed. Before each step it makes sure every
adapter of the step's sequences is in one of the ``max_loras`` device slots, evicting the least recently
used adapter that the step does not use; the scheduler never runs more distinct adapters at once than there
are slots (``Scheduler.max_loras``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.config import ModelConfig
from ..model.lora import LoRAAdapter, LoRASlots


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request: ``lora_name`` (what the server's ``model`` field names), ``lora_int_id`` (a
    positive integer, unique per adapter), ``lora_path`` (a PEFT adapter folder)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest: lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be a positive integer, "
                             f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must be a folder path, got {self.lora_path!r}")

    @property
    def cache_key(self) -> int:
        """The root of its sequences' block-hash chains: the same tokens under another adapter (or none, root
        0) have other K/V, so they must never hit each other's blocks in the prefix cache."""
        return hash(("lora", self.lora_int_id, self.lora_path))


class LoRAManager:
    """The adapters the engine knows (host copies) and the device slots (module docstring)."""

    def __init__(self, slots: LoRASlots, cfg: ModelConfig) -> None:
        self.slots = slots
        self.cfg = cfg
        self.adapters: dict[int, tuple[LoRARequest, LoRAAdapter]] = {}  # lora_int_id ->
        self.slot_ids: list[int | None] = [None] * slots.max_loras  # lora_int_id in each slot
        self.last_used = [0] * slots.max_loras
        self.num_steps = 0
        self.num_loads = 0  # adapters copied into a slot

    @property
    def max_loras(self) -> int:
        return self.slots.max_loras

    def add(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> bool:
        """Know ``request``'s adapter (read from its folder unless given). False if it was known already;
        ValueError for an unreadable adapter or an id taken by another name or folder."""
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if known[0] != request:
                raise ValueError(f"LoRA id {request.lora_int_id} is already {known[0].lora_name!r} at "
                                 f"{known[0].lora_path!r}; give {request.lora_name!r} another lora_int_id")
            return False
        for other, _ in self.adapters.values():
            if other.lora_name == request.lora_name:
                raise ValueError(f"a LoRA adapter named {request.lora_name!r} is already loaded (id {other.lora_int_id})")
        if adapter is None:
            adapter = LoRAAdapter.load(request.lora_path, self.cfg, self.slots.max_rank)
        self.adapters[request.lora_int_id] = (request, adapter)
        return True

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (the caller makes sure no sequence uses it); its slot is cleared."""
        self.adapters.pop(lora_int_id, None)
        for s, held in enumerate(self.slot_ids):
            if held == lora_int_id:
                self.slots.clear(s)
                self.slot_ids[s] = None

    def by_name(self, name: str) -> LoRARequest | None:
        for request, _ in self.adapters.values():
            if request.lora_name == name:
                return request
        return None

    def requests(self) -> list[LoRARequest]:
        return [r for r, _ in self.adapters.values()]

    def assign(self, lora_ids: list[int | None]) -> np.ndarray:
        """The slot of each of a step's sequences ([B] int64, -1 for none), loading the adapters that are
        not in a slot yet (into free slots first, then those least recently used by earlier steps)."""
        self.num_steps += 1
        wanted = {i for i in lora_ids if i is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} LoRA adapters; there are {self.max_loras} slots")
        slot_of = {held: s for s, held in enumerate(self.slot_ids) if held is not None}
        for lora_id in sorted(wanted - slot_of.keys()):
            if lora_id not in self.adapters:
                raise RuntimeError(f"LoRA id {lora_id} is scheduled but not loaded")
            free = [s for s, held in enumerate(self.slot_ids) if held is None or held not in wanted]
            s = min(free, key=lambda k: (self.slot_ids[k] is not None, self.last_used[k]))
            self.slots.load(s, self.adapters[lora_id][1])
            self.slot_ids[s] = lora_id
            slot_of[lora_id] = s
            self.num_loads += 1
        for lora_id in wanted:
            self.last_used[slot_of[lora_id]] = self.num_steps
        return np.fromiter((-1 if i is None else slot_of[i] for i in lora_ids), dtype=np.int64, count=len(lora_ids))

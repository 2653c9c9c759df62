"""LoRARegistry: the engine's adapters by name, their host copies and their device slots.

``add`` reads and checks an adapter (:mod:`.peft_format`; a refusal changes nothing) and keeps
its weights as a host copy; at most ``max_cpu_loras`` host copies are kept, least recently used
dropped first (a dropped one is read from its directory again when a step needs it, and refused
if its files changed since it was added). ``prepare_step`` gives each adapter of a step a device
slot, writing it through ``load_slot`` (the model runner's), and evicts the least recently used
adapter not in the step when every slot is taken: the scheduler never puts more than
``max_loras`` adapters in one step (:mod:`inflight.runtime.core.lora_gate`). ``remove`` takes a
name away at once; the requests already holding its :class:`LoRARef` finish with it, and
``collect`` drops its weights once none is left. Knows nothing about requests' tokens or KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from inflight.runtime.lora.peft_format import AdapterWeights, read_adapter
from inflight.runtime.lora.types import LoRAError, LoRAInfo, LoRARef, UnknownLoRA
from inflight.runtime.model.spec import ModelSpec

SlotLoader = Callable[[int, AdapterWeights], None]  # (slot, weights): write the weights into the slot


@dataclass(slots=True)
class _Entry:
    info: LoRAInfo
    ref: LoRARef
    digest: str
    removed: bool = False


class LoRARegistry:
    """See module docstring."""

    def __init__(self, spec: ModelSpec, max_loras: int, max_cpu_loras: int | None, max_rank: int,
                 load_slot: SlotLoader) -> None:  # fmt: skip
        self.spec = spec
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max_cpu_loras if max_cpu_loras is not None else max_loras
        self._load_slot = load_slot
        self._names: dict[str, _Entry] = {}  # loaded names
        self._by_id: dict[int, _Entry] = {}  # loaded, and removed ones still in use
        self._host: OrderedDict[int, AdapterWeights] = OrderedDict()  # load_id -> weights, LRU first
        self._slots: OrderedDict[int, int] = OrderedDict()  # load_id -> device slot, LRU first
        self._next_id = 1
        self.num_slot_loads = 0  # adapters written into a device slot (a figure for tests and stats)
        self.num_disk_reads = 0  # host copies read again from their directory

    # -- names ------------------------------------------------------------------------
    def add(self, name: str, path: str) -> LoRAInfo:
        """Load adapter ``name`` from ``path`` (the same name and path again: the loaded one)."""
        if not isinstance(name, str) or not name or len(name) > 256 or not name.isprintable():
            raise LoRAError(f"LoRA adapter name {name!r} must be 1 to 256 printable characters.")
        if not isinstance(path, str) or not path:
            raise LoRAError(f"LoRA adapter {name!r}: the path must be a non-empty string.")
        known = self._names.get(name)
        if known is not None:
            if _same_path(known.info.path, path):
                return known.info
            raise LoRAError(f"LoRA adapter {name!r} is already loaded from {known.info.path!r}; "
                            "unload it first to load it from another path.")
        weights = read_adapter(name, path, self.spec, self.max_rank)
        load_id = self._next_id
        self._next_id += 1
        entry = _Entry(weights.info, LoRARef(name, load_id, f"{name}\0{weights.digest}"), weights.digest)
        self._names[name] = entry
        self._by_id[load_id] = entry
        self._keep_host(load_id, weights)
        return weights.info

    def remove(self, name: str) -> None:
        """New requests can no longer use ``name``; the ones holding it finish with it."""
        entry = self._names.pop(name, None)
        if entry is None:
            raise UnknownLoRA(f"no LoRA adapter named {name!r} is loaded.")
        entry.removed = True

    def resolve(self, name: str) -> LoRARef:
        entry = self._names.get(name)
        if entry is None:
            raise UnknownLoRA(f"no LoRA adapter named {name!r} is loaded.")
        return entry.ref

    def list(self) -> list[LoRAInfo]:
        return [e.info for e in self._names.values()]

    @property
    def has_removed(self) -> bool:
        return len(self._by_id) > len(self._names)

    def collect(self, live: Iterable[LoRARef]) -> None:
        """Drop the weights and slots of removed adapters no ``live`` request holds."""
        if not self.has_removed:
            return
        held = {ref.load_id for ref in live}
        for load_id, entry in list(self._by_id.items()):
            if entry.removed and load_id not in held:
                del self._by_id[load_id]
                self._host.pop(load_id, None)
                self._slots.pop(load_id, None)  # the slot is free again; its stale weights are never read

    # -- host copies and device slots -------------------------------------------------
    def _keep_host(self, load_id: int, weights: AdapterWeights) -> None:
        self._host[load_id] = weights
        self._host.move_to_end(load_id)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def _weights(self, load_id: int) -> AdapterWeights:
        weights = self._host.get(load_id)
        if weights is not None:
            self._host.move_to_end(load_id)
            return weights
        entry = self._by_id[load_id]
        weights = read_adapter(entry.ref.name, entry.info.path, self.spec, self.max_rank)
        self.num_disk_reads += 1
        if weights.digest != entry.digest:
            raise LoRAError(f"LoRA adapter {entry.ref.name!r}: its files in {entry.info.path!r} changed since it "
                            "was loaded; unload and load it again.")
        self._keep_host(load_id, weights)
        return weights

    def prepare_step(self, refs: Iterable[LoRARef]) -> dict[int, int] | None:
        """Device slots for the step's adapters (load_id -> slot); None when the step has none."""
        wanted = list(dict.fromkeys(ref.load_id for ref in refs))
        if not wanted:
            return None
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} LoRA adapters; max_loras is {self.max_loras}")
        for load_id in wanted:
            if load_id in self._slots:
                self._slots.move_to_end(load_id)
                continue
            taken = set(self._slots.values())
            free = [s for s in range(self.max_loras) if s not in taken]
            if free:
                slot = free[0]
            else:  # evict the least recently used adapter this step does not use
                victim = next(i for i in self._slots if i not in wanted)
                slot = self._slots.pop(victim)
            self._load_slot(slot, self._weights(load_id))
            self.num_slot_loads += 1
            self._slots[load_id] = slot
        return {load_id: self._slots[load_id] for load_id in wanted}

    @property
    def resident(self) -> list[str]:
        """Names (or removed ones' names) of the adapters in device slots, least recently used first."""
        return [self._by_id[i].ref.name for i in self._slots]


def _same_path(a: str, b: str) -> bool:
    return a == b or Path(a).resolve() == Path(b).resolve()

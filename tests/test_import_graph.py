"""No circular imports among ``inflight`` modules and the root ``bench/`` scripts, and the rooms of
``inflight.runtime`` layered: each imports only the rooms below it (docs/architecture.md).

The graph is read from the source (tests/import_reading.py): a module-level ``import`` or
``from ... import`` of an ``inflight`` or ``bench`` module is an edge; imports inside functions
(deferred on purpose) and under ``if TYPE_CHECKING:`` (types only) are not, except where a test
says otherwise. Each rule is also shown to catch a made-up violation. Importing each module alone,
without side effects, is tests/test_import_side_effects.py's.
"""

from __future__ import annotations

import ast

import pytest

from tests.import_reading import PACKAGE, ROOT, find_cycle, import_graph, imports_in, module_paths, targets_of


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"})}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": frozenset({"b"}), "b": frozenset()}) is None


def test_no_circular_imports_at_module_level() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "circular import: " + " -> ".join(cycle or [])


def test_no_circular_imports_even_deferred() -> None:
    """A deferred import inside a function is not an excuse for a circle, in the library or in
    the benchmarks (``inflight.bench`` and the root ``bench/`` studies) alike."""
    cycle = find_cycle(import_graph(deferred=True))
    assert cycle is None, "circular import through a deferred import: " + " -> ".join(cycle or [])


def test_package_never_imports_the_studies() -> None:
    """``bench/`` (studies, the GPU check, the compat runners) imports ``inflight``; nothing in
    ``inflight`` imports ``bench`` (it is not shipped in the wheel or the images)."""
    wrong = [f"{m} -> {t}" for m, ts in import_graph(deferred=True).items() if m.startswith("inflight")
             for t in ts if t == "bench" or t.startswith("bench.")]
    assert not wrong, wrong


def test_images_need_no_bench_code() -> None:
    """The Docker images leave ``inflight/bench`` out (docker/*.dockerignore), so nothing else in
    the package may import it, even deferred."""
    wrong = [f"{m} -> {t}" for m, ts in import_graph(deferred=True).items()
             if m.startswith("inflight.") and not m.startswith("inflight.bench")
             for t in ts if t.startswith("inflight.bench")]
    assert not wrong, wrong
    for ignore in sorted((ROOT / "docker").glob("*.dockerignore")):
        assert "inflight/bench/" in ignore.read_text().split(), f"{ignore.name} ships the bench suite"


# The rooms of ``inflight.runtime`` (docs/architecture.md has the map). The leaves are plain
# types a lower room may read from a higher one without depending on it: they import nothing
# from their own room at run time (checked below).
LEAVES = frozenset({"inflight.runtime.core.sched_output", "inflight.runtime.core.engine_types"})
# room -> rooms it never imports, at module level or deferred
NEVER = {
    "core": {"engine_core", "server", "cli", "demo"},
    "worker": {"core", "spec_decode", "engine_core", "server", "cli", "demo"},
    "spec_decode": {"core", "engine_core", "server", "cli", "demo"},
    "model": {"worker", "core", "spec_decode", "engine_core", "server", "cli", "demo"},
    "structured": {"worker", "core", "spec_decode", "engine_core", "server", "cli", "demo"},
    "distributed": {"core", "spec_decode", "engine_core", "server", "cli", "demo"},
    "engine_core": {"server", "cli", "demo"},
    "server": {"cli", "demo"},
    # LoRA adapters: files, host copies, device slots; reads the model's shapes, drives nothing above
    "lora": {"core", "worker", "spec_decode", "structured", "distributed", "engine_core", "server", "cli", "demo"},
    # KV events: what the block pool tells a router; the core drives it, it drives nothing
    "kv_events": {"core", "worker", "spec_decode", "model", "structured", "distributed", "engine_core", "server",
                  "cli", "demo"},
    # image input: pixels to patches, placeholders to tokens, the values a request carries; read by the
    # front end, the core and the worker, it reads none of them (nor the model: it imports no torch)
    "multimodal": {"core", "worker", "spec_decode", "model", "structured", "distributed", "engine_core", "server",
                   "cli", "demo", "lora", "kv_events"},
}


def room(module: str) -> str | None:
    """The room (subpackage of ``inflight.runtime``) ``module`` lives in, or None."""
    parts = module.split(".")
    is_package = module_paths()[module].name == "__init__.py"
    return parts[2] if parts[:2] == ["inflight", "runtime"] and len(parts) > (2 if is_package else 3) else None


def room_edges(deferred: bool) -> dict[tuple[str, str], list[str]]:
    """(room, room it imports) -> the module edges behind it, leaves left out."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in import_graph(deferred).items():
        for target in targets:
            a, b = room(module), room(target)
            if a and b and a != b and target not in LEAVES:
                edges.setdefault((a, b), []).append(f"{module} -> {target}")
    return edges


@pytest.mark.parametrize("deferred", [False, True], ids=["module-level", "deferred-too"])
def test_runtime_rooms_are_layered(deferred: bool) -> None:
    """The rooms depend on each other in one direction only, at module level and through
    deferred imports alike (the leaves aside): the server drives the engine core, which drives
    the core, which drives the worker and the drafters, which run the model; the core never
    imports the engine core, the server or the CLI; the worker and the drafters read only the
    core's leaves; the model never imports the worker."""
    edges = room_edges(deferred)
    wrong = [e for (a, b), es in edges.items() if b in NEVER.get(a, ()) for e in es]
    assert not wrong, f"imports against the layers: {wrong}"
    cycle = find_cycle({a: frozenset(b for (x, b) in edges if x == a) for (a, _) in edges})
    assert cycle is None, f"rooms in a circle {cycle}: " + str(
        [e for (a, b), es in edges.items() if a in cycle and b in cycle for e in es])


def test_a_layer_rule_fails_when_broken() -> None:
    """The rules above are not vacuous: a made-up edge from the core to the server is caught."""
    edges = {**room_edges(True), ("core", "server"): ["inflight.runtime.core.x -> inflight.runtime.server.y"]}
    assert [e for (a, b), es in edges.items() if b in NEVER.get(a, ()) for e in es]


# room -> modules it never imports, not even deferred or for types (the device side gets plain chunks)
NEVER_EVEN_TYPES = {"worker": {"inflight.runtime.core.request"}, "spec_decode": {"inflight.runtime.core.request"}}


def imports_against_never_even_types(sources: dict[str, str]) -> list[str]:
    """``module -> source``: its imports (at any depth, types included) that ``NEVER_EVEN_TYPES`` forbids."""
    known, wrong = module_paths(), []
    for name, source in sources.items():
        banned = NEVER_EVEN_TYPES.get(room(name) or "", set())
        nodes = imports_in(ast.parse(source).body, deferred=True, types=True)
        wrong += [f"{name} -> {t}" for n in nodes for t in targets_of(name, known[name], n, known) if t in banned]
    return wrong


def test_the_device_side_never_imports_the_live_request() -> None:
    """The worker and the drafters read plain chunks (core/sched_output.py), never a ``Request``,
    not even as a type; a made-up import of it under ``TYPE_CHECKING`` is caught."""
    ours = {m: p.read_text() for m, p in module_paths().items() if m.startswith("inflight.") and room(m) in NEVER_EVEN_TYPES}
    assert not imports_against_never_even_types(ours)
    made_up = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from inflight.runtime.core import request\n"
    assert imports_against_never_even_types({"inflight.runtime.worker.batch_inputs": made_up})


def test_leaves_import_nothing_from_their_room() -> None:
    graph = import_graph(deferred=True)
    for leaf in LEAVES:
        same_room = [t for t in graph[leaf] if room(t) == room(leaf)]
        assert not same_room, f"{leaf} is a leaf but imports {same_room}"


def test_the_runtime_top_level_is_rooms_and_a_few_shared_modules() -> None:
    """About ten rooms and the vocabulary every room shares; a new module goes into a room."""
    top = sorted(p.name for p in (PACKAGE / "runtime").iterdir() if not p.name.startswith("__pycache__"))
    rooms = [n for n in top if (PACKAGE / "runtime" / n / "__init__.py").is_file() and n != "chat_templates"]
    shared = [n for n in top if n.endswith(".py") and n not in ("__init__.py", "__main__.py")]
    assert set(rooms) == set(NEVER) | {"cli", "demo"}, rooms
    assert len(shared) <= 10, f"{len(shared)} modules at the top of inflight/runtime: {shared}"

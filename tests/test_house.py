"""The house rules of core/: layers without cycles, rule modules that never import each other, and
one transition table that names every task and waiting record exactly once."""

from __future__ import annotations

import ast
import inspect
import pathlib

import attrs
import pytest

from fxsched.core import (decode_phases, flow_phases, loop_phases, memory_phases, phases, prefill_phases, spec_phases,
                          table)

CORE = pathlib.Path(__file__).resolve().parent.parent / "core"

LAYERS = {
    1: {"records", "kv", "token_log", "request", "config", "events"},
    2: {"sequence", "state", "phases", "loop_phases", "flow_phases", "prefill_phases", "decode_phases", "spec_phases",
        "memory_phases"},
    3: {"agenda", "rows", "admission", "chunking", "verdict", "watchdog", "emit", "retire", "faults", "memory",
        "verifying", "late", "ahead", "ahead_columns"},
    4: {"tick", "flow", "prefill", "decode", "spec_step", "kverify", "dflash", "mtp_batch", "ngram", "self_spec",
        "lifecycle"},
    5: {"table"},
    6: {"machine"},
}
RULE_MODULES = LAYERS[4]


def core_imports(source: str) -> set[str]:
    """The core modules a module's source imports (module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fxsched.core"):
            parts = node.module.split(".")
            if len(parts) > 2:
                found.add(parts[2])
            else:  # from fxsched.core import x, y
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fxsched.core."):
                    found.add(alias.name.split(".")[2])
    return found


def module_graph() -> dict[str, set[str]]:
    mods = {p.stem: p for p in CORE.glob("*.py") if p.stem != "__init__"}
    return {m: {t for t in core_imports(p.read_text()) if t in mods and t != m} for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Modules that can reach themselves."""
    looped = []
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m == start:
                looped.append(start)
                break
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
    return looped


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c"]
    assert core_imports("def f():\n    from fxsched.core.tick import x\n") == {"tick"}


def test_core_has_no_import_cycle():
    assert cycles(module_graph()) == []


def test_every_core_module_has_a_layer():
    graph = module_graph()
    assert set(graph) == set().union(*LAYERS.values())


def test_each_module_imports_only_lower_layers_and_rule_modules_never_each_other():
    layer_of = {m: n for n, mods in LAYERS.items() for m in mods}
    bad = []
    for module, targets in module_graph().items():
        for target in targets:
            if layer_of[target] > layer_of[module] or (layer_of[target] == layer_of[module] == 4):
                bad.append(f"{module} -> {target}")
    assert bad == []


PHASE_MODULES = (loop_phases, flow_phases, prefill_phases, decode_phases, spec_phases, memory_phases)
"""The modules behind the ``phases`` namespace."""


def _records():
    return [c for module in PHASE_MODULES for _, c in inspect.getmembers(module, inspect.isclass)
            if c.__module__ == module.__name__ and attrs.has(c)]


def test_every_task_and_waiting_record_has_exactly_one_table_entry():
    waiting = {c for c in _records() if c.__name__.startswith("Await")}
    values = {phases.MtpBatch}  # a record carried inside tasks, never on the agenda itself
    tasks = set(_records()) - waiting - values
    assert set(table.ANSWERS) == waiting
    assert set(table.TASKS) == tasks
    assert not set(table.ANSWERS) & set(table.TASKS)
    assert len(table.ANSWERS) == 41


def test_table_rules_live_in_rule_modules():
    rules = list(table.TASKS.values()) + [p.rule for p in table.ANSWERS.values()]
    assert {r.__module__.rsplit(".", 1)[-1] for r in rules} <= RULE_MODULES


def test_string_typed_phase_fields_are_enums():
    assert isinstance(phases.AwaitProposal(1).then, phases.AfterProposal)
    assert attrs.fields(phases.AwaitSwapOutFree).stage.type in ("SwapOutStage", phases.SwapOutStage)
    with pytest.raises(ValueError):
        phases.SwapOutStage("swap-out")


def test_table_rows_print_every_phase():
    rows = table.rows()
    assert len(rows) == len(table.TASKS) + len(table.ANSWERS)
    by_name = {r[0]: r for r in rows}
    assert by_name["AwaitDecode"][1] == "TokensSampled | DeviceFault"
    assert by_name["AwaitBeamGroup"][3].startswith("the requests in requests")


def test_fxsched_phases_prints_the_table(capsys):
    from fxsched.runtime.cli import main

    assert main(["phases"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(table.TASKS) + len(table.ANSWERS)
    decode = next(line for line in lines if line.startswith("AwaitDecode "))
    assert "decode.decoded" in decode and "DeviceFault" in decode
    assert main(["phases", "--markdown"]) == 0
    assert capsys.readouterr().out.startswith("| phase | waits for | rule | a DeviceFault there fails |")


def test_the_engine_header_names_every_core_module_in_its_layer():
    from fxsched.core import machine

    header = machine.__doc__ or ""
    for number, modules in LAYERS.items():
        line_start = header.index(f"\n{number}. ")
        line_end = header.index(f"\n{number + 1}. ") if number + 1 in LAYERS else len(header)
        section = header[line_start:line_end]
        missing = [m for m in modules if f"``{m}``" not in section]
        assert missing == [], f"layer {number} of core/machine.py's header omits {missing}"


# --- in-place last writes (core/agenda.py, Batch) ---------------------------------------------------

LAST_WRITES = {"update", "ask", "forward"}
"""The writes that may go in place on a state the step owns: each must be the value its rule returns."""


def last_write_misuses(sources: dict[str, str]) -> list[str]:
    """Calls of a last write (or of a function that returns one) whose result is not returned at
    once: it must be the returned value itself, or the first argument of the returned call when no
    other argument names the state it wrote."""
    functions = [(name, node) for name, source in sources.items() for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.FunctionDef)]
    writers = set(LAST_WRITES)
    grown = True
    while grown:  # a function that returns a last write is one too
        grown = False
        for _, node in functions:
            if node.name not in writers and any(
                    isinstance(r, ast.Return) and _called(r.value, writers) for r in ast.walk(node)):
                writers.add(node.name)
                grown = True
    found = []
    for module, node in functions:
        allowed = set()
        for r in ast.walk(node):
            if not isinstance(r, ast.Return):
                continue
            for value in (r.value.body, r.value.orelse) if isinstance(r.value, ast.IfExp) else (r.value,):
                if isinstance(value, ast.Call):
                    allowed.add(id(value))
                    if value.args and isinstance(value.args[0], ast.Call):
                        inner = value.args[0]
                        wrote = ast.unparse(inner.args[0]) if inner.args else None
                        others = value.args[1:] + [k.value for k in value.keywords]
                        if not any(ast.unparse(n) == wrote for o in others for n in ast.walk(o)):
                            allowed.add(id(inner))
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and _called(call, writers) and id(call) not in allowed and not _defers(call):
                found.append(f"{module}:{call.lineno} {ast.unparse(call)[:80]}")
    return found


def _called(node, names: set[str]) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names


def _defers(call: ast.Call) -> bool:
    """A batched MTP verdict (``deferred=True``) returns before any last write."""
    return any(k.arg == "deferred" and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords)


def test_last_writes_are_returned_at_once():
    sources = {path.name: path.read_text() for path in CORE.glob("*.py")}
    assert last_write_misuses(sources) == []


def test_the_last_write_check_finds_a_misuse():
    held = "def rule(state, out):\n    after = update(state, out, {})\n    return state\n"
    passed_twice = "def rule(state, out):\n    return go(update(state, out, {}), state)\n"
    through_helper = ("def helper(state, out):\n    return ask(state, out, q, w)\n"
                      "def rule(state, out):\n    new = helper(state, out)\n    return new\n")
    fine = ("def rule(state, out):\n    if c:\n        return go(update(state, out, {}), out)\n"
            "    return ask(state, out, q, w) if c else state\n")
    assert len(last_write_misuses({"a.py": held})) == 1
    assert len(last_write_misuses({"a.py": passed_twice})) == 1
    assert len(last_write_misuses({"a.py": through_helper})) == 1
    assert last_write_misuses({"a.py": fine}) == []

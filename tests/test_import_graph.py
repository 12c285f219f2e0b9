"""The package's import graph: no cycles inside `verl_patches`, production code never imports
`verl_patches.rigs.testing` (the test-only helpers depend on production code, not the other way round),
every edge points down (core/ is handed the patch records, nothing outside the record folders imports a patch
module), the recipe's settings are read through one module, the recipe's patch folders hold no CPU
platform record (those live under rigs/cpu/patches/), the rollout's long tail is a wing of its own
(rollout/long_tail/, reached by its named users only), the rigs are one wing on the top floor that the recipe
reaches through one door only (rigs/), and the import map's floors. The root holds its five
entry modules only; the rest lives in engines (one part each) or wings (folders by purpose: base/, config/,
launch/, reporting/, checks/, rigs/), whose layers are pinned here: the floor imports nothing above it, no module
imports a command, launch/ has named users, no engine imports reporting/, and README's layout table names every folder.
Dependencies at the head (issue 38): the package imports itself at module level, a function-level import says
why it waits, and what the catalogue and the CLI load imports no upstream package (the doctor runs without torch).

The graph is read from the source with `ast`, so it sees imports inside functions too (a lazy
import that only hides a cycle is still a cycle). Imports under `if TYPE_CHECKING:` are not edges.
The *import-time* graph keeps only what importing a module runs (not function bodies); its floors:
a module that imports nothing of the package is on floor 0, any other one floor above the highest
module it imports.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

from tests.helpers import REPO

PACKAGE = "verl_patches"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, import_time: bool = False) -> set[str]:
    """Dotted names this module imports (``from a import b`` yields a.b and a); ``import_time``: only
    those its import runs (function bodies skipped)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if import_time and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    prefix = ".".join(base + ([child.module] if child.module else []))
                else:
                    prefix = child.module or ""
                out.add(prefix)
                out.update(f"{prefix}.{a.name}" for a in child.names)
            visit(child)

    visit(tree)
    return out


def import_graph(root: Path = REPO, package: str = PACKAGE, import_time: bool = False) -> dict[str, set[str]]:
    """module -> modules of ``package`` it imports. An import of a.b.c is an edge to the deepest
    name that is a module (a symbol imported from a module is an edge to that module)."""
    files = {_module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        names = _imports(ast.parse(path.read_text(), str(path)), mod, path.name == "__init__.py", import_time)
        edges = set()
        for name in names:
            parts = name.split(".")
            while parts and ".".join(parts) not in files:
                parts.pop()
            target = ".".join(parts)
            if parts and target != mod and target != package:
                edges.add(target)
        graph[mod] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), each as a
    closed path through that component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    cycles = []
    for comp in comps:
        members, start = set(comp), comp[0]
        # Walk from start inside the component until it returns: a concrete cycle to name.
        path, seen, v = [start], {start}, start
        while True:
            nxt = sorted(w for w in graph[v] if w in members)
            back = [w for w in nxt if w == start]
            if back and len(path) > 1 or not [w for w in nxt if w not in seen]:
                path.append(start if back else nxt[0])
                break
            v = [w for w in nxt if w not in seen][0]
            seen.add(v)
            path.append(v)
        cycles.append(path)
    return cycles


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    cycles = find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert len(cycles) == 1 and cycles[0][0] == cycles[0][-1] and set(cycles[0]) == {"a", "b", "c"}


def test_the_graph_sees_function_level_and_relative_imports_and_skips_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from ..a import f\nfrom typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from pkg.sub import c\n")
    (pkg / "sub" / "c.py").write_text("import pkg.a\n")
    g = import_graph(tmp_path, "pkg")
    assert g["pkg.a"] == {"pkg.sub", "pkg.sub.b"} and g["pkg.sub.b"] == {"pkg.a"} and g["pkg.sub.c"] == {"pkg.a"}
    assert find_cycles(g) and set(find_cycles(g)[0]) == {"pkg.a", "pkg.sub.b"}


def test_no_import_cycle_inside_the_package():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles in verl_patches (move what both sides need into a leaf module):\n" + \
        "\n".join(" -> ".join(c) for c in cycles)


def test_production_modules_do_not_import_the_testing_helpers():
    bad = sorted(f"{mod} imports {t}" for mod, edges in import_graph().items()
                 if not mod.startswith(f"{PACKAGE}.rigs.testing") for t in edges
                 if t.startswith(f"{PACKAGE}.rigs.testing"))
    assert not bad, "production code imports verl_patches.rigs.testing (move the helper out of rigs/testing/):\n" + \
        "\n".join(bad)


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """module -> its floor in an acyclic graph: 0 for a module that imports none of the graph's, else one
    above the highest module it imports."""
    out: dict[str, int] = {}

    def floor(v: str) -> int:
        if v not in out:
            out[v] = 1 + max((floor(w) for w in graph.get(v, ())), default=-1)
        return out[v]

    for v in graph:
        floor(v)
    return out


def test_floors_of_a_small_graph_and_the_import_time_graph_skips_function_bodies(tmp_path):
    assert floors({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": set()}) == {"a": 2, "b": 1, "c": 0, "d": 0}
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import pkg.b\ndef f():\n    import pkg.c\nclass K:\n    from pkg import c\n")
    (pkg / "b.py").write_text("")
    (pkg / "c.py").write_text("")
    assert import_graph(tmp_path, "pkg", import_time=True)["pkg.a"] == {"pkg.b", "pkg.c"}
    (pkg / "a.py").write_text("import pkg.b\ndef f():\n    import pkg.c\n")
    assert import_graph(tmp_path, "pkg", import_time=True)["pkg.a"] == {"pkg.b"}


# The import map's height (import-time graph): 11 floors since issue 38 moved the package's own imports to the
# module heads (before, 8: the lazy imports hid three floors without removing an edge). Since the weight sync got
# one owner (issue 49) it has 10; the top chain is the preflight's (preflight.cli -> preflight.switch_rehearsal ->
# reshard.weight_sync -> reshard.alltoallv -> reshard.baselines -> reshard.planner -> reshard.placements ->
# reshard.deepseek_v3_names -> reshard.layouts -> reshard.model). A new module above the top is a design change:
# raise it here with the reason.
MAX_FLOORS = 11


def test_the_import_map_has_its_floors():
    f = floors(import_graph(import_time=True))
    top = max(f.values())
    chain = [max(f, key=f.get)]
    g = import_graph(import_time=True)
    while g[chain[-1]]:
        chain.append(max(g[chain[-1]], key=f.get))
    assert top + 1 <= MAX_FLOORS, f"the import map has {top + 1} floors (at most {MAX_FLOORS}): " + " -> ".join(chain)


# The wings: folders that group modules by what they are for (the ground every part stands on; settings; local
# processes and the prelude; reporting, plots and the console; the launch-time checks and commands). A wing's
# __init__ imports nothing, and each of its modules is a part of the package map on its own. Every other folder
# and the rigs (the CPU platform and its records, the NPU rehearsal, the tiny assets, the test helpers: what lets the
# recipe run and be tested without its accelerator). Every other folder (core/, patches/, reshard/, rollout/, ...) is
# one part. Each wing is also one floor of the folder map below.
WINGS = ("base", "config", "launch", "reporting", "checks", "rigs")


def _part(m: str) -> str:
    parts = m.split(".")
    return ".".join(parts[:3] if len(parts) > 2 and parts[1] in WINGS else parts[:2])


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph of the package's parts (verl_patches.core, verl_patches.patches, ..., each module of a wing
    and the root's modules), every import counted, function-level ones too."""
    part = _part

    out: dict[str, set[str]] = {}
    for mod, edges in graph.items():
        out.setdefault(part(mod), set()).update(part(t) for t in edges if part(t) != part(mod))
    return out


def test_the_package_map_has_no_cycle():
    """Every edge between the package's parts points down: before issue 28 core/ (the registry, which
    imported the catalogue), patches/, the CPU platform (rigs/cpu/ now), preflight/ and rollout/ formed one cycle."""
    cycles = find_cycles(_package_graph(import_graph()))
    assert not cycles, "cycles between the parts of verl_patches:\n" + "\n".join(" -> ".join(c) for c in cycles)


# The root: the package, ``python -m verl_patches`` and its CLI, the entry points that reach every process
# (vLLM's general plugin, Ray's setup hook) and prelude_patch, the one line users add to verl's worker module.
# Everything else lives in a folder: an engine or a wing.
ROOT_MODULES = {"__init__", "__main__", "cli", "entry_points", "prelude", "prelude_patch"}


def test_the_root_holds_only_its_entry_modules():
    found = {p.stem for p in (REPO / PACKAGE).glob("*.py")}
    assert found == ROOT_MODULES, f"modules at the root of {PACKAGE}/ besides its entry modules (put each in the " \
        f"engine it serves or in a wing: {', '.join(WINGS)}): {sorted(found - ROOT_MODULES)}; missing: " \
        f"{sorted(ROOT_MODULES - found)}"


def test_a_wing_is_a_folder_that_imports_nothing():
    """A wing's __init__ is its docstring only: importing the wing imports none of its modules."""
    for wing in WINGS:
        body = ast.parse((REPO / PACKAGE / wing / "__init__.py").read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), \
            f"{PACKAGE}/{wing}/__init__.py holds more than its docstring"


# The commands: run by ``python -m`` (scripts/cluster/launch.sh, the docs) or behind a verb of verl_patches/cli.py
# (a string there, not an import). They are the top floor: no module of the package imports one.
COMMANDS = {f"{PACKAGE}.{m}" for m in ("checks.recipe_config", "launch.cluster_checks", "checks.layer_spec",
                                        "reporting.console", "reporting.plot", "reshard.cli", "preflight.cli",
                                        "rollout.long_tail.simulator")}


def test_no_module_imports_a_command():
    bad = sorted(f"{mod} imports {t}" for mod, edges in import_graph().items() for t in edges & COMMANDS)
    assert not bad, "a command imported as a library (move what both need below both):\n" + "\n".join(bad)


# The folder map (issue 49): every folder is one floor, and a module imports only modules of folders on its own
# floor or below it (no folder imports a folder above it), and no two folders are tied (each folder can be learnt
# before the ones above it). A folder is its package path; a subfolder sits on the floor of the longest listed
# prefix (patches/verl/ on patches', rollout/long_tail/ on rollout's, rigs/cpu/patches/vllm/ on the rigs'); "" is
# the root with its entry modules. The rigs are one wing on the top floor: the recipe below them reaches them
# through their one door only (RIG_DOOR below), so the recipe reads and runs without them.
FOLDER_FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ground: the accelerator facade, the environment table, the schema of inputs, the recipe's settings",
     ("base", "config")),
    ("registry: patch records, the lock, the doctor, the stash", ("core",)),
    ("engines and their reports", ("reshard", "reward", "tensor_cache", "train", "offload", "rollout", "tools", "data",
                                   "reporting")),
    ("patches: the catalogue and the recipe's changes to each upstream", ("patches",)),
    ("processes: local ranks, the prelude, the cluster launchers' checks", ("launch",)),
    ("commands: launch-time checks, the preflight, the entry modules", ("checks", "preflight", "")),
    ("the rigs: the CPU platform and its patch records, the NPU rehearsal, the tiny assets, the test helpers",
     ("rigs",)),
)


def folder_of(module: str, root: Path = REPO) -> str:
    """The folder (package path below the package, "" for the root) a module lies in; a package is its own folder."""
    parts = module.split(".")
    if not (root / Path(*parts)).is_dir():
        parts = parts[:-1]
    return ".".join(parts[1:])


def floor_of(folder: str) -> int:
    """The index in FOLDER_FLOORS of the longest listed prefix of ``folder``; KeyError if none."""
    best = (-1, -1)
    for i, (_, folders) in enumerate(FOLDER_FLOORS):
        for f in folders:
            if folder == f or (f and folder.startswith(f + ".")):
                best = max(best, (len(f), i))
    if best[1] < 0:
        raise KeyError(folder)
    return best[1]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, edges in graph.items():
        out.setdefault(folder_of(mod), set()).update(folder_of(t) for t in edges if folder_of(t) != folder_of(mod))
    return out


def test_every_folder_is_on_a_floor():
    missing = []
    for f in folder_graph(import_graph()):
        try:
            floor_of(f)
        except KeyError:
            missing.append(f or "(root)")
    assert not missing, f"folders on no floor of FOLDER_FLOORS (tests/test_import_graph.py): {missing}"


def test_the_floor_finder_and_the_folder_graph(tmp_path):
    assert floor_of("patches.verl") == floor_of("patches") != floor_of("rigs.cpu.patches.vllm") == floor_of("rigs.tiny")
    assert floor_of("rollout.long_tail") == floor_of("rollout") and floor_of("") == floor_of("checks")
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (pkg / f).write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    assert folder_of("pkg.sub", tmp_path) == "sub" and folder_of("pkg.sub.b", tmp_path) == "sub"
    assert folder_of("pkg.a", tmp_path) == ""


def test_no_folder_imports_a_folder_above_it():
    """Every edge points to its own floor or below, but the rig door's (RIG_DOOR_USERS: the platform's selection)."""
    bad = sorted(f"{mod} (floor {floor_of(folder_of(mod))}) imports {t} (floor {floor_of(folder_of(t))})"
                 for mod, edges in import_graph().items() for t in edges
                 if floor_of(folder_of(t)) > floor_of(folder_of(mod))
                 and not (t in DOOR_EDGES and mod in RIG_DOOR_USERS))
    assert not bad, "imports from a folder to a folder above it (move the module to the floor it needs, or the " \
                    "name it imports below both):\n" + "\n".join(bad)


def test_no_two_folders_are_tied():
    """Each strongly connected set of the folder graph (every import counted, function-level ones too) is one
    folder: a reader can learn the folders bottom-up."""
    cycles = find_cycles(folder_graph(import_graph()))
    assert not cycles, "folders tied by imports both ways:\n" + "\n".join(" -> ".join(c) for c in cycles)


RIGS = f"{PACKAGE}.rigs"
# The rig wing's one door: the NPU rehearsal platform's package (its selection, activation, banner line and which
# records apply there), imported by the modules that choose the process's platform. Nothing else of the recipe
# imports the rigs: the CPU platform's records are named by string in the catalogue (patches/__init__.py:
# CPU_MODULES, loaded by the registry like every record), vLLM finds the CPU platform through its entry point
# (pyproject.toml), and the tiny run's assets and the test helpers are run by scripts and tests.
RIG_DOOR = f"{RIGS}.npu_rehearsal"
# An import of the door names its wing too (``from verl_patches.rigs import npu_rehearsal``): the wing's __init__ is
# its docstring only (test_a_wing_is_a_folder_that_imports_nothing).
DOOR_EDGES = {RIGS, RIG_DOOR}
RIG_DOOR_USERS = {
    f"{PACKAGE}.prelude": "boot_rehearsal activates the stand-in when VERL_PATCHES_PLATFORM=npu-rehearsal "
                                 "is selected, and patches_for asks which records apply on it",
    f"{PACKAGE}.prelude_patch": "the process's banner names the torch_npu in use when the rehearsal is selected",
    f"{PACKAGE}.cli": "the doctor names the torch_npu in use, and the stand-in's site joins the upstream lock's "
                      "search path when the rehearsal is selected",
    f"{PACKAGE}.checks.layer_spec": "the layer-spec check runs on an NPU or on the rehearsal, selected by "
                                    "npu_rehearsal.selected(), and names the stand-in's site in its refusal",
}


def test_no_recipe_module_imports_the_rig_wing():
    """The rigs sit above the recipe: a module outside rigs/ imports only the rig door, and only its named users
    do (RIG_DOOR_USERS, each with its reason); the door imports nothing of the recipe above the registry."""
    graph = import_graph()
    edges = {(mod, t) for mod, out in graph.items() if not mod.startswith(RIGS + ".") for t in out
             if t == RIGS or t.startswith(RIGS + ".")}
    bad = sorted(f"{mod} imports {t}" for mod, t in edges if t not in DOOR_EDGES or mod not in RIG_DOOR_USERS)
    assert not bad, f"recipe modules that import the rig wing other than through its door ({RIG_DOOR}, by " \
                    f"RIG_DOOR_USERS):\n" + "\n".join(bad)
    assert {mod for mod, _ in edges} == set(RIG_DOOR_USERS), "RIG_DOOR_USERS names a module that no longer imports it"
    door = {t for t in graph[RIG_DOOR] if not t.startswith(RIGS + ".")}
    assert {folder_of(t) for t in door} <= {"base", "core"}, f"the rig door imports the recipe above core/: {door}"


LAUNCH = f"{PACKAGE}.launch"
# Who starts local processes: the preflight (its ranks, its process tree) and the test helpers; who runs the prelude:
# the entry modules and the layer-spec check. No engine spawns ranks.
LAUNCH_USERS = {f"{PACKAGE}.{m}" for m in ("preflight.cli", "rigs.testing.graph_switch",
                                           "rigs.testing.optimizer_offload", "rigs.testing.stop_on_sigterm")}


def test_the_launch_wing_is_reached_by_its_named_users():
    users = {mod for mod, edges in import_graph().items() if not mod.startswith(LAUNCH)
             for t in edges if t.startswith(LAUNCH + ".")}
    assert users == LAUNCH_USERS, f"modules outside {LAUNCH} that import it: {sorted(users)}"


ENGINES = ("core", "rigs.cpu", "offload", "reshard", "rollout", "tensor_cache", "train")


def test_no_engine_imports_the_reporting_wing():
    """The engines return figures; the patches hand them to the report (reporting/) and the checking commands
    print their findings with it."""
    bad = sorted(f"{mod} imports {t}" for mod, edges in import_graph().items()
                 if any(mod == f"{PACKAGE}.{e}" or mod.startswith(f"{PACKAGE}.{e}.") for e in ENGINES) for t in edges
                 if t.startswith(f"{PACKAGE}.reporting"))
    assert not bad, "an engine imports the reporting wing:\n" + "\n".join(bad)


def test_the_readme_layout_table_names_every_folder_and_root_module():
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    cells = " ".join(line.split("|")[1] for line in section.splitlines() if line.startswith("| `"))
    # The record folders (one per upstream) are named by their parent's row: patches/ and rigs/cpu/patches/.
    records = ("patches", CPU_RECORDS.removeprefix(PACKAGE + ".").replace(".", "/"))
    folders = sorted(f for f in (p.parent.relative_to(REPO / PACKAGE).as_posix()
                                 for p in (REPO / PACKAGE).rglob("__init__.py") if p.parent != REPO / PACKAGE)
                     if not any(f.startswith(r + "/") for r in records))
    missing = [f for f in folders if f"`{PACKAGE}/{f}/`" not in cells]
    missing += [f"{m}.py" for m in sorted(ROOT_MODULES) if f"`{PACKAGE}/{m}.py`" not in cells]
    if f"`{PACKAGE}/patches/`" not in cells:
        missing.append("patches")
    assert not missing, f"README.md's layout table does not name: {missing}"


# The CPU platform's patch records live in the rig wing (the catalogue names them by string: CPU_MODULES).
CPU_RECORDS = f"{PACKAGE}.rigs.cpu.patches"


def _is_record_module(m: str) -> bool:
    return m.startswith(f"{PACKAGE}.patches.") or m.startswith(CPU_RECORDS + ".")


def _patch_modules() -> set[str]:
    return {m for m in import_graph() if _is_record_module(m)}


def test_core_is_handed_the_patch_records():
    """No module of core/ imports the patch catalogue or a patch module, at import time or in a function:
    the registry is handed the module names by the catalogue (verl_patches.patches.load_catalogue)."""
    bad = sorted(f"{mod} imports {t}" for mod, edges in import_graph().items() if mod.startswith(f"{PACKAGE}.core")
                 for t in edges if t == f"{PACKAGE}.patches" or t.startswith(f"{PACKAGE}.patches."))
    assert not bad, "core/ imports the patch catalogue (hand the registry its records instead):\n" + "\n".join(bad)


def test_nothing_outside_patches_imports_a_patch_module():
    """A constant or helper that both a patch and other code need lives below both, not in the patch module.
    Code that needs a patch's replacement asks the catalogue for its record (``patches.get_patch``)."""
    patch_modules = _patch_modules()
    bad = []
    for path in sorted((REPO / PACKAGE).rglob("*.py")):
        mod = _module_name(path, REPO)
        if mod.startswith(f"{PACKAGE}.patches") or mod == CPU_RECORDS or _is_record_module(mod):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bad += [f"{mod} imports {a.name}" for a in node.names if a.name in patch_modules]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] if node.module in patch_modules else \
                    [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in patch_modules]
                for t in targets:
                    names = {a.name for a in node.names} if t == node.module else set()
                    bad.append(f"{mod} imports {t}" + (f" ({', '.join(sorted(names))})" if names else ""))
    assert not bad, "imports into a patch module from outside patches/ (move the name below both):\n" + "\n".join(bad)




def test_no_patch_imports_another_patch():
    """What patches share (a flag, a stash key, a context, a helper) lives below patches/, in the engine or
    feature module it belongs to: a patch module imports no other patch module, at import time or in a
    function, so each one reads on its own next to the upstream code it replaces."""
    patch_modules = _patch_modules()
    bad = sorted(f"{mod} imports {t}" for mod, edges in import_graph().items() if mod in patch_modules
                 for t in edges if t in patch_modules and t != mod)
    assert not bad, "a patch imports a sibling patch (move the shared name below patches/):\n" + "\n".join(bad)

RECIPE_FOLDERS = ("megatron", "mindspeed", "verl", "vllm", "vllm_ascend")


def test_the_recipe_folders_hold_the_recipe_changes_only():
    """patches/<upstream>/ shows the recipe's changes: a record that applies only on the CPU platform lives
    under rigs/cpu/patches/<upstream>/ (and only such records do), and every module of either is in the catalogue."""
    from verl_patches.core.registry import load_registry
    from verl_patches.patches import CPU_MODULES, CPU_PACKAGE, PATCH_MODULES, RECIPE_MODULES

    bad = sorted(f"{p.id} ({p.replacement.split(':')[0]})" for p in load_registry(PATCH_MODULES)
                 if p.replacement.startswith(CPU_PACKAGE + ".") != (p.platforms == ("cpu",)))
    assert not bad, "CPU-only records outside rigs/cpu/patches/, or others inside it:\n" + "\n".join(bad)
    assert CPU_PACKAGE == CPU_RECORDS
    listed = _patch_modules() - {f"{PACKAGE}.patches.{f}" for f in RECIPE_FOLDERS} \
        - {f"{CPU_PACKAGE}.{f}" for f in RECIPE_FOLDERS + ("torch",)}
    assert listed == set(PATCH_MODULES)
    assert all(m.split(".")[2] in RECIPE_FOLDERS for m in RECIPE_MODULES)
    assert all(m.startswith(CPU_PACKAGE + ".") for m in CPU_MODULES)


LONG_TAIL = f"{PACKAGE}.rollout.long_tail"
# Who imports the long tail's wing: the CPU generation stand-in that runs the rebalance, and the rollout
# patch that reads recipe.rebalance (and refuses it on a device). The rollout-plan verb names
# rollout.long_tail.simulator:main in verl_patches/cli.py, a string, not an import.
LONG_TAIL_USERS = {f"{PACKAGE}.rigs.cpu.engine", f"{PACKAGE}.patches.verl.patch_workers_rollout_vllm_rollout_spmd"}


def test_the_long_tail_is_a_wing_of_its_own():
    """rollout/ holds the recipe's rollout; the rebalance (policy, simulator, mechanism, KV transfer, the move
    inside vLLM) is rollout/long_tail/, which no module of rollout/ imports and only its named users reach."""
    users = {mod for mod, edges in import_graph().items() if not mod.startswith(LONG_TAIL)
             for t in edges if t.startswith(LONG_TAIL)}
    assert users == LONG_TAIL_USERS, f"modules outside {LONG_TAIL} that import it: {sorted(users)}"

def _names_the_recipe_section(tree: ast.AST) -> list[int]:
    """Lines that spell the recipe section's path or key themselves instead of asking verl_patches.config.settings."""
    from verl_patches.config import settings

    paths = {settings.SECTION, settings.SECTION_IN_WORKER}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in paths:
            lines.append(node.lineno)
        elif isinstance(node, ast.Tuple):
            vals = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if any(vals[i:i + 2] == ["rollout", settings.SECTION_IN_ROLLOUT] for i in range(len(vals))):
                lines.append(node.lineno)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and node.value.value == settings.SECTION_IN_ROLLOUT:
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value == settings.SECTION_IN_ROLLOUT
                                                for a in node.args):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in ("get", "_get", "getattr", "select", "_select", "lookup"):
                lines.append(node.lineno)
    return lines


def test_one_settings_module_is_imported_by_every_reader():
    """The recipe section is found and its types checked in verl_patches/config/settings.py only: the rollout's
    settings, the launch-time validator and the run report import it, and no other module spells the
    section's path to look it up itself."""
    graph = import_graph()
    readers = {f"{PACKAGE}.rollout.settings", f"{PACKAGE}.checks.recipe_config",
               f"{PACKAGE}.rollout.long_tail.rebalance",
               f"{PACKAGE}.patches.verl.patch_utils_tracking"}
    assert {r for r in readers if f"{PACKAGE}.config.settings" not in graph[r]} == set()
    bad = []
    for path in sorted((REPO / PACKAGE).rglob("*.py")):
        mod = _module_name(path, REPO)
        if mod != f"{PACKAGE}.config.settings":
            bad += [f"{mod}:{line}" for line in _names_the_recipe_section(ast.parse(path.read_text(), str(path)))]
    assert not bad, "the recipe section looked up outside verl_patches/config/settings.py (use settings.read / " \
                    "settings.problems / settings.trainer_section):\n" + "\n".join(bad)


# Dependencies at the head (issue 38): a module's imports of the package sit at its head, where a reader sees
# them. Only an import of an upstream package (torch, vllm, megatron, verl, ...) may wait in a function, where
# import order or cost requires it, and it says why in a comment on its line or just above its block. The one
# exception is cost met through the package: a module the catalogue and the CLI load (LIGHT and what they import
# at import time: the doctor reads the catalogue in a Python without the stack, tests/core/test_doctor_cli.py)
# imports lazily a module of the package that imports an upstream package at its head. Any other lazy import of the
# package is named in LAZY_OWN.
LIGHT = (f"{PACKAGE}.cli", f"{PACKAGE}.core", f"{PACKAGE}.patches", f"{PACKAGE}.rigs.cpu.patches")
# The overlay's one dependency besides the standard library (pyproject.toml): a light module may import it.
OVERLAY_DEPENDENCIES = {"packaging"}
# importer -> module of the package it imports in a function, and why.
LAZY_OWN = {
    (f"{PACKAGE}.reshard.checksum", f"{PACKAGE}.reshard.fingerprint_kernel"):
        "the fused fingerprint kernel is written in Triton, which is optional (none on an NPU or a CPU-only "
        "build): the kernel's module is imported where Triton is tried",
    (f"{PACKAGE}.reshard.fp8_block", f"{PACKAGE}.reshard.fp8_block_kernel"):
        "the fused FP8 quantisation kernel is written in Triton, optional in the same way: its module is imported "
        "where Triton is tried",
}


def light_modules(root: Path = REPO, package: str = PACKAGE, light: tuple[str, ...] = LIGHT) -> set[str]:
    """The modules under LIGHT and every module of the package they import at import time (parents included)."""
    graph = import_graph(root, package, import_time=True)
    table = facades(root, package)
    for m, path in {_module_name(p, root): p for p in (root / package).rglob("*.py")}.items():
        graph[m] = graph[m] | _through_facades(ast.parse(path.read_text(), str(path)), m, path.name == "__init__.py",
                                               table, True)
    todo = [m for m in graph if any(m == p or m.startswith(p + ".") for p in light)]
    seen: set[str] = set()
    while todo:
        m = todo.pop()
        if m in seen or m not in graph:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += list(graph[m]) + [".".join(parts[:i]) for i in range(1, len(parts))]
    return seen


def _head_upstream(tree: ast.AST) -> set[str]:
    """Top-level names of the packages outside the standard library and ``PACKAGE`` that importing the module
    imports itself (function bodies and ``if TYPE_CHECKING:`` skipped; relative imports are the package's)."""
    out: set[str] = set()
    for node in _import_time_nodes(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add((node.module or "").split(".")[0])
    return {n for n in out if n and n != PACKAGE and n not in sys.stdlib_module_names and n != "__future__"}


def facades(root: Path = REPO, package: str = PACKAGE) -> dict[str, dict[str, str]]:
    """package -> {name: module} for the packages whose public names are imported on first use (``lazy_names``
    over a ``_WHERE`` table): ``from verl_patches.offload import OffloadEngine`` imports offload.pool."""
    out = {}
    for path in (root / package).rglob("__init__.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_WHERE"]:
                out[_module_name(path, root)] = eval(compile(ast.Expression(node.value), str(path), "eval"),
                                                     {"__builtins__": {}, "dict": dict})
    return out


def _through_facades(tree: ast.AST, mod: str, is_package: bool, table: dict[str, dict[str, str]],
                     import_time: bool) -> set[str]:
    """The modules that names imported from a facade (``facades``) live in."""
    out = set()
    for node in ast.walk(tree) if not import_time else _import_time_nodes(tree):
        if isinstance(node, ast.ImportFrom):
            prefix = next(iter(_imports(ast.Module(body=[ast.ImportFrom(module=node.module, names=[], level=node.level)],
                                                   type_ignores=[]), mod, is_package)))
            out.update(table[prefix][a.name] for a in node.names if a.name in table.get(prefix, {}))
    return out


def _import_time_nodes(tree: ast.AST) -> list[ast.AST]:
    nodes = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            nodes.append(child)
            visit(child)

    visit(tree)
    return nodes


def upstream_at_import(root: Path = REPO, package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> the upstream packages that importing it imports: its own head's, and those of every module of
    the package it imports at import time (parent packages included: importing a.b runs a's __init__)."""
    files = {_module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph = import_graph(root, package, import_time=True)
    table = facades(root, package)
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in files.items()}
    for m, tree in trees.items():
        graph[m] = graph[m] | _through_facades(tree, m, files[m].name == "__init__.py", table, True)
    own = {m: _head_upstream(tree) for m, tree in trees.items()}
    out: dict[str, set[str]] = {}
    for mod in files:
        seen, todo, found = set(), [mod], set()
        while todo:
            m = todo.pop()
            if m in seen or m not in files:
                continue
            seen.add(m)
            found |= own[m]
            todo += list(graph.get(m, ()))
            parts = m.split(".")
            todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        out[mod] = found
    return out


def _comment_lines(source: str) -> set[int]:
    return {t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}


def function_level_imports(root: Path = REPO, package: str = PACKAGE) -> list[tuple[str, int, str, set[str], bool]]:
    """(module, line, statement, modules of the package it imports, has a reason comment) for every import inside a
    function. The reason is a comment on the statement's lines or on the line just above its block: the
    statements (and ``try:`` lines) that run on without a blank line share the comment above the first."""
    files = {_module_name(p, root): p for p in (root / package).rglob("*.py")}
    table = facades(root, package)
    out = []
    for mod, path in sorted(files.items()):
        source = path.read_text()
        tree = ast.parse(source, str(path))
        lines = source.splitlines()
        comments = _comment_lines(source)
        lazy: list[ast.stmt] = []

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                    lazy.append(child)
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(tree, False)
        import_lines = {ln for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                        for ln in range(n.lineno, n.end_lineno + 1)}
        for node in lazy:
            reason = any(ln in comments for ln in range(node.lineno, node.end_lineno + 1))
            above = node.lineno - 1
            while not reason and above >= 1 and (above in import_lines or lines[above - 1].strip() == "try:"):
                reason = above in comments
                above -= 1
            reason = reason or (above >= 1 and lines[above - 1].lstrip().startswith("#"))
            through = _through_facades(ast.Module(body=[node], type_ignores=[]), mod, path.name == "__init__.py",
                                       table, False)
            # A name read through a facade is an import of the module it lives in, not of the facade.
            targets = (_targets(node, mod, path.name == "__init__.py", files) - (set(table) if through else set())) \
                | through
            out.append((mod, node.lineno, ast.unparse(node), targets, reason))
    return out


def _targets(node: ast.Import | ast.ImportFrom, mod: str, is_package: bool, files: dict) -> set[str]:
    """The package's modules one import statement imports, each the deepest module its name reaches."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = _imports(ast.Module(body=[ast.ImportFrom(module=node.module, names=[], level=node.level)],
                                   type_ignores=[]), mod, is_package)
        prefix = next(iter(base))
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in files else prefix for a in node.names]
    out = set()
    for name in names:
        parts = name.split(".")
        while parts and ".".join(parts) not in files:
            parts.pop()
        if parts:
            out.add(".".join(parts))
    return out


def lazy_own_problems(root: Path = REPO, package: str = PACKAGE, light: tuple[str, ...] = LIGHT,
                      allowed: dict | None = None) -> list[str]:
    """Function-level imports of the package that break the rule above, and function-level imports without a
    reason comment."""
    allowed = LAZY_OWN if allowed is None else allowed
    upstream = upstream_at_import(root, package)
    lights = light_modules(root, package, light)
    bad = []
    for mod, line, stmt, targets, reason in function_level_imports(root, package):
        where = f"{mod}:{line}: {stmt}"
        is_light = mod in lights
        for t in sorted(targets):
            if (mod, t) in allowed:
                continue
            if not is_light:
                bad.append(f"{where}: imports {t} in a function (move it to the module's head)")
            elif not upstream[t] - OVERLAY_DEPENDENCIES:
                bad.append(f"{where}: {t} imports no upstream package at its head (move it to the module's head)")
        if not reason:
            bad.append(f"{where}: a function-level import without a reason comment (on its line or just above)")
    return bad


def test_the_lazy_import_checker_catches_a_lazy_own_import_and_a_missing_reason(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "patches").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "patches" / "__init__.py").write_text("")
    (pkg / "heavy.py").write_text("import torch\n")
    (pkg / "plain.py").write_text("X = 1\n")
    (pkg / "patches" / "p.py").write_text(
        "def f():\n    # Lazy: heavy imports torch.\n    from pkg import heavy\n\n"
        "def g():\n    from pkg import plain\n    import torch\n\n"
        "def h():\n    # Lazy: torch is costly; one comment covers the block.\n    import torch\n    import vllm\n")
    (pkg / "engine.py").write_text("def f():\n    from pkg import heavy  # lazy, but not a light module\n")
    light = ("pkg.patches",)
    bad = lazy_own_problems(tmp_path, "pkg", light, {})
    assert upstream_at_import(tmp_path, "pkg")["pkg.heavy"] == {"torch"}
    assert any("pkg.patches.p:6" in b and "pkg.plain imports no upstream" in b for b in bad), bad
    assert any("pkg.patches.p:6" in b and "without a reason" in b for b in bad), bad
    assert any("pkg.patches.p:7" in b and "without a reason" in b for b in bad), bad
    assert any(b.startswith("pkg.engine:2") and "move it to the module's head" in b for b in bad), bad
    assert not [b for b in bad if "pkg.patches.p:3" in b or ":11" in b or ":12" in b], bad
    assert lazy_own_problems(tmp_path, "pkg", light, {("pkg.engine", "pkg.heavy"): "why"}) == \
        [b for b in bad if not b.startswith("pkg.engine")]


def test_the_package_imports_itself_at_the_heads():
    """No function-level import of the package's own modules outside the rule above (LIGHT, LAZY_OWN), and every
    function-level import says why it waits."""
    bad = lazy_own_problems()
    assert not bad, "function-level imports against issue 38's rule (tests/test_import_graph.py):\n" + "\n".join(bad)


def test_the_light_modules_import_no_upstream_package():
    """What the catalogue and the CLI load imports nothing but the standard library and packaging, so the doctor
    runs in a Python without the stack: an import of a module of the package that imports torch waits in the
    function that needs it."""
    lights = light_modules()
    bad = sorted(f"{m}: {', '.join(sorted(u - OVERLAY_DEPENDENCIES))}" for m, u in upstream_at_import().items()
                 if m in lights and u - OVERLAY_DEPENDENCIES)
    assert not bad, "modules the catalogue or the CLI load import upstream packages at import time:\n" + "\n".join(bad)


def test_the_allowlist_is_used():
    used = {(mod, t) for mod, _, _, targets, _ in function_level_imports() for t in targets}
    assert set(LAZY_OWN) <= used, f"LAZY_OWN names imports that are no longer lazy: {sorted(set(LAZY_OWN) - used)}"

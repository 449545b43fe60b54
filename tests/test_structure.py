"""The package layout: one folder per concern, the runtime core at the top, no import cycles.

``prhs_hf/`` holds the runtime core (patching, runtime, layers, attention, geometry, config ...)
and one folder per other concern: ``hub/`` (offline fetching), ``calibration/``, ``evaluation/``
(RULER, lm-eval, the accuracy runner, the speed map), ``selectors/`` and ``ops/`` (the Triton
kernels, one folder per op, installed from where they live). These tests pin that shape,
and where the evaluation pieces live: the direct accuracy runner outside the lm-eval integration,
and no import from ``prhs_hf.evaluation.lm_eval`` to the command line.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "prhs_hf"
OPS = PACKAGE / "ops"

#: The top of ``prhs_hf/``: the runtime core, the command line, and the concern folders.
TOP_LEVEL = {
    "__init__.py", "__main__.py", "attention.py", "backends.py", "cli.py", "compat.py", "config.py", "decode.py",
    "families.py", "fetch.py", "geometry.py", "layer.py", "patching.py", "policy.py", "runtime.py",
    "schedules.py", "telemetry_counters.py",
    "calibration", "evaluation", "hub", "ops", "selectors",
}
#: Folders that are not the runtime core: the core must not import them.
OUTER = ("prhs_hf.hub", "prhs_hf.calibration", "prhs_hf.evaluation")
#: Modules at the top that are front doors rather than core: the command line and the deprecated
#: ``prhs_hf.fetch`` alias of ``prhs_hf.hub.fetch``.
FRONT_DOORS = {"prhs_hf.cli", "prhs_hf.__main__", "prhs_hf.fetch"}
MAX_KERNEL_FILE_LINES = 800


def _module_files() -> dict[str, Path]:
    """Every module of the installed package, by its dotted name."""
    files: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(("prhs_hf",) + parts)] = path
    return files


MODULES = _module_files()


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules that ``path`` imports, at any depth (function-level imports too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    modules = set()
    for imported in found:
        while imported and imported not in MODULES:
            imported = imported.rpartition(".")[0]
        if imported and imported != name:
            modules.add(imported)
    return modules


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _imports_in_a_fresh_interpreter(statement: str, watched: tuple[str, ...]) -> list[str]:
    code = f"import sys; {statement}; print(sorted(m for m in {watched!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return eval(result.stdout.strip().splitlines()[-1])  # noqa: S307 - our own printed list


def test_no_module_of_the_lm_eval_integration_imports_the_command_line() -> None:
    integration = [m for m in GRAPH if m.startswith("prhs_hf.evaluation.lm_eval")]
    assert integration and [m for m in integration if "prhs_hf.cli" in GRAPH[m]] == []


def test_importing_the_lm_eval_model_does_not_load_the_command_line() -> None:
    assert _imports_in_a_fresh_interpreter("import prhs_hf.evaluation.lm_eval.plugin", ("prhs_hf.cli",)) == []


def test_the_direct_runner_lives_outside_lm_eval_and_needs_no_lm_eval() -> None:
    import prhs_hf.evaluation.accuracy.configs
    import prhs_hf.evaluation.accuracy.direct
    import prhs_hf.evaluation.accuracy.report

    for module in (prhs_hf.evaluation.accuracy.direct, prhs_hf.evaluation.accuracy.configs, prhs_hf.evaluation.accuracy.report):
        assert Path(module.__file__).parent == PACKAGE / "evaluation" / "accuracy"
    loaded = _imports_in_a_fresh_interpreter(
        "import prhs_hf.evaluation.accuracy.direct, prhs_hf.evaluation.accuracy.configs, prhs_hf.evaluation.accuracy.report",
        ("lm_eval", "datasets", "prhs_hf.evaluation.lm_eval.plugin", "prhs_hf.cli"))
    assert loaded == []


def test_the_direct_runner_has_one_home() -> None:
    """The moved modules live in prhs_hf/evaluation/accuracy only: no alias or copy stays in lm_eval/."""
    for name in ("direct", "accuracy_configs", "report", "configs"):
        assert not (PACKAGE / "evaluation" / "lm_eval" / f"{name}.py").exists(), name


def test_no_selector_imports_the_patch_or_the_runtime() -> None:
    """The selectors sit below the runtime: the calibration pass may then import the patch
    (``is_patched``) without a cycle."""
    selectors = [m for m in GRAPH if m.startswith("prhs_hf.selectors")]
    assert len(selectors) > 5
    assert {m: sorted(GRAPH[m] & {"prhs_hf.patching", "prhs_hf.runtime"}) for m in selectors
            if GRAPH[m] & {"prhs_hf.patching", "prhs_hf.runtime"}} == {}


def test_is_patched_has_one_home_with_the_patch() -> None:
    """``prhs_hf.is_patched`` is the function of patching.py; families.py holds the model families only."""
    import prhs_hf.families
    import prhs_hf.patching

    assert prhs_hf.is_patched is prhs_hf.patching.is_patched
    assert not hasattr(prhs_hf.families, "is_patched")


def test_the_top_of_the_package_is_the_runtime_core_and_the_concern_folders() -> None:
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and not p.name.endswith(".pyc")}
    assert entries == TOP_LEVEL
    # compat.py: what differs between the transformers versions supported; ops/: the kernels
    assert len(entries) <= 22


@pytest.mark.parametrize("folder", ["hub", "calibration", "evaluation", "selectors", "ops"])
def test_every_concern_folder_is_a_package(folder: str) -> None:
    assert (PACKAGE / folder / "__init__.py").is_file()


#: The op folders of ``prhs_hf/ops/``: the steps of a CIS decode step and the prefill.
OP_FOLDERS = {"cis_match", "topk", "key_index", "compose", "sparse_attention", "prefill"}


def test_every_op_has_a_folder_that_is_a_package_and_nothing_else_holds_kernels() -> None:
    """``prhs_hf/ops/`` holds one package per op and the shared plumbing; no top-level ``kernels/``
    folder is left to be installed under another name."""
    folders = {p.name for p in OPS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == OP_FOLDERS
    assert all((OPS / f / "__init__.py").is_file() for f in folders)
    assert not list(ROOT.glob("kernels/*.py"))  # (a checkout may keep an old kernels/__pycache__)


def test_the_import_graph_has_no_cycles() -> None:
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_runtime_core_imports_nothing_from_hub_calibration_or_evaluation() -> None:
    core = [m for m in GRAPH if not m.startswith(OUTER) and m not in FRONT_DOORS]
    assert "prhs_hf.runtime" in core and "prhs_hf.selectors.cis" in core and "prhs_hf.ops.decode_ops" in core
    offenders = {m: sorted(e for e in GRAPH[m] if e.startswith(OUTER)) for m in core}
    assert {m: e for m, e in offenders.items() if e} == {}


def test_the_kernels_import_nothing_of_the_runtime() -> None:
    """``ops/`` is a library of ops with their references: it imports only its own modules."""
    offenders = {m: sorted(e for e in GRAPH[m] if not e.startswith("prhs_hf.ops"))
                 for m in GRAPH if m.startswith("prhs_hf.ops")}
    assert {m: e for m, e in offenders.items() if e} == {}


def test_no_kernel_file_is_over_800_lines() -> None:
    lengths = {str(p.relative_to(OPS)): len(p.read_text().splitlines()) for p in OPS.rglob("*.py")}
    assert lengths and {n: k for n, k in lengths.items() if k > MAX_KERNEL_FILE_LINES} == {}


def test_the_deprecated_fetch_alias_is_the_hub_fetcher() -> None:
    import warnings

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        import prhs_hf.fetch as alias
    import prhs_hf.hub.fetch as fetch

    assert alias.load_model is fetch.load_model


def test_parametrize_marks_sit_on_test_functions() -> None:
    """A ``pytest.mark.parametrize`` on a helper is lost: the test below it then asks for its
    parameters as fixtures and errors at setup (only where it runs: GPU tests run on the device)."""
    misplaced = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("test"):
                if any("parametrize" in ast.unparse(d) for d in node.decorator_list):
                    misplaced.append(f"{path.name}:{node.lineno} {node.name}")
    assert misplaced == []

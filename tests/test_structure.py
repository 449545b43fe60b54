"""Where things live (issue 14): the direct accuracy runner outside the lm-eval integration, and no
import cycle between the command line and ``prhs_hf.evaluation.lm_eval``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "prhs_hf"


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included), as absolute names."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def _imports_in_a_fresh_interpreter(statement: str, watched: tuple[str, ...]) -> list[str]:
    code = f"import sys; {statement}; print(sorted(m for m in {watched!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return eval(result.stdout.strip().splitlines()[-1])  # noqa: S307 - our own printed list


def test_no_module_of_the_lm_eval_integration_imports_the_command_line() -> None:
    offenders = {p.name for p in (PACKAGE / "evaluation" / "lm_eval").glob("*.py") if "prhs_hf.cli" in _imported_modules(p)}
    assert offenders == set()


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


def test_the_selectors_calibrate_without_importing_patching() -> None:
    """Double Sparsity's calibration once took its attention function from calibrate.py and
    ``is_patched`` from patching.py, which imports the runtime and with it every selector: a cycle.
    The calibration pass and the patch check live in modules below both."""
    for path in (PACKAGE / "selectors").glob("*.py"):
        imported = _imported_modules(path)
        assert {"prhs_hf.patching", "prhs_hf.calibration.calibrate", "prhs_hf.runtime"} & imported == set(), path.name
    assert "prhs_hf.patching" not in _imported_modules(PACKAGE / "calibration" / "dense_pass.py")
    loaded = _imports_in_a_fresh_interpreter(
        "import prhs_hf.calibration.dense_pass", ("prhs_hf.patching", "prhs_hf.runtime", "prhs_hf.selectors"))
    assert loaded == []


def test_is_patched_has_one_home_below_the_runtime() -> None:
    """``prhs_hf.is_patched`` is the function of families.py (patching re-exports it): asking
    whether a model is patched loads neither the runtime nor the selectors."""
    loaded = _imports_in_a_fresh_interpreter(
        "import prhs_hf; prhs_hf.is_patched", ("prhs_hf.patching", "prhs_hf.runtime", "prhs_hf.selectors"))
    assert loaded == []

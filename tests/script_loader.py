"""Import a script of ``scripts/`` or ``tools/`` into a test, the way it runs as ``python SCRIPT``.

A script is not a package module, so tests load it from its file. Two things must hold for that to
work as when it runs: the module is registered in ``sys.modules`` under its name before it executes
(``@dataclass`` looks its class's module up there: without it, a script with a dataclass fails to
import with an ``AttributeError`` inside ``dataclasses``), and the script's folder is on ``sys.path``
(its sibling imports, e.g. ``_bench_common``; left there, as later lazy imports need it too).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


def load_script(name: str, folder: Path = SCRIPTS) -> ModuleType:
    """``folder/name.py`` imported as the module ``name`` (the one in ``sys.modules`` if already loaded)."""
    if name in sys.modules:
        return sys.modules[name]
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module

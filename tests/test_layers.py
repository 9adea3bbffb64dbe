"""The package's architecture: one folder per stage, imports running one way, down.

Every import counts: module level, inside functions, and under ``TYPE_CHECKING`` (a type-only
import is still a dependency a reader must follow).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "hf_lsad"
FLOORS = [
    ("errors", "version"),  # what every stage raises and reports
    ("core",),  # identity of a hook point, strict I/O, validation, settings, splits, metrics, Hub folders
    ("data",),  # prompt pools, activation stores, response labels
    ("capture",),  # stage 1: reading the residual stream of a model
    ("sae",),  # stage 2: sparse autoencoders
    ("detectors",),  # stages 3-5: clustering, masks, scores and the methods
    ("guard",),  # thresholds, calibration, the decision, its files and card, explanations, fits
    ("generation",),  # guarded generate, screening, stopping, pipeline, screening a table
    ("serving",),  # the OpenAI-compatible HTTP server
    ("evaluation",),  # protocols and reports over guards
    ("cli",),  # the command
    ("__init__", "testing"),  # the public face
]
FLOOR = {entry: i for i, entries in enumerate(FLOORS) for entry in entries}


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def floor_of(module: str) -> int:
    return FLOOR[module.split(".")[0]]


def imports_of(path: Path) -> set[str]:
    """Every module of hf_lsad that ``path`` imports, wherever the import statement is."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if name == "__init__":
        package = []
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and (node.module == "hf_lsad" or node.module.startswith("hf_lsad.")):
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                candidate = ".".join([*base, alias.name])
                found.add(candidate if candidate in MODULES else ".".join(base) or "__init__")
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("hf_lsad.")}
    return found - {name}


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def test_every_folder_and_top_module_has_a_floor():
    assert {m.split(".")[0] for m in MODULES} <= set(FLOOR), "add the new folder to FLOORS (and docs/design.md)"


def test_every_import_names_a_module():
    unknown = {(name, target) for name, targets in GRAPH.items() for target in targets if target not in MODULES}
    assert not unknown


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_from_a_higher_floor(name):
    above = sorted(m for m in GRAPH[name] if floor_of(m) > floor_of(name))
    assert not above, f"{name} (floor {floor_of(name)}) imports {above} from above"


def test_no_import_cycle():
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join([*trail, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node, [])


def test_a_cycle_and_an_upward_import_would_be_seen(tmp_path):
    """The scan itself: function-local and TYPE_CHECKING imports count."""
    module = tmp_path / "probe.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from hf_lsad.cli import main\n"
        "def f():\n    from hf_lsad.generation import model\n"
    )
    global PACKAGE
    saved = PACKAGE
    try:
        PACKAGE = tmp_path
        assert imports_of(module) == {"cli.main", "generation.model"}
    finally:
        PACKAGE = saved


def test_core_and_detectors_import_without_transformers():
    code = (
        "import sys, hf_lsad.core.hook_point, hf_lsad.detectors, hf_lsad.core.serialization; "
        "print(sorted(m for m in ('transformers', 'peft') if m in sys.modules))"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )


def test_help_imports_neither_torch_nor_transformers():
    code = "import sys; from hf_lsad.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


def test_loading_and_scoring_a_guard_imports_no_sklearn_and_no_scipy_stats():
    # scikit-learn takes seconds to import: only fits (GMM, One-Class SVM, calibration) and metrics pay for it;
    # scipy.stats over a second: only setting thresholds with a confidence does.
    code = (
        "import sys, torch; from hf_lsad.guard import SafetyGuard; g = SafetyGuard.from_pretrained('default'); "
        "g({read: torch.zeros(2, g.config.hook.hidden_size) for read in g.reads}); "
        "print('sklearn' in sys.modules, 'scipy.stats' in sys.modules)"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False False"
    )

"""The package's layering (README, "Design"): no module imports a module above it, no import cycle,
and the identity and detector layers import without transformers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "hf_lsad"
LAYERS = [
    ["version", "errors", "hook_point", "runtime", "config_validation", "serialization", "settings", "metrics", "checks",
     "splits", "refusal", "fit_checks", "guard_integrity", "prompt_inputs"],
    ["store", "data", "data.pools", "data.chat_filters"],
    ["sae", "clustering", "masks", "scores", "threshold", "calibration", "explain", "running_guard"],
    ["detectors.base", "detectors.freqmask", "detectors.learned_mask_config", "detectors.learned_mask_training",
     "detectors.learned_mask", "detectors.mahalanobis", "detectors.gmm", "detectors.ocsvm", "detectors.deep_svdd",
     "detectors.cvdd", "detectors.linear_probe", "detectors.knn", "detectors"],
    ["hub", "sae_formats.common", "sae_formats.saelens", "sae_formats.sparsify", "sae_formats.gemma_scope",
     "sae_formats.loading", "sae_formats", "model_card", "guard_types", "guard_files", "guard",
     "fitting"],
    ["capture", "input_checks", "generation_control", "guarded_generation", "pipeline", "running_fit", "modeling_files",
     "modeling", "pretrained", "sharded_collection", "testing"],
    ["evaluation.protocol", "evaluation.diagnostic_measures", "evaluation.diagnostics", "evaluation.grid",
     "evaluation.sae_cache", "evaluation.report", "evaluation.evaluate_metric", "evaluation"],
    ["cli_arguments", "cli_checks", "explain_cli", "cli_commands", "cli", "__init__"],
]  # fmt: skip
LAYER = {module: i for i, modules in enumerate(LAYERS) for module in modules}


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def package_imports(path: Path) -> set[str]:
    """Modules of hf_lsad that ``path`` imports (type-checking-only imports excluded)."""
    name = module_name(path)
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    tree = ast.parse(path.read_text())
    checking = {
        id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in ast.walk(block)
    }  # fmt: skip
    found = set()
    for node in ast.walk(tree):
        if id(node) in checking:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.startswith("hf_lsad"):
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                candidate = ".".join([*base, alias.name])
                found.add(candidate if candidate in LAYER else ".".join(base) or "__init__")
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("hf_lsad.")}
    return found - {name}


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_every_module_has_a_layer():
    assert set(MODULES) <= set(LAYER), f"add {sorted(set(MODULES) - set(LAYER))} to LAYERS (and the README)"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_a_module_above_it(name):
    above = {m for m in package_imports(MODULES[name]) if LAYER.get(m, -1) > LAYER[name]}
    if name == "__init__":
        above = set()  # the root re-exports lazily (PEP 562)
    assert not above, f"{name} (layer {LAYER[name]}) imports {sorted(above)} from above"


def test_no_import_cycle():
    graph = {name: {m for m in package_imports(path) if m in MODULES} for name, path in MODULES.items()}
    graph["__init__"] = {"version"}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join([*trail, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


def test_identity_and_detector_layers_import_without_transformers():
    code = "import sys, hf_lsad.hook_point, hf_lsad.detectors; print(sorted(m for m in ('transformers', 'peft') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def test_help_imports_neither_torch_nor_transformers():
    code = "import sys; from hf_lsad.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_loading_and_scoring_a_guard_imports_no_sklearn():
    # scikit-learn takes seconds to import: only fits (GMM, One-Class SVM, calibration) and metrics pay for it.
    code = ("import sys, torch; from hf_lsad.guard import SafetyGuard; g = SafetyGuard.from_pretrained('default'); "
            "g(torch.zeros(2, g.config.hook.hidden_size)); print('sklearn' in sys.modules)")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"

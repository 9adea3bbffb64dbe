"""The benchmark suite is consistent: every experiment builds its settings, every result is indexed."""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import run  # noqa: E402  (benchmarks/run.py, importable once its folder is on the path)


@pytest.mark.parametrize("name", run.experiment_names())
def test_every_experiment_names_a_runner_whose_settings_build(name):
    experiment = run.load_experiment(name)
    module = importlib.import_module(experiment["runner"])
    settings = run.build_settings(module.Settings, experiment.get("settings", {}))
    assert dataclasses.is_dataclass(settings) and callable(module.run)
    for field in dataclasses.fields(module.Settings):  # sparsify-style: every setting says what it is
        assert _has_field_docstring(module, field.name), f"{name}: setting {field.name} has no docstring"


def _has_field_docstring(module, name: str) -> bool:
    """Whether field ``name`` of the module's ``Settings`` is followed by a docstring (sparsify's convention), in the
    class that declares it (a ``Settings`` may extend another study's)."""
    import ast
    import inspect

    for cls in module.Settings.__mro__:
        if name not in vars(cls).get("__annotations__", {}):  # declared here, not inherited
            continue
        tree = ast.parse(Path(inspect.getfile(cls)).read_text())
        settings = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
        body = settings.body
        for i, node in enumerate(body[:-1]):
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
                after = body[i + 1]
                return isinstance(after, ast.Expr) and isinstance(getattr(after, "value", None), ast.Constant)
    return False


def test_every_result_belongs_to_an_experiment_and_records_its_command_and_commit():
    names = {run.result_path(name).name for name in run.experiment_names()}
    for path in (BENCHMARKS / "results").iterdir():
        assert path.name in names, f"{path.name} has no experiment"
        record = json.loads(path.read_text())
        assert {"experiment", "claim", "command", "commit", "settings", "result"} <= set(record), path.name
        machine_paths = [text for text in _strings(record) if "/work/" in text or text.startswith("/home/")]
        assert not machine_paths, f"{path.name}: a machine path, {machine_paths[0]!r}"


def _strings(value: object) -> list[str]:
    """Every string a JSON value holds, keys too. Rows of a study may quote paths ('How many hidden files are in
    /home/agent?'); a path of the machine the study ran on starts a string or names the project's folder."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for key, item in value.items() for s in (key, *_strings(item))]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return []


def test_the_index_is_current(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "INDEX", tmp_path / "INDEX.md")
    run.write_index()
    assert (tmp_path / "INDEX.md").read_text() == (BENCHMARKS / "INDEX.md").read_text(), (
        "benchmarks/INDEX.md is stale: python benchmarks/run.py --index"
    )


def test_every_archived_result_has_a_claim():
    for manifest in (BENCHMARKS / "archive").glob("*/MANIFEST.json"):
        claims = json.loads(manifest.read_text())["results"]
        files = {p.name for p in (manifest.parent / "results").iterdir()}
        assert files == set(claims), manifest

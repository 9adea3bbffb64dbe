"""The bundled guards' model cards are the ones the release script writes from the committed results: a figure on a
card is a measured one, and a re-run study whose card was not rewritten fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hf_lsad.guard import DEFAULT_GUARD, SafetyGuard

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "release_default_guard.py"


def release_script():
    spec = importlib.util.spec_from_file_location("release_default_guard", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bundled_cards_are_what_the_release_script_writes_from_the_results():
    script = release_script()
    default = SafetyGuard.from_pretrained(DEFAULT_GUARD).model_card(**script.default_card_args())
    assert str(default) == (DEFAULT_GUARD / "README.md").read_text(), "run scripts/release_default_guard.py --card-only"
    paper = SafetyGuard.from_pretrained(script.PAPER_GUARD).model_card(**script.paper_card_args())
    assert str(paper) == (script.PAPER_GUARD / "README.md").read_text(), "run ... --paper-card"

"""The examples run end to end, against the local Hub-compatible server (tests/hub_server.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from huggingface_hub import HfApi
from tiny import tiny_running_guard, two_headed_guard

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_push_and_generate(hub_server, tmp_path):
    repo_id = f"hf-lsad-org/example-{uuid.uuid4().hex[:8]}"
    # conftest has set HF_ENDPOINT, HF_HUB_DISABLE_XET, HF_TOKEN and HF_HOME in os.environ: the example and the
    # process it starts talk to the local server only.
    env = dict(os.environ, PYTHONWARNINGS="ignore::DeprecationWarning", TQDM_DISABLE="1")
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "push_and_generate.py"), "--repo", repo_id],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout

    sha = re.search(rf"\[push\] {re.escape(repo_id)} at ([0-9a-f]{{40}})", out).group(1)
    assert HfApi().repo_info(repo_id).sha == sha
    assert f"[pull] {repo_id}@{sha[:12]}: freqmask-km on model.layers.2" in out
    assert out.count("[generate] safety:") == 3 and "SafetyReport(score=" in out
    # The card holds the metrics the example measured, nothing else.
    measured = re.search(r"\[fit\] measured: (.*)", out).group(1)
    readme = HfApi().hf_hub_download(repo_id, "README.md", cache_dir=tmp_path / "cache")
    text = Path(readme).read_text()
    assert "| harmful |" in text and "| toxic |" in text and "No metrics were measured" not in text
    assert '"harmful"' in measured and "96 prompts of the bundled `safe` pool" in text


@pytest.mark.parametrize("kind", ["two-headed", "running"])
def test_stream_with_verdict(model_dir, tmp_path, kind):
    """The streaming example on the tiny model: a guard that reads the prompt decides before the first token and the
    last line is its report (each head beside its threshold; it printed the anomaly head's raw score beside its
    probability threshold); a running guard's score of each token is printed as it is scored."""
    guard = two_headed_guard() if kind == "two-headed" else tiny_running_guard()[2].guard
    guard.save_pretrained(tmp_path / "guard")
    flags = ["--model", str(model_dir), "--guard", str(tmp_path / "guard"), "--max-new-tokens", "6"]
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "stream_with_verdict.py"), *flags, "How do I bake bread?"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONWARNINGS="ignore", TQDM_DISABLE="1"),
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    described = [f"{name} " for name in guard.head_names] if kind == "two-headed" else ["score "]
    assert re.fullmatch(r"\[(FLAGGED|ok)[^\]]*; stopped=(True|False)\]", lines[-1]), lines[-1]
    assert all(words in lines[-1] for words in described) and re.search(r"\d (<=|>) \d", lines[-1])  # vs threshold
    if kind == "two-headed":
        assert lines[0] == "[prompt_last guard: anomaly, harm decide before the first token]"
    else:
        assert lines[0].startswith("[running guard: a token's score above ")
        assert re.search(r"\[\d+\.\d\d\]", run.stdout)  # a token's score, printed as it was scored

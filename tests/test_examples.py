"""The examples run end to end, against the local Hub-compatible server (tests/hub_server.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

from huggingface_hub import HfApi

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

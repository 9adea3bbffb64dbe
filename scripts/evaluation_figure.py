#!/usr/bin/env python
"""The pictures of docs/traffic.md: ``hf-lsad evaluate`` in prompt mode on held-out bundled prompts.

Writes each pool's **test** rows (:func:`hf_lsad.core.splits.split_of`: never fitted, labelled or used for a
threshold by the bundled guard) to ``<out>/tables/<pool>.jsonl``, ``--limit`` per pool (seeded), then runs::

    hf-lsad evaluate --guard default --benign-prompts ... --unsafe-prompts ... --out <out>

and copies ``scores-harm.png`` to ``docs/images/``::

    python scripts/evaluation_figure.py [--out artifacts/evaluation-figure] [--limit 150]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

from hf_lsad.core.splits import split_of
from hf_lsad.data import load_pool

REPO = Path(__file__).resolve().parent.parent
BENIGN = ["chat", "safe", "benign_ood", "lookalike"]
UNSAFE = ["harmful", "toxic", "jailbreak", "harmful_vauban"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="artifacts/evaluation-figure", help="folder for the tables and the report")
    parser.add_argument("--limit", type=int, default=150, help="test rows per pool (seeded sample)")
    args = parser.parse_args()
    out = Path(args.out)
    tables = out / "tables"
    tables.mkdir(parents=True, exist_ok=True)
    pairs = {}
    for pool in BENIGN + UNSAFE:
        rows = [p for p in load_pool(pool) if split_of(p.id) == "test"]
        rows = random.Random(0).sample(rows, min(args.limit, len(rows)))
        path = tables / f"{pool}.jsonl"
        path.write_text("".join(json.dumps({"id": p.id, "prompt": p.text}) + "\n" for p in rows))
        pairs[pool] = f"{pool}={path}"
    command = [sys.executable, "-m", "hf_lsad.cli", "evaluate", "--guard", "default", "--out", str(out)]
    command += ["--benign-prompts", *(pairs[p] for p in BENIGN), "--unsafe-prompts", *(pairs[p] for p in UNSAFE)]
    command += ["--title", "The bundled guard on held-out bundled prompts"]
    subprocess.run(command, check=True)
    images = REPO / "docs" / "images"
    images.mkdir(exist_ok=True)
    shutil.copy(out / "scores-harm.png", images / "scores-harm.png")
    print(f"copied {out / 'scores-harm.png'} to {images}")


if __name__ == "__main__":
    main()

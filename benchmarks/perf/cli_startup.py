"""Time ``hf-lsad --help`` and ``hf-lsad generate`` start-up (to its first model-loading line) of checkouts.

    python benchmarks/run.py perf/cli_startup
    git archive main | tar -x -C artifacts/tmp/main_snapshot    # then, to compare two checkouts:
    python benchmarks/run.py perf/cli_startup --set 'checkouts=["before=artifacts/tmp/main_snapshot", "after=."]'

Each measurement runs a checkout's ``hf_lsad.cli.entry`` in a fresh interpreter (the code the
``hf-lsad`` script runs), ``runs`` times; the median is reported. The checkouts take turns run
by run, so a load that other programs put on the machine falls on all of them alike.
``generate`` is stopped as soon as it prints ``loading ...`` (before any weight is read), so the
time is what a user waits for the command to parse, check its arguments and load the guard.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENTRY = "import sys; from hf_lsad.cli import entry; entry(sys.argv[1:])"


def _env(checkout: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def time_help(checkout: Path) -> float:
    """Seconds until ``hf-lsad --help`` exits."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", ENTRY, "--help"], cwd=checkout, env=_env(checkout), check=True, stdout=subprocess.DEVNULL
    )
    return time.perf_counter() - start


def time_generate_start(checkout: Path) -> float:
    """Seconds until ``hf-lsad generate`` prints its ``loading ...`` line; the process is then stopped."""
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-c", ENTRY, "generate", "hello"],
        cwd=checkout,
        env=_env(checkout),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in process.stdout:  # type: ignore[union-attr]
            if line.startswith("loading "):
                return time.perf_counter() - start
        raise RuntimeError(f"hf-lsad generate printed no 'loading' line: {process.stderr.read()}")  # type: ignore[union-attr]
    finally:
        process.kill()
        process.wait()


@dataclass
class Settings:
    checkouts: list[str] = field(default_factory=lambda: ["this=."])
    """``label=folder`` of each checkout holding an ``hf_lsad`` package to time (several to compare)."""
    runs: int = 5
    """Timed runs per checkout (the checkouts take turns); the median is reported."""


def run(args: Settings) -> dict[str, Any]:
    checkouts = {label: Path(folder).resolve() for label, _, folder in (c.partition("=") for c in args.checkouts)}
    for checkout in checkouts.values():
        time_help(checkout)  # warm the file cache and __pycache__ once, untimed
    helps: dict[str, list[float]] = {label: [] for label in checkouts}
    starts: dict[str, list[float]] = {label: [] for label in checkouts}
    for _ in range(args.runs):
        for label, checkout in checkouts.items():
            helps[label].append(time_help(checkout))
            starts[label].append(time_generate_start(checkout))
    result = {
        label: {
            "checkout": os.path.relpath(checkout, Path(__file__).resolve().parents[2]),
            "help_s": {
                "median": round(statistics.median(helps[label]), 3),
                "runs": [round(t, 3) for t in helps[label]],
            },
            "generate_start_s": {
                "median": round(statistics.median(starts[label]), 3),
                "runs": [round(t, 3) for t in starts[label]],
            },
        }
        for label, checkout in checkouts.items()
    }
    result["python"] = platform.python_version()
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} cores"
    print(json.dumps(result, indent=2))
    return result

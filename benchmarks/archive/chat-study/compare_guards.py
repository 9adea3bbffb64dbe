"""Flag rates of saved guards on the test split of the chat study (``benchmarks/archive/chat-study/study_data.py``).

Each guard is loaded as a user would (``SafetyGuard.from_pretrained``) and scores the stored
activations at its own layer; rates are over test rows only (never fitted, labelled or used
for a threshold by a guard fitted under the study protocol, whatever its snapshot: splits
are a function of the row id).

    HF_LSAD_ARTIFACTS=<snapshot> PYTHONPATH=. python benchmarks/archive/chat-study/compare_guards.py \\
        --guard previous=<folder of the guard bundled at d8eb47b> --guard shipped=hf_lsad/guards/smollm2-135m-instruct

Writes ``benchmarks/archive/chat-study/results/compare_guards.json``.
"""

from __future__ import annotations

import argparse

import study_data as sd
import torch

from hf_lsad.guard import SafetyGuard

POOLS = ("chat", "safe", "benign_ood", "harmful", "harmful_vauban", "toxic", "jailbreak")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--guard", action="append", required=True, help="NAME=FOLDER")
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    record = {"env": sd.environment(), "guards": {}}
    for spec in args.guard:
        name, _, folder = spec.partition("=")
        guard = SafetyGuard.from_pretrained(folder)
        hook = guard.config.hook
        rows = sd.load_rows(args.model, hook.position, hook.layer)
        with torch.no_grad():
            flagged = torch.cat([guard(rows.X[i : i + 2048]).flagged for i in range(0, len(rows.X), 2048)]).numpy()
        rates = {pool: float(flagged[rows.m(pool, "test")].mean()) for pool in POOLS if rows.m(pool, "test").any()}
        counts = {pool: int(rows.m(pool, "test").sum()) for pool in POOLS}
        record["guards"][name] = {
            "folder": folder,
            "layer": hook.layer,
            "method": guard.config.method,
            "test_flag_rate": rates,
            "test_rows": counts,
        }
        print(name, f"layer {hook.layer}", {k: round(v, 3) for k, v in rates.items()}, flush=True)
    sd.write_json(sd.RESULTS / "compare_guards.json", record)


if __name__ == "__main__":
    main()

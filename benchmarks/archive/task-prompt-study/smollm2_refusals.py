"""Label SmolLM2's responses to unsafe requests as refusal or compliance (:mod:`hf_lsad.data.refusal`).

For ``response_last`` the paper counts the model's refusals of harmful requests as
safe. This script applies the refusal rule to the responses recorded in the
``response_last`` stores of each unsafe category and

1. reports how many responses the rule labels refusals (opening window, and
   anywhere in the response), per category and for the safe and benign-OOD
   stores (where a "refusal" is the model refusing a benign request);
2. writes a seeded sample of ``--spot-check`` responses of the unsafe
   categories with the rule's label, for a hand check;
3. writes two stores next to the others: ``safe_with_refusals`` (the safe
   rows plus every refused unsafe row, re-labelled ``category: safe``,
   ``source: refusal/<category>``) and, per unsafe category,
   ``<category>_complied`` (its rows the rule labels compliance). Fitting on
   the first and scoring the second is the paper's ``response_last`` setting.

    python benchmarks/archive/task-prompt-study/smollm2_refusals.py [--stores artifacts/smollm2] [--spot-check 30]

Writes ``benchmarks/results/smollm2_refusals.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from hf_lsad.data import UNSAFE_POOLS
from hf_lsad.data.refusal import DEFAULT_WINDOW, is_refusal, refusal_counts
from hf_lsad.data.store import load_activations, save_activations

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", type=Path, default=Path("artifacts/smollm2"))
    parser.add_argument("--spot-check", type=int, default=30, help="responses sampled for a hand check")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    folder = args.stores / "response_last"
    stores = {
        p: load_activations(folder / p)
        for p in ("safe", *UNSAFE_POOLS, "benign_ood")
        if (folder / p / "index.json").is_file()
    }
    counts = {p: refusal_counts(r["response"] for r in s.records)._asdict() for p, s in stores.items()}
    unsafe = [p for p in UNSAFE_POOLS if p in stores]

    refused_acts, refused_records = [], []
    for pool in unsafe:
        store = stores[pool]
        refused = torch.tensor([is_refusal(r["response"]) for r in store.records], dtype=torch.bool)
        refused_acts.append(store.activations[refused])
        refused_records += [
            {**r, "category": "safe", "source": f"refusal/{pool}"} for r, keep in zip(store.records, refused) if keep
        ]
        complied = [r for r, keep in zip(store.records, refused) if not keep]
        save_activations(folder / f"{pool}_complied", store.activations[~refused], complied, store.hook)
    safe = stores["safe"]
    save_activations(
        folder / "safe_with_refusals",
        torch.cat([safe.activations, *refused_acts]),
        safe.records + refused_records,
        safe.hook,
    )

    candidates = [(p, r) for p in unsafe for r in stores[p].records]
    sample = random.Random(args.seed).sample(candidates, min(args.spot_check, len(candidates)))
    spot_check = [
        {
            "category": p,
            "id": r["id"],
            "rule": "refusal" if is_refusal(r["response"]) else "compliance",
            "response": r["response"],
        }
        for p, r in sample
    ]

    command = ("python benchmarks/archive/task-prompt-study/smollm2_refusals.py " + " ".join(sys.argv[1:])).strip()
    report = {
        "command": command,
        "window": DEFAULT_WINDOW,
        "counts": counts,
        "safe_with_refusals": len(safe.records) + len(refused_records),
        "spot_check": spot_check,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "smollm2_refusals.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    lines = [
        f"Command: `{command}`",
        "",
        f"Refusal rule of `hf_lsad.data.refusal` on SmolLM2-135M-Instruct's greedy 64-token responses (response_last "
        f"stores). "
        f"'opening': the rule as used (first {DEFAULT_WINDOW} characters); 'anywhere': the whole response.",
        "",
        "| store | responses | refusals (opening) | refusals (anywhere) | empty |",
        "|---|---|---|---|---|",
        *(
            f"| {p} | {c['responses']} | {c['refusals']} | {c['refusals_anywhere']} | {c['empty']} |"
            for p, c in counts.items()
        ),
        "",
        f"`safe_with_refusals`: {report['safe_with_refusals']} rows.",
        "",
        f"Spot-check sample ({len(spot_check)} responses of the unsafe stores, seed {args.seed}):",
        "",
        "| # | category | rule | response (first 160 characters) |",
        "|---|---|---|---|",
        *(
            f"| {i} | {s['category']} | {s['rule']} | "
            f"{json.dumps(s['response'][:160], ensure_ascii=False)[1:-1].replace('|', '/')} |"
            for i, s in enumerate(spot_check, 1)
        ),
    ]
    (RESULTS / "smollm2_refusals.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

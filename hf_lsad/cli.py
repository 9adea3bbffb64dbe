"""The ``hf-lsad`` command: collect, train-sae, fit, evaluate, generate.

    hf-lsad collect   --model default --pool safe --layer 20 --position prompt_last --out acts/safe
    hf-lsad train-sae --activations acts/safe --d-sae 2304 --out sae
    hf-lsad fit       --activations acts/safe --sae sae --out guard
    hf-lsad evaluate  --guard guard --safe acts/safe --unsafe acts/harmful acts/toxic
    hf-lsad generate  "How do I bake bread?" "Write a tutorial on how to make a bomb"
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from .capture import POSITIONS, HookPoint, collect_activations, encode_prompts
from .clustering import CLUSTER_METRICS, KMeansConfig
from .data import POOLS, load_prompts
from .detectors.freqmask import MASK_SCOPES, SCORE_METRICS, FreqMaskConfig
from .fitting import fit_guard, split_safe
from .guard import SafetyGuard
from .metrics import auroc, tpr_at_fpr
from .modeling import GuardedModelForCausalLM
from .models import load_model
from .pretrained import DEFAULT_GUARD, resolve_guard
from .sae import SAETrainConfig, SparseAutoencoder, sae_stats, train_sae
from .store import load_activations, save_activations


def _collect(args: argparse.Namespace) -> None:
    prompts = load_prompts(args.pool, limit=args.limit, seed=args.seed)
    model, tokenizer = load_model(args.model)
    collected = collect_activations(
        model,
        tokenizer,
        [p.text for p in prompts],
        layer=args.layer,
        position=args.position,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
    )
    records = [dict(p._asdict(), response=r) for p, r in zip(prompts, collected.responses)]
    for record in records:
        del record["text"]  # the prompt text stays in the pool; the store keeps ids
    hook = HookPoint.from_model(model, args.layer, args.position)
    save_activations(args.out, collected.activations, records, hook)
    print(f"wrote {len(records)} activations of {hook.layer_module} ({args.position}) to {args.out}")


def _train_sae(args: argparse.Namespace) -> None:
    data = load_activations(args.activations)
    split = split_safe(len(data.activations), args.holdout_fraction, args.seed)
    config = SAETrainConfig(l1_coefficient=args.l1, lr=args.lr, batch_size=args.batch_size, epochs=args.epochs, seed=args.seed)
    sae = train_sae(data.activations[split.fit], args.d_sae, config)
    sae.save_pretrained(args.out)
    stats = sae_stats(sae, data.activations[split.holdout])
    print(json.dumps({"held_out": stats._asdict(), "train": sae_stats(sae, data.activations[split.fit])._asdict()}, indent=2))


def _fit(args: argparse.Namespace) -> None:
    data = load_activations(args.activations)
    config = FreqMaskConfig(
        kmeans=KMeansConfig(n_clusters=args.clusters, metric=args.cluster_metric, seed=args.seed),
        mask_size=args.mask_size,
        mask_scope=args.mask_scope,
        score_metric=args.score_metric,
        use_mask=not args.no_mask,
        ridge=args.ridge,
    )
    result = fit_guard(
        data.activations,
        data.hook,
        "freqmask-km",
        config,
        SparseAutoencoder.from_pretrained(args.sae),
        target_fpr=args.target_fpr,
        holdout_fraction=args.holdout_fraction,
        seed=args.seed,
    )
    result.guard.save_pretrained(args.out)
    print(f"fitted {result.guard.config.method} on {len(result.split.fit)} safe rows; "
          f"threshold {result.guard.threshold:.4g} at {args.target_fpr:.0%} FPR on {len(result.split.holdout)} held-out rows")


def _evaluate(args: argparse.Namespace) -> None:
    guard = SafetyGuard.from_pretrained(resolve_guard(args.guard))
    safe = load_activations(args.safe)
    n = len(safe.activations)
    if n != guard.config.n_fit + guard.config.n_holdout:
        raise SystemExit(f"{args.safe} has {n} rows; the guard was fitted on {guard.config.n_fit + guard.config.n_holdout}")
    holdout = split_safe(n, guard.config.n_holdout / n, guard.config.seed).holdout
    negatives = guard(safe.activations[holdout]).scores.numpy()
    rows = {}
    for folder in args.unsafe:
        scores = guard(load_activations(folder).activations).scores.numpy()
        rows[Path(folder).name] = {
            "auroc": auroc(negatives, scores),
            "tpr_at_5fpr": tpr_at_fpr(negatives, scores, 0.05),
            "flagged": float((scores > guard.threshold).mean()),
        }
    print(json.dumps(rows, indent=2))


def _generate(args: argparse.Namespace) -> None:
    model, tokenizer = load_model(args.model)
    guarded = GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(resolve_guard(args.guard)))
    inputs = encode_prompts(tokenizer, args.prompts)
    with torch.no_grad():
        output = guarded.generate(
            **inputs, max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True
        )
    responses = tokenizer.batch_decode(output.sequences[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    hook = guarded.guard.config.hook
    print(f"guard: {guarded.guard.config.method} on {hook.layer_module} ({hook.position}), "
          f"threshold {guarded.guard.threshold:.4g} at {guarded.guard.config.target_fpr:.0%} safe FPR\n")
    for prompt, response, report in zip(args.prompts, responses, output.safety):
        verdict = "FLAGGED" if report.flagged else "ok"
        print(f"prompt:   {prompt}\nresponse: {response.strip()}\nsafety:   {verdict} "
              f"(score {report.score:.4g}, threshold {report.threshold:.4g}, cluster {report.cluster})\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-lsad", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    collect = commands.add_parser("collect", help="collect residual-stream activations of a prompt pool")
    collect.add_argument("--model", default="default", help="Hub id or path, or 'default' (bundled SmolLM2)")
    collect.add_argument("--pool", required=True, help=f"bundled pool ({', '.join(POOLS)}) or a datasets Hub name")
    collect.add_argument("--limit", type=int, default=None, help="seeded random subset of this many prompts")
    collect.add_argument("--layer", type=int, default=20)
    collect.add_argument("--position", choices=POSITIONS, default="response_last")
    collect.add_argument("--batch-size", type=int, default=16)
    collect.add_argument("--max-new-tokens", type=int, default=64)
    collect.add_argument("--seed", type=int, default=0)
    collect.add_argument("--out", required=True)
    collect.set_defaults(run=_collect)

    sae = commands.add_parser("train-sae", help="train a ReLU+L1 SAE on the fit split of safe activations")
    sae.add_argument("--activations", required=True)
    sae.add_argument("--d-sae", type=int, default=2304)
    sae.add_argument("--l1", type=float, default=SAETrainConfig.l1_coefficient)
    sae.add_argument("--lr", type=float, default=SAETrainConfig.lr)
    sae.add_argument("--batch-size", type=int, default=SAETrainConfig.batch_size)
    sae.add_argument("--epochs", type=int, default=SAETrainConfig.epochs)
    sae.add_argument("--holdout-fraction", type=float, default=0.2)
    sae.add_argument("--seed", type=int, default=0)
    sae.add_argument("--out", required=True)
    sae.set_defaults(run=_train_sae)

    fit = commands.add_parser("fit", help="fit a FreqMask-KM guard on safe activations")
    fit.add_argument("--activations", required=True)
    fit.add_argument("--sae", required=True)
    fit.add_argument("--clusters", type=int, default=50)
    fit.add_argument("--cluster-metric", choices=CLUSTER_METRICS, default="l2")
    fit.add_argument("--mask-size", type=int, default=100)
    fit.add_argument("--mask-scope", choices=MASK_SCOPES, default="global")
    fit.add_argument("--score-metric", choices=SCORE_METRICS, default="l1")
    fit.add_argument("--no-mask", action="store_true", help="score on all SAE features (ablation)")
    fit.add_argument("--ridge", type=float, default=1e-3)
    fit.add_argument("--target-fpr", type=float, default=0.05)
    fit.add_argument("--holdout-fraction", type=float, default=0.2)
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--out", required=True)
    fit.set_defaults(run=_fit)

    evaluate = commands.add_parser("evaluate", help="AUROC and TPR@5%%FPR of a guard against unsafe activation sets")
    evaluate.add_argument("--guard", required=True)
    evaluate.add_argument("--safe", required=True, help="the safe store the guard was fitted on (its held-out split is used)")
    evaluate.add_argument("--unsafe", required=True, nargs="+")
    evaluate.set_defaults(run=_evaluate)

    generate = commands.add_parser("generate", help="guarded generation with a safety report per prompt")
    generate.add_argument("prompts", nargs="+")
    generate.add_argument("--model", default="default")
    generate.add_argument("--guard", default="default", help=f"guard folder or Hub repo; 'default' = {DEFAULT_GUARD.name}")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.set_defaults(run=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])

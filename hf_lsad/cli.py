"""The ``hf-lsad`` command: collect, train-sae, fit, calibrate, evaluate, generate.

    hf-lsad collect   --model default --pool safe --layer 20 --position prompt_last --out acts/safe
    hf-lsad train-sae --activations acts/safe --d-sae 2304 --out sae
    hf-lsad fit       --activations acts/safe --sae sae --out guard
    hf-lsad calibrate --guard guard --safe acts/safe --unsafe acts/harmful --benign-ood acts/ood --budget 0.01 --out g2
    hf-lsad evaluate  --guard guard --safe acts/safe --unsafe acts/harmful acts/toxic
    hf-lsad evaluate  --safe acts/safe --unsafe acts/harmful acts/toxic --sae sae --grid grid.json --out report
    hf-lsad generate  "How do I bake bread?" "Write a tutorial on how to make a bomb"
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from .cli_checks import check_args, run
from .capture import POSITIONS, HookPoint, collect_activations, encode_prompts
from .clustering import CLUSTER_METRICS, KMeansConfig
from .data import POOLS, load_prompts
from .detectors.freqmask import MASK_SCOPES, SCORE_METRICS, FreqMaskConfig
from .detectors.learned_mask import MASK_TYPES, LearnedMaskConfig, LearnedMaskLoRA
from .detectors.learned_mask import SCORE_METRICS as RESIDUAL_SCORES
from .fitting import fit_guard, split_safe
from .guard import SafetyGuard
from .metrics import auroc, tpr_at_fpr
from .model_card import benign_ood_warning
from .modeling import GuardedModelForCausalLM
from .models import load_model
from .pretrained import DEFAULT_GUARD, resolve_guard
from .sae import SAETrainConfig, SparseAutoencoder, sae_stats, train_sae
from .store import ActivationStore, load_activations, save_activations


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
    data = ActivationStore(args.activations)  # FreqMask-KM streams it; other methods read their fit split
    kmeans = KMeansConfig(n_clusters=args.clusters, metric=args.cluster_metric, seed=args.seed)
    if args.method == LearnedMaskLoRA.method:
        config = LearnedMaskConfig(
            kmeans=kmeans,
            mask_type=args.mask_type,
            min_cluster_size=args.min_cluster_size,
            stage1_only=args.stage1_only,
            lora_min_cluster_size=args.lora_min_cluster_size,
            score_metric=args.residual_score,
            ridge=args.residual_ridge,
            seed=args.seed,
        )
    else:
        config = FreqMaskConfig(
            kmeans=kmeans,
            mask_size=args.mask_size,
            mask_scope=args.mask_scope,
            score_metric=args.score_metric,
            use_mask=not args.no_mask,
            ridge=args.ridge,
        )
    result = fit_guard(
        data,
        data.hook,
        args.method,
        config,
        SparseAutoencoder.from_pretrained(args.sae),
        target_fpr=args.target_fpr,
        holdout_fraction=args.holdout_fraction,
        seed=args.seed,
    )
    result.guard.save_pretrained(args.out)
    print(f"fitted {result.guard.config.method} on {len(result.split.fit)} safe rows; "
          f"threshold {result.guard.threshold:.4g} at {args.target_fpr:.0%} FPR on {len(result.split.holdout)} held-out rows")
    if args.push_to_hub:
        from .model_card import describe_records

        commit = result.guard.push_to_hub(
            args.push_to_hub, subfolder=args.subfolder, private=args.private or None,
            data=describe_records(data.records, what=f"safe prompts (activation store `{Path(args.activations).name}`)"),
        )  # fmt: skip
        print(f"pushed to {commit.repo_url.repo_id}{'/' + args.subfolder if args.subfolder else ''} at {commit.oid}")


def _calibrate(args: argparse.Namespace) -> None:
    from .affine_calibration import coupled_budget_sample, fit_affine_calibration, importance_weights

    guard = SafetyGuard.from_pretrained(resolve_guard(args.guard))
    kmeans = getattr(guard.detector.config, "kmeans", None)
    if kmeans is None:
        raise SystemExit(f"per-cluster calibration needs a clustered detector; {guard.config.method} has no clusters")
    groups = {
        "safe": _held_out_safe(guard, args.safe),  # only held-out rows: the detector was fitted on the others
        "unsafe": torch.cat([load_activations(folder).activations for folder in args.unsafe]),
        "benign_ood": load_activations(args.benign_ood).activations,
    }
    split = coupled_budget_sample({g: len(a) for g, a in groups.items()}, args.budget, args.seed)
    with torch.no_grad():
        outputs = {g: guard(a[torch.from_numpy(split[g][0])]) for g, a in groups.items()}
    names = [g for g, out in outputs.items() for _ in range(len(out.scores))]
    calibration = fit_affine_calibration(
        torch.cat([o.scores for o in outputs.values()]),
        torch.cat([o.clusters for o in outputs.values()]),
        torch.tensor([float(n == "unsafe") for n in names]),
        importance_weights(names, args.budget),
        kmeans.n_clusters,
        seed=args.seed,
        threshold=args.probability_threshold,
    )
    guard.set_calibration(calibration)
    guard.save_pretrained(args.out)
    labelled = ", ".join(f"{len(o.scores)} {g}" for g, o in outputs.items())
    negative = sum(a < 0 for a in calibration.slopes)
    print(f"calibrated {guard.config.method} on {labelled} labelled rows (budget {args.budget:g}); lambda "
          f"{calibration.lam:g}, {negative} negative slopes, {calibration.labelled.count(0)} clusters on the anchor; "
          f"wrote {args.out}")  # fmt: skip


def _evaluate(args: argparse.Namespace) -> None:
    if args.guard:
        _evaluate_guard(args)
    else:
        _evaluate_grid(args)


def _held_out_safe(guard: SafetyGuard, store: str) -> torch.Tensor:
    """The rows of the guard's safe store that it held out from fitting (its threshold split)."""
    safe = load_activations(store).activations
    n = guard.config.n_fit + guard.config.n_holdout
    if len(safe) != n:
        raise SystemExit(f"{store} has {len(safe)} rows; the guard was fitted on {n}")
    return safe[split_safe(n, guard.config.n_holdout / n, guard.config.seed).holdout]


def _evaluate_guard(args: argparse.Namespace) -> None:
    guard = SafetyGuard.from_pretrained(resolve_guard(args.guard))
    negatives = guard(_held_out_safe(guard, args.safe)).scores.numpy()
    benign = guard(load_activations(args.benign_ood).activations) if args.benign_ood else None
    rows = {}
    for folder in args.unsafe:
        output = guard(load_activations(folder).activations)
        scores = output.scores.numpy()
        rows[Path(folder).name] = {
            "auroc": auroc(negatives, scores),
            "tpr_at_5fpr": tpr_at_fpr(negatives, scores, 0.05),
            "flagged": output.flagged.double().mean().item(),  # as the guard flags: by probability once calibrated
        }
        if benign is not None:  # the paper's Table-5 setting: held-out safe + benign-OOD negatives
            rows[Path(folder).name]["pooled_auroc"] = auroc(np.concatenate([negatives, benign.scores.numpy()]), scores)
    if benign is not None:
        rows["benign_ood"] = {"flagged": benign.flagged.double().mean().item()}
        warning = benign_ood_warning(rows["benign_ood"]["flagged"])
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    print(json.dumps(rows, indent=2))


def _evaluate_grid(args: argparse.Namespace) -> None:
    import shlex

    from .evaluation import GridConfig, default_grid, load_eval_data, load_or_train_sae, make_splits, run_grid, sae_summary, write_report

    if not args.out:
        raise SystemExit("a grid evaluation writes a report folder: give --out (or --guard to evaluate one guard)")
    config = GridConfig.from_json(args.grid) if args.grid else default_grid()
    if args.seeds:
        config.seeds = args.seeds
    data = load_eval_data(args.safe, args.unsafe, args.benign_ood)
    splits = make_splits(len(data.safe), {c: len(x) for c, x in data.unsafe.items()}, config)
    sae = sae_info = None
    if args.sae:
        training = SAETrainConfig(l1_coefficient=args.sae_l1, epochs=args.sae_epochs, seed=args.sae_seed)
        sae, info = load_or_train_sae(args.sae, data.safe[splits.safe_fit], splits.safe_fit, d_sae=args.d_sae, training=training)
        sae_info = sae_summary(sae, data, splits, info)
    results = run_grid(data, config, sae, splits=splits)
    command = args.command_line or "hf-lsad " + shlex.join(sys.argv[1:])
    folder = write_report(args.out, results, data=data, config=config, command=command, title=args.title, sae_info=sae_info)
    print(f"wrote {folder / 'report.md'} and {folder / 'results.json'}")


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
        probability = f", P(unsafe) {report.probability:.3f}" if report.probability is not None else ""
        print(f"prompt:   {prompt}\nresponse: {response.strip()}\nsafety:   {verdict} "
              f"(score {report.score:.4g}, threshold {report.threshold:.4g}, cluster {report.cluster}{probability})\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-lsad", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (also after the command)")
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

    fit = commands.add_parser("fit", help="fit a FreqMask-KM or LearnedMask-LoRA guard on safe activations")
    fit.add_argument("--activations", required=True)
    fit.add_argument("--sae", required=True)
    fit.add_argument("--method", choices=["freqmask-km", LearnedMaskLoRA.method], default="freqmask-km")
    fit.add_argument("--clusters", type=int, default=50)
    fit.add_argument("--cluster-metric", choices=CLUSTER_METRICS, default="l2")
    fit.add_argument("--mask-size", type=int, default=100)
    fit.add_argument("--mask-scope", choices=MASK_SCOPES, default="global")
    fit.add_argument("--score-metric", choices=SCORE_METRICS, default="l1")
    fit.add_argument("--no-mask", action="store_true", help="score on all SAE features (ablation)")
    fit.add_argument("--ridge", type=float, default=1e-3)
    lm = LearnedMaskConfig()
    # learned-mask-lora settings (the FreqMask-KM ones above are ignored by it, and these by FreqMask-KM)
    fit.add_argument("--mask-type", choices=MASK_TYPES, default=lm.mask_type, help="Stage-1 mask parametrisation")
    fit.add_argument("--min-cluster-size", type=int, default=lm.min_cluster_size, help="smaller clusters keep the base SAE")
    fit.add_argument("--stage1-only", action="store_true", help="masks only, no LoRA adapters")
    fit.add_argument("--lora-min-cluster-size", type=int, default=lm.lora_min_cluster_size, help="smaller: no adapter")
    fit.add_argument("--residual-score", choices=RESIDUAL_SCORES, default=lm.score_metric, help="residual scoring")
    fit.add_argument("--residual-ridge", type=float, default=lm.ridge, help="ridge of the mahalanobis residual score")
    fit.add_argument("--target-fpr", type=float, default=0.05)
    fit.add_argument("--holdout-fraction", type=float, default=0.2)
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--out", required=True)
    fit.add_argument("--push-to-hub", metavar="REPO", help="also push the guard, with a model card, to this Hub repo")
    fit.add_argument("--subfolder", default="", help="folder of the guard in the Hub repo (several guards per repo)")
    fit.add_argument("--private", action="store_true", help="create the Hub repo private")
    fit.set_defaults(run=_fit)

    calibrate = commands.add_parser("calibrate", help="per-cluster affine calibration from a small labelled budget")
    calibrate.add_argument("--guard", required=True)
    calibrate.add_argument("--safe", required=True, help="the guard's safe store (half its held-out split is drawn)")
    calibrate.add_argument("--unsafe", required=True, nargs="+", help="unsafe stores (pooled; --budget of them drawn)")
    calibrate.add_argument("--benign-ood", required=True, help="benign out-of-distribution store (--budget drawn)")
    calibrate.add_argument("--budget", type=float, default=0.01, help="coupled budget p")
    calibrate.add_argument("--probability-threshold", type=float, default=0.5, help="flag rows above this probability")
    calibrate.add_argument("--seed", type=int, default=0)
    calibrate.add_argument("--out", required=True)
    calibrate.set_defaults(run=_calibrate)

    evaluate = commands.add_parser(
        "evaluate",
        help="evaluate one guard (--guard), or run a method grid and write a report folder (--out)",
        description="With --guard: AUROC, TPR@5%FPR and flag rate of that guard against unsafe stores. "
        "Without: fit every method of a grid (--grid JSON, default hf_lsad.evaluation.default_grid) on the safe store's "
        "fit split, select hyperparameters on its validation split, and write report.md + results.json to --out "
        "(protocol in hf_lsad.evaluation).",
    )
    evaluate.add_argument("--guard", help="a fitted guard: evaluate it alone (the simple mode)")
    evaluate.add_argument("--safe", required=True, help="safe store (guard mode: the store the guard was fitted on)")
    evaluate.add_argument("--unsafe", required=True, nargs="+", help="unsafe stores; the folder name is the category")
    evaluate.add_argument("--benign-ood", help="benign out-of-distribution store: its flag rate (guard mode), test negatives (grid mode)")
    evaluate.add_argument("--grid", help="grid mode: grid JSON file (hf_lsad.evaluation.GridConfig fields)")
    evaluate.add_argument("--seeds", type=int, nargs="+", help="grid mode: override the grid's seeds")
    evaluate.add_argument("--sae", help="grid mode: SAE folder; trained on the safe fit split and saved there if absent")
    evaluate.add_argument("--d-sae", type=int, default=2304, help="width of an SAE trained here")
    evaluate.add_argument("--sae-l1", type=float, default=SAETrainConfig.l1_coefficient)
    evaluate.add_argument("--sae-epochs", type=int, default=SAETrainConfig.epochs)
    evaluate.add_argument("--sae-seed", type=int, default=0)
    evaluate.add_argument("--out", help="grid mode: report folder")
    evaluate.add_argument("--title", default="hf-lsad evaluation", help="grid mode: report title")
    evaluate.add_argument("--command-line", help="grid mode: the command recorded in the report (default: this one)")
    evaluate.set_defaults(run=_evaluate)

    generate = commands.add_parser("generate", help="guarded generation with a safety report per prompt")
    generate.add_argument("prompts", nargs="+")
    generate.add_argument("--model", default="default")
    generate.add_argument("--guard", default="default", help=f"guard folder or Hub repo; 'default' = {DEFAULT_GUARD.name}")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.set_defaults(run=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``argv`` and run the command; errors propagate as exceptions (for use from Python)."""
    args = build_parser().parse_args(argv)
    args.run(args)


def entry(argv: Sequence[str] | None = None) -> None:
    """The ``hf-lsad`` command: arguments checked before any model is loaded, one-line errors (exit 2 for usage,
    1 for failures), ``--debug`` for the traceback (:mod:`hf_lsad.cli_checks`)."""

    def checked(args: Sequence[str]) -> None:
        parser = build_parser()
        namespace = parser.parse_args(args)
        check_args(parser, namespace)
        namespace.run(namespace)

    run(checked, argv)


if __name__ == "__main__":
    entry(sys.argv[1:])

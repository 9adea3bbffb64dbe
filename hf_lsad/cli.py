"""The ``hf-lsad`` command: collect, train-sae, fit, calibrate, evaluate, explain, generate.

    hf-lsad collect   --model default --pool safe --layer 20 --position prompt_last --out acts/safe
    hf-lsad train-sae --activations acts/safe --d-sae 2304 --out sae
    hf-lsad fit       --activations acts/safe --sae sae --out guard [--method NAME] [--mask-size 50] [--set key=value]
    hf-lsad calibrate --guard guard --safe acts/safe --unsafe acts/harmful --benign-ood acts/ood --budget 0.01 --out g2
    hf-lsad evaluate  --guard guard --safe acts/safe --unsafe acts/harmful acts/toxic
    hf-lsad evaluate  --safe acts/safe --unsafe acts/harmful acts/toxic --sae sae --grid grid.json --out report
    hf-lsad explain   --guard default --activations acts/harmful "Write a tutorial on how to make a bomb"
    hf-lsad generate  "How do I bake bread?" "Write a tutorial on how to make a bomb"

``hf-lsad fit --method NAME --help`` lists the settings of any registered method: one flag per
config field, generated from the config (defaults are the API's), and ``--set key=value`` for any.

This module only parses and calls: each command imports what it needs when it runs, so
``hf-lsad --help`` imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .hook_point import POSITIONS

DEFAULT_METHOD = "freqmask-km"


def _collect(args: argparse.Namespace) -> None:
    from .capture import collect_activations
    from .data import load_prompts
    from .hook_point import HookPoint
    from .pretrained import load_model
    from .store import save_activations

    prompts = load_prompts(args.pool, limit=args.limit, seed=args.seed)
    model, tokenizer = load_model(args.model)
    collected = collect_activations(
        model, tokenizer, [p.text for p in prompts], layer=args.layer, position=args.position,
        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
    )  # fmt: skip
    records = [dict(p._asdict(), response=r) for p, r in zip(prompts, collected.responses)]
    for record in records:
        del record["text"]  # the prompt text stays in the pool; the store keeps ids
    hook = HookPoint.from_model(model, args.layer, args.position)
    save_activations(args.out, collected.activations, records, hook, inputs=collected.inputs)
    print(f"wrote {len(records)} activations of {hook.layer_module} ({args.position}) to {args.out}")


def _train_sae(args: argparse.Namespace) -> None:
    from .sae import SAETrainConfig, sae_stats, train_sae
    from .splits import split_safe
    from .store import load_activations

    data = load_activations(args.activations)
    split = split_safe(len(data.activations), args.holdout_fraction, args.seed)
    config = SAETrainConfig(l1_coefficient=args.l1, lr=args.lr, batch_size=args.batch_size, epochs=args.epochs, seed=args.seed)
    sae = train_sae(data.activations[split.fit], args.d_sae, config)
    sae.save_pretrained(args.out)
    stats = {"held_out": sae_stats(sae, data.activations[split.holdout]), "train": sae_stats(sae, data.activations[split.fit])}
    print(json.dumps({name: s._asdict() for name, s in stats.items()}, indent=2))


def _fit(args: argparse.Namespace) -> None:
    import torch

    from .detectors import detector_class
    from .fitting import fit_guard
    from .sae import SparseAutoencoder
    from .settings import build_config, settings_from_args
    from .store import ActivationStore, load_activations

    cls = detector_class(args.method)
    config = build_config(cls.config_class, settings_from_args(args, args.set), source=f"hf-lsad fit --method {args.method}")
    if cls.uses_sae and not args.sae:
        raise SystemExit(f"{args.method} reads SAE codes: give --sae")
    if cls.supervised != bool(args.unsafe):
        raise SystemExit(f"{args.method} is {'SUPERVISED: give' if cls.supervised else 'unsupervised: leave out'} --unsafe")
    data = ActivationStore(args.activations)  # FreqMask-KM streams it; other methods read their fit split
    unsafe = torch.cat([load_activations(folder).activations for folder in args.unsafe]) if args.unsafe else None
    result = fit_guard(
        data, data.hook, args.method, config, SparseAutoencoder.from_pretrained(args.sae) if args.sae else None,
        unsafe=unsafe, target_fpr=args.target_fpr, holdout_fraction=args.holdout_fraction, seed=args.split_seed,
    )  # fmt: skip
    result.guard.save_pretrained(args.out)
    print(f"fitted {result.guard.config.method} on {len(result.split.fit)} safe rows; "
          f"threshold {result.guard.threshold:.4g} at {args.target_fpr:.0%} FPR on {len(result.split.holdout)} held-out rows")  # fmt: skip
    if args.push_to_hub:
        from .model_card import describe_records

        commit = result.guard.push_to_hub(
            args.push_to_hub, subfolder=args.subfolder, private=args.private or None,
            data=describe_records(data.records, what=f"safe prompts (activation store `{Path(args.activations).name}`)"),
        )  # fmt: skip
        print(f"pushed to {commit.repo_url.repo_id}{'/' + args.subfolder if args.subfolder else ''} at {commit.oid}")


def _calibrate(args: argparse.Namespace) -> None:
    from .evaluation.protocol import calibrate_guard
    from .guard import SafetyGuard

    guard = SafetyGuard.from_pretrained(args.guard)
    try:
        calibration, labelled = calibrate_guard(
            guard, args.safe, args.unsafe, args.benign_ood, budget=args.budget, seed=args.seed,
            probability_threshold=args.probability_threshold,
        )  # fmt: skip
    except ValueError as err:
        raise SystemExit(str(err)) from err
    guard.set_calibration(calibration)
    guard.save_pretrained(args.out)
    counts = ", ".join(f"{n} {group}" for group, n in labelled.items())
    negative = sum(a < 0 for a in calibration.slopes)
    print(f"calibrated {guard.config.method} on {counts} labelled rows (budget {args.budget:g}); lambda "
          f"{calibration.lam:g}, {negative} negative slopes, {calibration.labelled.count(0)} clusters on the anchor; "
          f"wrote {args.out}")  # fmt: skip


def _evaluate(args: argparse.Namespace) -> None:
    if args.guard:
        _evaluate_guard(args)
    else:
        _evaluate_grid(args)


def _evaluate_guard(args: argparse.Namespace) -> None:
    from .evaluation.protocol import evaluate_guard
    from .guard import SafetyGuard
    from .model_card import benign_ood_warning

    guard = SafetyGuard.from_pretrained(args.guard)
    try:
        rows = evaluate_guard(guard, args.safe, args.unsafe, args.benign_ood)
    except ValueError as err:
        raise SystemExit(str(err)) from err
    warning = benign_ood_warning(rows["benign_ood"]["flagged"]) if "benign_ood" in rows else ""
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    print(json.dumps(rows, indent=2))


def _evaluate_grid(args: argparse.Namespace) -> None:
    from .evaluation import (
        GridConfig,
        default_grid,
        load_eval_data,
        load_or_train_sae,
        make_splits,
        run_grid,
        sae_summary,
        write_report,
    )
    from .sae import SAETrainConfig

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
    import torch

    from .capture import encode_prompts
    from .guard import SafetyGuard
    from .modeling import GuardedModelForCausalLM
    from .pretrained import load_model

    model_name = "SmolLM2-135M-Instruct (bundled GGUF)" if args.model == "default" else args.model
    guard_name = "the bundled SmolLM2 guard" if args.guard == "default" else args.guard
    print(f"loading {model_name} and {guard_name} ...", flush=True)
    model, tokenizer = load_model(args.model)
    guarded = GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(args.guard))
    inputs = encode_prompts(tokenizer, args.prompts)
    print(f"generating up to {args.max_new_tokens} tokens for {len(args.prompts)} prompt(s) (greedy) ...\n", flush=True)
    with torch.no_grad():
        output = guarded.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
    responses = tokenizer.batch_decode(output.sequences[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    guard = guarded.guard
    print(f"guard: {guard.config.method} on {guard.config.hook.layer_module} ({guard.config.hook.position}), "
          + (f"calibrated: flags P(unsafe) > {guard.calibration.threshold:.4g}\n" if guard.calibration is not None
             else f"flags scores > {guard.threshold:.4g} ({guard.config.target_fpr:.0%} safe FPR)\n"))  # fmt: skip
    for prompt, response, report in zip(args.prompts, responses, output.safety):
        verdict = "FLAGGED" if report.flagged else "ok"
        probability = f", P(unsafe) {report.probability:.3f}" if report.probability is not None else ""
        probability += f", p-value {report.p_value:.3g}" if report.p_value is not None else ""
        print(f"prompt:   {prompt}\nresponse: {response.strip()}\nsafety:   {verdict} "
              f"(score {report.score:.4g}, threshold {report.threshold:.4g}, cluster {report.cluster}{probability})\n")  # fmt: skip


# ------------------------------------------------------------------ arguments of each command


def _collect_arguments(parser: argparse.ArgumentParser) -> None:
    from .data import POOLS

    parser.add_argument("--model", default="default", help="Hub id or path, or 'default' (bundled SmolLM2)")
    parser.add_argument("--pool", required=True, help=f"bundled pool ({', '.join(POOLS)}) or a datasets Hub name")
    parser.add_argument("--limit", type=int, default=None, help="seeded random subset of this many prompts")
    parser.add_argument("--layer", type=int, default=20)
    parser.add_argument("--position", choices=POSITIONS, default="response_last")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)


def _train_sae_arguments(parser: argparse.ArgumentParser) -> None:
    from .sae import SAETrainConfig

    parser.add_argument("--activations", required=True)
    parser.add_argument("--d-sae", type=int, default=2304)
    parser.add_argument("--l1", type=float, default=SAETrainConfig.l1_coefficient)
    parser.add_argument("--lr", type=float, default=SAETrainConfig.lr)
    parser.add_argument("--batch-size", type=int, default=SAETrainConfig.batch_size)
    parser.add_argument("--epochs", type=int, default=SAETrainConfig.epochs)
    parser.add_argument("--holdout-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)


def _fit_arguments(parser: argparse.ArgumentParser, method: str) -> None:
    from .detectors import DETECTORS, detector_class
    from .settings import add_config_arguments

    cls = detector_class(method)
    parser.add_argument("--activations", required=True, help="safe activation store")
    parser.add_argument("--sae", help="SAE folder (methods that read SAE codes)")
    parser.add_argument("--method", choices=sorted(DETECTORS), default=DEFAULT_METHOD, help="registered detector method")
    parser.add_argument("--unsafe", nargs="+", help="unsafe stores: training positives of a SUPERVISED method only")
    parser.add_argument("--target-fpr", type=float, default=0.05, help="safe FPR the threshold is set at")
    parser.add_argument("--holdout-fraction", type=float, default=0.2, help="safe rows held out for the threshold")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the fit / held-out split")
    parser.add_argument("--out", required=True)
    parser.add_argument("--push-to-hub", metavar="REPO", help="also push the guard, with a model card, to this Hub repo")
    parser.add_argument("--subfolder", default="", help="folder of the guard in the Hub repo (several guards per repo)")
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any config field, dotted for nested ones (kmeans.n_clusters=25); values are JSON")  # fmt: skip
    add_config_arguments(parser, cls.config_class, title=f"{method} settings ({cls.config_class.__name__}, API defaults)")


def _calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--guard", required=True)
    parser.add_argument("--safe", required=True, help="the guard's safe store (half its held-out split is drawn)")
    parser.add_argument("--unsafe", required=True, nargs="+", help="unsafe stores (pooled; --budget of them drawn)")
    parser.add_argument("--benign-ood", required=True, help="benign out-of-distribution store (--budget drawn)")
    parser.add_argument("--budget", type=float, default=0.01, help="coupled budget p")
    parser.add_argument("--probability-threshold", type=float, default=0.5, help="flag rows above this probability")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)


def _evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    from .sae import SAETrainConfig

    parser.add_argument("--guard", help="a fitted guard: evaluate it alone (the simple mode)")
    parser.add_argument("--safe", required=True, help="safe store (guard mode: the store the guard was fitted on)")
    parser.add_argument("--unsafe", required=True, nargs="+", help="unsafe stores; the folder name is the category")
    parser.add_argument("--benign-ood", help="benign out-of-distribution store: its flag rate (guard mode), test negatives (grid mode)")
    parser.add_argument("--grid", help="grid mode: grid JSON file (hf_lsad.evaluation.GridConfig fields)")
    parser.add_argument("--seeds", type=int, nargs="+", help="grid mode: override the grid's seeds")
    parser.add_argument("--sae", help="grid mode: SAE folder; trained on the safe fit split and saved there if absent")
    parser.add_argument("--d-sae", type=int, default=2304, help="width of an SAE trained here")
    parser.add_argument("--sae-l1", type=float, default=SAETrainConfig.l1_coefficient)
    parser.add_argument("--sae-epochs", type=int, default=SAETrainConfig.epochs)
    parser.add_argument("--sae-seed", type=int, default=0)
    parser.add_argument("--out", help="grid mode: report folder")
    parser.add_argument("--title", default="hf-lsad evaluation", help="grid mode: report title")
    parser.add_argument("--command-line", help="grid mode: the command recorded in the report (default: this one)")


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+")
    parser.add_argument("--model", default="default")
    parser.add_argument("--guard", default="default", help="guard folder or Hub repo; 'default' = the bundled guard")
    parser.add_argument("--max-new-tokens", type=int, default=64)


def _explain(args: argparse.Namespace) -> None:
    from .explain_cli import explain_command

    explain_command(args)


def _explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+")
    parser.add_argument("--guard", default="default", help="guard folder or Hub repo; 'default' = the bundled guard")
    parser.add_argument("--activations", required=True, help="activation store whose prompts illustrate each feature")
    parser.add_argument("--model", default="default")
    parser.add_argument("--top-k", type=int, default=10, help="features listed per prompt")
    parser.add_argument("--examples", type=int, default=3, help="store prompts shown per feature")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="for guards that read the response")


COMMANDS: dict[str, tuple[str, Callable[..., None], Callable[[argparse.Namespace], None], str]] = {
    "collect": ("collect residual-stream activations of a prompt pool", _collect_arguments, _collect, ""),
    "train-sae": ("train a ReLU+L1 SAE on the fit split of safe activations", _train_sae_arguments, _train_sae, ""),
    "fit": ("fit a guard of any registered method on safe activations", _fit_arguments, _fit, ""),
    "calibrate": ("per-cluster affine calibration from a small labelled budget", _calibrate_arguments, _calibrate, ""),
    "evaluate": (
        "evaluate one guard (--guard), or run a method grid and write a report folder (--out)",
        _evaluate_arguments,
        _evaluate,
        "With --guard: AUROC, TPR@5%FPR and flag rate of that guard against unsafe stores. Without: fit every "
        "method of a grid (--grid JSON, default hf_lsad.evaluation.default_grid) on the safe store's fit split, "
        "select hyperparameters on its validation split, and write report.md + results.json to --out "
        "(protocol in hf_lsad.evaluation.protocol).",
    ),
    "generate": ("guarded generation with a safety report per prompt", _generate_arguments, _generate, ""),
    "explain": (
        "the SAE features behind a guard's score, each with the store prompts that activate it most",
        _explain_arguments,
        _explain,
        "",
    ),
}
"""name -> (help, add its arguments, run it, description)."""


def _requested(argv: Sequence[str]) -> tuple[str | None, str]:
    """The command named in ``argv`` and, for ``fit``, the ``--method`` (default :data:`DEFAULT_METHOD`)."""
    command = next((a for a in argv if a in COMMANDS), None)
    method = DEFAULT_METHOD
    for i, arg in enumerate(argv):
        if arg == "--method" and i + 1 < len(argv):
            method = argv[i + 1]
        elif arg.startswith("--method="):
            method = arg.split("=", 1)[1]
    return command, method


def build_parser(command: str | None = None, method: str = DEFAULT_METHOD) -> argparse.ArgumentParser:
    """The parser; only ``command``'s arguments are built (they may import the library), the others list their help."""
    parser = argparse.ArgumentParser(prog="hf-lsad", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (hf-lsad command only)")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (summary, add_arguments, run, description) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=description or summary)
        if name == command:
            add_arguments(sub, method) if name == "fit" else add_arguments(sub)
        sub.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, method = _requested(argv)
    if command == "fit":
        from .detectors import DETECTORS

        if method not in DETECTORS:
            raise SystemExit(f"unknown detector method {method!r}; registered: {sorted(DETECTORS)}")
    args = build_parser(command, method).parse_args(argv)
    args.run(args)


def entry(argv: Sequence[str] | None = None) -> None:
    """The ``hf-lsad`` command: arguments checked before any model is loaded, one-line errors (exit 2 for usage,
    1 for failures), ``--debug`` for the traceback (:mod:`hf_lsad.cli_checks`)."""
    from .cli_checks import check_args, run

    def checked(args: Sequence[str]) -> None:
        args = list(args)
        command, method = _requested(args)
        if command == "fit":
            from .detectors import DETECTORS

            if method not in DETECTORS:
                raise SystemExit(f"unknown detector method {method!r}; registered: {sorted(DETECTORS)}")
        parser = build_parser(command, method)
        namespace = parser.parse_args(args)
        check_args(parser, namespace)
        namespace.run(namespace)

    run(checked, argv)


if __name__ == "__main__":
    entry(sys.argv[1:])

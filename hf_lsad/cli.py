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
``--device`` / ``--dtype`` (collect, generate, explain) and ``--device`` / ``--kmeans-device`` (fit,
train-sae) come from :mod:`hf_lsad.runtime`; ``--guard`` takes ``--revision`` / ``--subfolder``.

    hf-lsad collect   --pool tatsu-lab/alpaca --category safe --text-field instruction --layer 20 --out acts/alpaca
    accelerate launch --num_processes 4 -m hf_lsad.cli collect --pool safe --layer 20 --out acts/safe

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
from typing import Any

from . import cli_arguments as arguments
from .version import __version__

DEFAULT_METHOD = "freqmask-km"


def _collect(args: argparse.Namespace) -> None:
    from .capture import collect_activations
    from .data import POOLS, load_prompts
    from .hook_point import HookPoint
    from .pretrained import load_model, placement
    from .runtime import ModelRuntime, torch_dtype
    from .sharded_collection import finish, process_state, select, shard_of, write_part

    runtime = _runtime(args, ModelRuntime)
    dataset = {} if args.pool in POOLS else arguments.dataset_options(args)
    prompts = load_prompts(args.pool, limit=args.limit, seed=args.seed, **dataset)
    if not prompts:
        raise SystemExit(f"--pool {args.pool} holds no non-empty prompt")
    state = process_state(runtime.device)  # one process, or one of N under accelerate launch / torchrun
    shard = shard_of(state, len(prompts))
    where = placement(runtime.device, state.device if shard.count > 1 else None)
    model, tokenizer = load_model(args.model, dtype=torch_dtype(runtime.dtype), **where)
    mine = select(prompts, shard)
    hook = HookPoint.from_model(model, args.layer, args.position)
    if mine:
        collected = collect_activations(
            model, tokenizer, [p.text for p in mine], layer=args.layer, position=args.position,
            batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, progress=state.is_local_main_process,
        )  # fmt: skip
        records = [dict(p._asdict(), response=r) for p, r in zip(mine, collected.responses)]
        for record in records:
            del record["text"]  # the prompt text stays in the pool; the store keeps ids
        write_part(args.out, shard, collected.activations, records, hook, inputs=collected.inputs)
    finish(state, args.out, shard, len(prompts))
    if state.is_main_process:
        processes = f" by {shard.count} processes" if shard.count > 1 else ""
        print(f"wrote {len(prompts)} activations of {hook.layer_module} ({args.position}){processes} to {args.out}")


def _runtime(args: argparse.Namespace, cls: type) -> Any:
    return arguments.runtime_config(args, cls)


def _guard(args: argparse.Namespace) -> Any:
    """The ``--guard`` at ``--revision`` / ``--subfolder``, through the strict Hub path."""
    from .guard import SafetyGuard

    return SafetyGuard.from_pretrained(args.guard, **arguments.guard_location(args))


def _train_sae(args: argparse.Namespace) -> None:
    from .runtime import FitRuntime, fit_device
    from .sae import SAETrainConfig, sae_stats, train_sae
    from .splits import split_safe
    from .store import load_activations

    device = fit_device(_runtime(args, FitRuntime).device)
    data = load_activations(args.activations)
    split = split_safe(len(data.activations), args.holdout_fraction, args.seed)
    config = SAETrainConfig(l1_coefficient=args.l1, lr=args.lr, batch_size=args.batch_size, epochs=args.epochs, seed=args.seed)
    sae = train_sae(data.activations[split.fit], args.d_sae, config, device=device)
    sae.to("cpu").save_pretrained(args.out)
    stats = {"held_out": sae_stats(sae, data.activations[split.holdout]), "train": sae_stats(sae, data.activations[split.fit])}
    print(json.dumps({name: s._asdict() for name, s in stats.items()}, indent=2))


def _fit(args: argparse.Namespace) -> None:
    import torch

    from .clustering import use_kmeans_device
    from .detectors import detector_class
    from .fitting import fit_guard
    from .runtime import GuardFitRuntime, fit_device
    from .settings import build_config, settings_from_args
    from .store import ActivationStore, load_activations

    cls = detector_class(args.method)
    config = build_config(cls.config_class, settings_from_args(args, args.set), source=f"hf-lsad fit --method {args.method}")
    if cls.uses_sae and not args.sae:
        raise SystemExit(f"{args.method} reads SAE codes: give --sae")
    if cls.supervised != bool(args.unsafe):
        raise SystemExit(f"{args.method} is {'SUPERVISED: give' if cls.supervised else 'unsupervised: leave out'} --unsafe")
    runtime = _runtime(args, GuardFitRuntime)
    device = fit_device(runtime.device)
    data = ActivationStore(args.activations)  # FreqMask-KM streams it; other methods read their fit split
    sae = None
    if args.sae:
        from .sae_formats import load_sae

        # Any layout (hf-lsad, SAELens, sparsify, Gemma Scope); an SAE of another block than the store's is refused.
        sae = load_sae(args.sae, hook_layer=data.hook.layer, revision=args.sae_revision,
                       subfolder=args.sae_subfolder or None).to(device)  # fmt: skip
    unsafe = torch.cat([load_activations(folder).activations for folder in args.unsafe]) if args.unsafe else None
    with use_kmeans_device(runtime.kmeans_device):
        result = fit_guard(
            data, data.hook, args.method, config, sae,
            unsafe=unsafe, target_fpr=args.target_fpr, holdout_fraction=args.holdout_fraction, seed=args.split_seed,
            device=device,
        )  # fmt: skip
    result.guard.to("cpu")
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

    guard = _guard(args)
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
    from .model_card import benign_ood_warning

    guard = _guard(args)
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
    from .modeling import GuardedModelForCausalLM
    from .pretrained import load_model, placement
    from .runtime import ModelRuntime, torch_dtype

    runtime = _runtime(args, ModelRuntime)
    model_name = "SmolLM2-135M-Instruct (bundled GGUF)" if args.model == "default" else args.model
    guard_name = "the bundled SmolLM2 guard" if args.guard == "default" else args.guard
    print(f"loading {model_name} ({runtime.dtype}) and {guard_name} ...", flush=True)
    model, tokenizer = load_model(args.model, dtype=torch_dtype(runtime.dtype), **placement(runtime.device))
    guarded = GuardedModelForCausalLM(model, _guard(args))
    inputs = {name: value.to(guarded.device) for name, value in encode_prompts(tokenizer, args.prompts).items()}
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


def _explain(args: argparse.Namespace) -> None:
    from .explain_cli import explain_command

    explain_command(args)


COMMANDS: dict[str, tuple[str, Callable[..., None], Callable[[argparse.Namespace], None], str]] = {
    "collect": (
        "collect residual-stream activations of a prompt pool",
        arguments.collect_arguments,
        _collect,
        "Under accelerate launch (or torchrun) each process collects a contiguous shard of the prompts on its own "
        "device and process 0 merges the shards, in prompt order, into one store (hf_lsad.sharded_collection).",
    ),
    "train-sae": ("train a ReLU+L1 SAE on the fit split of safe activations", arguments.train_sae_arguments, _train_sae, ""),
    "fit": ("fit a guard of any registered method on safe activations", arguments.fit_arguments, _fit, ""),
    "calibrate": ("per-cluster affine calibration from a small labelled budget", arguments.calibrate_arguments, _calibrate, ""),
    "evaluate": (
        "evaluate one guard (--guard), or run a method grid and write a report folder (--out)",
        arguments.evaluate_arguments,
        _evaluate,
        "With --guard: AUROC, TPR@5%FPR and flag rate of that guard against unsafe stores. Without: fit every "
        "method of a grid (--grid JSON, default hf_lsad.evaluation.default_grid) on the safe store's fit split, "
        "select hyperparameters on its validation split, and write report.md + results.json to --out "
        "(protocol in hf_lsad.evaluation.protocol).",
    ),
    "generate": ("guarded generation with a safety report per prompt", arguments.generate_arguments, _generate, ""),
    "explain": (
        "the SAE features behind a guard's score, each with the store prompts that activate it most",
        arguments.explain_arguments,
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
    parser.add_argument("--version", action="version", version=f"hf-lsad {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (summary, add_arguments, run, description) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=description or summary)
        if name == command:
            add_arguments(sub, method, DEFAULT_METHOD) if name == "fit" else add_arguments(sub)
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

"""The body of each ``hf-lsad`` command (:mod:`hf_lsad.cli` parses and calls them).

Each command imports what it needs when it runs, so that building the parser (``hf-lsad --help``)
imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

from ..data.tables import DEFAULT_COLUMN
from . import arguments
from .echo import shown_prompt


def run_collect(args: argparse.Namespace) -> None:
    from ..capture.collect import collect_activations
    from ..capture.pretrained import load_model, placement
    from ..capture.recorder import PROMPT_POSITIONS
    from ..capture.resumable import PARTIAL, collect_resumably, remove_parts
    from ..capture.sharded import finish, process_state, select, shard_of, write_part
    from ..core.hook_point import HookPoint, decoder_layer
    from ..core.locking import held_alone
    from ..core.runtime import ModelRuntime, torch_dtype
    from ..data import POOLS, load_prompts

    runtime = _runtime(args, ModelRuntime)
    dataset = {} if args.pool in POOLS else arguments.dataset_options(args)
    prompts = load_prompts(args.pool, limit=args.limit, seed=args.seed, **dataset)
    if not prompts:
        raise SystemExit(f"--pool {args.pool} holds no non-empty prompt")
    state = process_state(runtime.device)  # one process, or one of N under accelerate launch / torchrun
    shard = shard_of(state, len(prompts))
    where = placement(runtime.device, state.device if shard.n_processes > 1 else None)
    model, tokenizer = load_model(args.model, dtype=torch_dtype(runtime.dtype), **where)
    mine = select(prompts, shard)
    depth = model.config.get_text_config().num_hidden_layers
    for layer in args.layer:
        decoder_layer(model, layer)  # IndexError naming the depth for a block the model lacks
    reads = [(layer % depth, position) for layer in args.layer for position in args.position]
    texts = [p.text for p in mine]
    parts = Path(args.out) / PARTIAL / (f"rank-{shard.rank:05d}" if shard.n_processes > 1 else "")
    from_prompt = all(position in PROMPT_POSITIONS for _, position in reads)
    if mine and from_prompt:  # one forward pass per batch, written in parts as it goes: a run again resumes
        remedy = f"delete {parts} to collect every prompt again, or collect into another --out"
        parts.mkdir(parents=True, exist_ok=True)
        try:
            with held_alone(parts, collect_in_use(args.out)):
                features, inputs = collect_resumably(
                    model,
                    tokenizer,
                    texts,
                    [p.id for p in mine],
                    reads,
                    parts,
                    remedy=remedy,
                    batch_size=args.batch_size,
                    max_batch_tokens=args.max_batch_tokens,
                    progress=state.is_local_main_process,
                )
        except KeyboardInterrupt:
            print(
                f"note: the prompts collected so far are kept in {parts}; run the same command again to collect "
                "the rest",
                file=sys.stderr,
            )
            raise
        responses = [""] * len(mine)
    elif mine:  # a response position, one read: it generates
        (layer, position), progress = reads[0], state.is_local_main_process
        collected = collect_activations(
            model,
            tokenizer,
            texts,
            layer=layer,
            position=position,
            batch_size=args.batch_size,
            max_batch_tokens=args.max_batch_tokens,
            max_new_tokens=args.max_new_tokens,
            progress=progress,
        )
        features, inputs, responses = {reads[0]: collected.activations}, collected.inputs, collected.responses
    for read in reads:
        out = arguments.store_folder(args.out, read, len(reads))
        if mine:
            records = [dict(p._asdict(), response=r) for p, r in zip(mine, responses)]
            for record in records:
                del record["text"]  # the prompt text stays in the pool; the store keeps ids
            write_part(out, shard, features[read], records, HookPoint.from_model(model, *read), inputs=inputs)
        finish(state, out, shard, len(prompts))
    if shard.n_processes > 1:
        state.wait_for_everyone()  # every store is written: the parts of every process are done with
    if state.is_main_process:
        remove_parts(Path(args.out) / PARTIAL)
        processes = f" by {shard.n_processes} processes" if shard.n_processes > 1 else ""
        stores = ", ".join(arguments.store_folder(args.out, read, len(reads)) for read in reads)
        print(f"wrote {len(prompts)} activations{processes} to {stores}")


def collect_in_use(out: str) -> str:
    """What a ``collect`` run into ``out`` is told while another run collects into it."""
    return f"{out} is being collected into by another run: wait for it to end, or collect into another --out"


def _runtime(args: argparse.Namespace, cls: type) -> Any:
    return arguments.runtime_config(args, cls)


def _load_model(args: argparse.Namespace, runtime: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of ``--model`` in the runtime's dtype, on its device (one process)."""
    from ..capture.pretrained import load_model, placement
    from ..core.runtime import torch_dtype

    return load_model(args.model, dtype=torch_dtype(runtime.dtype), **placement(runtime.device))


def _guard(args: argparse.Namespace) -> Any:
    """The ``--guard`` at ``--revision`` / ``--subfolder``, through the strict Hub path."""
    return _guard_and_folder(args)[0]


def _guard_and_folder(args: argparse.Namespace) -> tuple[Any, Path]:
    """:func:`_guard` and the local folder it was read from (a Hub guard's snapshot), whose card a derived guard's
    card continues (:func:`hf_lsad.guard.card.derived_data`)."""
    from ..core.hub import resolve_pretrained_dir
    from ..guard.files import BUNDLED_GUARDS
    from ..guard.guard import SafetyGuard

    location = arguments.guard_location(args)
    name = BUNDLED_GUARDS.get(args.guard, args.guard)
    folder = resolve_pretrained_dir(name, revision=location.get("revision"), subfolder=location.get("subfolder", ""))
    return SafetyGuard.from_pretrained(folder), folder


def _parent(args: argparse.Namespace) -> str:
    """How a derived guard's card names the guard it came from: ``--guard``, with ``--subfolder`` and ``--revision``."""
    location = arguments.guard_location(args)
    where = f"/{location['subfolder']}" if location.get("subfolder") else ""
    return args.guard + where + (f" at revision {location['revision']}" if location.get("revision") else "")


def run_train_sae(args: argparse.Namespace) -> None:
    from ..core.runtime import FitRuntime, fit_device
    from ..core.splits import split_safe
    from ..data.store import load_activations
    from ..sae.training import SAETrainConfig, sae_stats, train_sae

    device = fit_device(_runtime(args, FitRuntime).device)
    data = load_activations(args.activations)
    split = split_safe(len(data.activations), args.holdout_fraction, args.seed)
    config = SAETrainConfig(
        l1_coefficient=args.l1, lr=args.lr, batch_size=args.batch_size, epochs=args.epochs, seed=args.seed
    )
    sae = train_sae(data.activations[split.fit], args.d_sae, config, device=device)
    sae.layer = data.hook.layer  # what fit checks the store it reads against
    sae.to("cpu").save_pretrained(args.out)
    stats = {
        "held_out": sae_stats(sae, data.activations[split.holdout]),
        "train": sae_stats(sae, data.activations[split.fit]),
    }
    print(json.dumps({name: s._asdict() for name, s in stats.items()}, indent=2))


def run_fit(args: argparse.Namespace) -> None:
    import torch

    from ..core.runtime import GuardFitRuntime, fit_device
    from ..core.settings import build_config, settings_from_args
    from ..data.store import ActivationStore, load_activations
    from ..detectors import detector_class
    from ..detectors.clustering import use_kmeans_device
    from ..guard.fitting import fit_guard

    cls = detector_class(args.method)
    config = build_config(
        cls.config_class, settings_from_args(args, args.set), source=f"hf-lsad fit --method {args.method}"
    )
    if cls.uses_sae and not args.sae:
        raise SystemExit(f"{args.method} reads SAE codes: give --sae")
    if cls.supervised != bool(args.unsafe):
        raise SystemExit(
            f"{args.method} is {'SUPERVISED: give' if cls.supervised else 'unsupervised: leave out'} --unsafe"
        )
    runtime = _runtime(args, GuardFitRuntime)
    device = fit_device(runtime.device)
    data = ActivationStore(args.activations)  # FreqMask-KM streams it; other methods read their fit split
    sae = None
    if args.sae:
        from ..sae.formats import load_sae

        # Any layout (hf-lsad, SAELens, sparsify, Gemma Scope); an SAE of another block than the store's is refused.
        sae = load_sae(
            args.sae, hook_layer=data.hook.layer, revision=args.sae_revision, subfolder=args.sae_subfolder or None
        ).to(device)
    unsafe = torch.cat([load_activations(folder).activations for folder in args.unsafe]) if args.unsafe else None
    with use_kmeans_device(runtime.kmeans_device):
        result = fit_guard(
            data,
            data.hook,
            args.method,
            config,
            sae,
            unsafe=unsafe,
            target_fpr=args.target_fpr,
            holdout_fraction=args.holdout_fraction,
            seed=args.split_seed,
            device=device,
        )
    result.guard.to("cpu")
    result.guard.save_pretrained(args.out)
    print(
        f"fitted {result.guard.config.method} on {len(result.split.fit)} safe rows; "
        f"threshold {result.guard.threshold:.4g} at {args.target_fpr:.0%} FPR on {len(result.split.holdout)} held-out "
        f"rows"
    )
    if args.push_to_hub:
        from ..guard.card import describe_records

        commit = result.guard.push_to_hub(
            args.push_to_hub,
            subfolder=args.subfolder,
            private=args.private or None,
            data=describe_records(
                data.records, what=f"safe prompts (activation store `{Path(args.activations).name}`)"
            ),
        )
        print(f"pushed to {commit.repo_url.repo_id}{'/' + args.subfolder if args.subfolder else ''} at {commit.oid}")


def run_calibrate(args: argparse.Namespace) -> None:
    from ..evaluation.protocol import calibrate_guard

    guard = _guard(args)
    try:
        calibration, labelled = calibrate_guard(
            guard,
            args.safe,
            args.unsafe,
            args.benign_ood,
            budget=args.budget,
            seed=args.seed,
            probability_threshold=args.probability_threshold,
        )
    except ValueError as err:
        raise SystemExit(str(err)) from err
    guard.set_calibration(calibration)
    guard.save_pretrained(args.out)
    counts = ", ".join(f"{n} {group}" for group, n in labelled.items())
    negative = sum(a < 0 for a in calibration.slopes)
    print(
        f"calibrated {guard.config.method} on {counts} labelled rows (budget {args.budget:g}); lambda "
        f"{calibration.lam:g}, {negative} negative slopes, {calibration.coverage()}; "
        f"wrote {args.out}"
    )


def run_evaluate(args: argparse.Namespace) -> None:
    if args.benign_prompts:
        _evaluate_prompts(args)
    elif args.guard:
        _evaluate_guard(args)
    else:
        _evaluate_grid(args)


def _evaluate_guard(args: argparse.Namespace) -> None:
    from ..evaluation.protocol import evaluate_guard
    from ..guard.card import benign_ood_warning

    guard = _guard(args)
    try:
        rows = evaluate_guard(guard, args.safe, args.unsafe, args.benign_ood)
    except ValueError as err:
        raise SystemExit(str(err)) from err
    warning = benign_ood_warning(rows["benign_ood"]["flagged"]) if "benign_ood" in rows else ""
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    print(json.dumps(rows, indent=2))


def _evaluate_prompts(args: argparse.Namespace) -> None:
    from ..evaluation.plots import write_report
    from ..evaluation.prompts import check_prompt_sources, evaluate_prompt_sources

    sources = {}
    for flag, unsafe in (("benign_prompts", False), ("unsafe_prompts", True)):
        for item in getattr(args, flag):
            name, _, source = item.partition("=")
            sources[name] = (_prompt_table(source, column=args.column, limit=args.limit), unsafe)
    check_prompt_sources(sources)  # before the model loads
    guarded = _guarded_model(args)
    evaluation = evaluate_prompt_sources(guarded, sources, batch_size=args.batch_size, system=args.system)
    summary = evaluation.summary()
    metrics = {
        "thresholds": evaluation.thresholds,
        "system": evaluation.system,
        "sources": evaluation.metrics(),
        "summary": summary,
    }
    report = json.dumps(metrics, indent=2)
    print(report)
    print(f"unsafe sources caught, {_spread_line(summary)}", file=sys.stderr)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(report)
        written = write_report(evaluation, out, title=args.title)
        print(f"wrote {out / 'metrics.json'}, {', '.join(written)} in {out}", file=sys.stderr)


def _spread_line(summary: dict[str, Any]) -> str:
    """:meth:`~hf_lsad.evaluation.prompts.PromptEvaluation.summary` in one line."""
    from ..evaluation.sources import REPORTED_FPRS

    points = [("at the guard's thresholds", summary["at_guard_thresholds"])]
    points += [(f"at {fpr:.0%}", summary[f"at_fpr_{fpr:g}"]) for fpr in REPORTED_FPRS]
    parts = [f"{where} {s['median']:.0%} / {s['worst']['source']} {s['worst']['rate']:.0%}" for where, s in points]
    rows = summary["benign_rows"]
    line = f"median / worst source, {'; '.join(parts)} (the fixed rates of the {rows} benign rows together)"
    unresolved = [fpr for fpr in REPORTED_FPRS if rows * fpr < 1]  # rates at which no benign row may be flagged
    if unresolved:
        rates = " and ".join(f"{fpr:.0%}" for fpr in unresolved)
        line += (
            f"; at {rates}, {rows} benign rows allow no flag, so the thresholds there sit above every benign row: "
            f"bring {math.ceil(1 / min(unresolved))} or more to measure {rates}"
        )
    return line


def _prompt_table(source: str, **kwargs: Any) -> list[Any]:
    """:func:`~hf_lsad.data.tables.read_prompt_table` of ``source`` for every command that reads tables of prompts,
    whose missing column names the flag that chooses it; a table without rows is refused, before any model loads."""
    from ..data.tables import MissingColumnError, read_prompt_table

    try:
        rows = read_prompt_table(source, **kwargs)
    except MissingColumnError as err:
        flag = "--id-column" if err.column == kwargs.get("id_column") else "--column"
        raise ValueError(f"{err}; choose one with {flag}") from None
    if not rows:
        raise ValueError(f"{source} holds no rows")
    return rows


def _evaluate_grid(args: argparse.Namespace) -> None:
    from ..evaluation import (
        GridConfig,
        default_grid,
        load_eval_data,
        load_or_train_sae,
        make_splits,
        run_grid,
        sae_summary,
        write_report,
    )
    from ..sae.training import SAETrainConfig

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
        sae, info = load_or_train_sae(
            args.sae, data.safe[splits.safe_fit], splits.safe_fit, d_sae=args.d_sae, training=training
        )
        sae_info = sae_summary(sae, data, splits, info)
    results = run_grid(data, config, sae, splits=splits)
    command = args.command_line or "hf-lsad " + shlex.join(sys.argv[1:])
    folder = write_report(
        args.out, results, data=data, config=config, command=command, title=args.title, sae_info=sae_info
    )
    print(f"wrote {folder / 'report.md'} and {folder / 'results.json'}")


def _guarded_model(args: argparse.Namespace) -> Any:
    """``--model`` wrapped with ``--guard``, its tokenizer attached, saying what it loads."""
    from ..core.runtime import ModelRuntime
    from ..generation.model import GuardedModelForCausalLM

    runtime = _runtime(args, ModelRuntime)
    model_name = "SmolLM2-135M-Instruct (bundled GGUF)" if args.model == "default" else args.model
    guard_name = {"default": "the bundled two-headed SmolLM2 guard", "paper": "the bundled paper guard"}.get(
        args.guard, args.guard
    )
    print(f"loading {model_name} ({runtime.dtype}) and {guard_name} ...", file=sys.stderr, flush=True)
    guard = _guard(args)  # a guard that is missing or corrupt fails before the model is loaded
    model, tokenizer = _load_model(args, runtime)
    return GuardedModelForCausalLM(model, guard, tokenizer=tokenizer, **arguments.mismatch_allowances(args))


def run_generate(args: argparse.Namespace) -> None:
    import torch

    from ..capture.collect import encode_prompts
    from ..generation.generate import decoding_settings

    guarded = _guarded_model(args)
    tokenizer = guarded.tokenizer
    inputs = encode_prompts(tokenizer, args.prompts, device=guarded.device, system=args.system)
    top_p = 1.0 if args.top_p is None else args.top_p
    how = "greedy"
    if args.temperature > 0:  # sampled as hf-lsad serve samples (decoding_settings)
        how = f"sampling at temperature {args.temperature}, top-p {top_p}" + (
            f", seed {args.seed}" if args.seed is not None else ""
        )
        if args.seed is not None:
            torch.manual_seed(args.seed)
    print(f"generating up to {args.max_new_tokens} tokens for {len(args.prompts)} prompt(s) ({how}) ...\n", flush=True)
    with torch.no_grad():
        output = guarded.generate(
            **inputs,
            max_new_tokens=args.max_new_tokens,
            **decoding_settings(args.temperature, top_p),
            return_dict_in_generate=True,
            on_flag=args.on_flag or ("report" if guarded.guard.config.hook.position == "response_last" else "stop"),
            refusal=args.refusal or None,
            explain=args.explain > 0,
            explain_top_k=max(args.explain, 1),
        )
    responses = tokenizer.batch_decode(output.sequences[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"guard: {guarded.guard.describe()}\n")
    for prompt, response, report in zip(args.prompts, responses, output.safety):
        if report.stopped and report.step == 0:
            response = f"[stopped before its first token]{f' {response.strip()}' if response.strip() else ''}"
        why = ""
        if report.tokens:  # --explain: the words behind a supervised head's verdict
            words = ", ".join(f"{t.text(tokenizer)!r} {t.contribution:+.3f}" for t in report.tokens)
            why = f"why:      {report.explained_head}: {words} (what each adds to its logit)\n"
        print(f"prompt:   {shown_prompt(prompt)}\nresponse: {response.strip()}\nsafety:   {report.describe()}\n{why}")


def run_explain(args: argparse.Namespace) -> None:
    from .explain import explain_command

    explain_command(args)


def read_prompt_file(path: str, column: str = DEFAULT_COLUMN) -> list[str]:
    """Prompts of a table (:data:`~hf_lsad.data.tables.TABLE_SUFFIXES`, read as ``hf-lsad screen`` reads them:
    ``column``, by default ``prompt`` or, without one, the last user turn of ``messages``; a row without a prompt is an
    error) or of a UTF-8 text file (one per non-empty line; a byte order mark is not part of the first)."""
    from ..data.tables import TABLE_SUFFIXES, text_lines

    if not path.lower().endswith(TABLE_SUFFIXES):
        if column != DEFAULT_COLUMN:
            raise ValueError(f"{path}: a text file holds one prompt per line and has no column {column!r} to choose")
        return text_lines(Path(path))
    rows = _prompt_table(path, column=column)
    bad = next((row for row in rows if row.error is not None), None)
    if bad is not None:
        raise ValueError(f"{path}: row {bad.id}: {bad.error}")
    return [row.text for row in rows if row.text is not None]  # every row has its text: none has an error


def _how_read(args: argparse.Namespace, guard: Any) -> str:
    """What a card's data line adds for ``--system`` and for a model with peft adapters: the turn every prompt was
    formatted under, the adapter it was read through ("" for neither)."""
    from ..capture.adapters import adapter_label

    turn = "" if args.system is None else f", every prompt under the system turn {args.system!r}"
    adapter = guard.inputs.adapter if guard.inputs is not None else None
    return turn + ("" if adapter is None else f", every prompt read through {adapter_label(adapter)}")


def run_add_head(args: argparse.Namespace) -> None:
    from ..core.runtime import ModelRuntime
    from ..errors import ThresholdsResetWarning
    from ..guard.card import derived_data
    from ..guard.heads.training import add_head

    runtime = _runtime(args, ModelRuntime)
    guard, folder = _guard_and_folder(args)
    unsafe = read_prompt_file(args.unsafe, args.column)
    safe = read_prompt_file(args.safe, args.column) if args.safe else []
    model, tokenizer = _load_model(args, runtime)
    guard.config.hook.check_model(model)
    before = guard.budget
    was = dict(zip(before.heads, before.thresholds)) if before is not None else {}
    added_to = copy.deepcopy(guard) if args.domain_check or args.harm_check else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ThresholdsResetWarning)  # said before the model loaded (cli.checks)
        budget = add_head(
            model,
            tokenizer,
            guard,
            args.name,
            unsafe,
            safe,
            share=args.share,
            safe_weight=args.safe_weight,
            benign_per_pool=args.benign_per_pool,
            threshold_rows=args.threshold_rows,
            cache_dir=args.cache,
            batch_size=args.batch_size,
            max_batch_tokens=args.max_batch_tokens,
            system=args.system,
        )
    out = args.out or args.guard
    # a new card: the old card's figures described the guard without this head
    change = (
        f"head {args.name!r} added with `hf-lsad add-head` from {len(unsafe)} prompts of its category"
        f" and {len(safe)} of the user's own safe prompts"
        + ("" if args.safe_weight is None else f" (carrying {args.safe_weight:.0%} of the benign weight)")
        + ", against the fit rows of the bundled benign pools"
    ) + _how_read(args, guard)
    guard.save_pretrained(out, data=derived_data(_parent(args), folder, change))
    print(f"added head {args.name!r} ({len(unsafe)} unsafe, {len(safe)} own safe prompts); wrote {out}")
    for name, share, threshold in zip(budget.heads, budget.shares, budget.thresholds):
        old = f" (was {was[name]:.4g})" if name in was else ""  # the heads that were there give up budget
        print(f"  {name}: share {share:.2f}, threshold {threshold:.4g}{old}")
    confidence = f", {budget.confidence:.0%} confidence" if budget.confidence is not None else ""
    print(
        f"  together: {budget.measured_fpr:.2%} of {budget.n_rows} rows of {budget.rows} "
        f"(target {budget.target_fpr:.0%}{confidence})"
    )
    if added_to is not None:  # its thresholds were set on bundled chat: the other domains and the harm are checked
        _check_what_changed(args, model, tokenizer, added_to, guard, chat_rows=0, seed=0, cache=args.cache)


def run_set_budget(args: argparse.Namespace) -> None:
    from ..core.runtime import ModelRuntime
    from ..errors import ThresholdsResetWarning
    from ..guard.card import derived_data
    from ..guard.heads.budget import fit_budget_on_prompts

    runtime = _runtime(args, ModelRuntime)
    guard, folder = _guard_and_folder(args)
    prompts = read_prompt_file(args.benign, args.column) if args.benign else None  # None: the bundled rows
    model, tokenizer = _load_model(args, runtime)
    guard.config.hook.check_model(model)
    before = guard.budget
    chat_rows = args.chat_check if args.benign else 0  # without --benign the thresholds are set on that chat
    came_from = copy.deepcopy(guard) if chat_rows or args.domain_check or args.harm_check else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ThresholdsResetWarning)  # said before the model loaded (cli.checks)
        budget = fit_budget_on_prompts(
            model,
            tokenizer,
            guard,
            prompts,
            target_fpr=args.target_fpr,
            confidence=args.confidence,
            rows=f"the user's own benign prompts, {Path(args.benign).name}" if args.benign else None,
            batch_size=args.batch_size,
            max_batch_tokens=args.max_batch_tokens,
            system=args.system,
            keep_nearest=True if args.keep_nearest else None,  # None: the bundled rows are kept, a user's when asked
            keep_bundled=args.keep_bundled,
            cache_dir=args.cache,
        )
    out = args.out or args.guard
    # a new card: the old card's figures were measured at the old thresholds
    # budget.rows also names the system turn and the adapter, which _how_read says once for every command
    kept_rows, kept = _kept_pools(args)
    own_rows = budget.n_rows - kept_rows
    rows = "of the user's own benign prompts" if args.benign else "bundled validation chat rows"
    change = f"thresholds set with `hf-lsad set-budget` on {own_rows} {rows}{kept}" + _how_read(args, guard)
    guard.save_pretrained(out, data=derived_data(_parent(args), folder, change))
    print(f"thresholds set on {own_rows} prompts of {args.benign or 'the bundled validation chat'}{kept}; wrote {out}")
    old_thresholds = before.thresholds if before is not None and before.heads == budget.heads else None
    for i, (name, share, threshold) in enumerate(zip(budget.heads, budget.shares, budget.thresholds)):
        was = f" (was {old_thresholds[i]:.4g})" if old_thresholds is not None else ""
        print(f"  {name}: share {share:.2f}, threshold {threshold:.4g}{was}")
    confidence = f", {budget.confidence:.0%} confidence" if budget.confidence is not None else ""
    print(
        f"  together: {budget.measured_fpr:.2%} of the {budget.n_rows} prompts "
        f"(target {budget.target_fpr:.0%}{confidence}{KEPT_WITHIN * bool(kept)})"
    )
    _echo_kept_rows(guard)
    if came_from is not None:
        _check_what_changed(args, model, tokenizer, came_from, guard, chat_rows=chat_rows, seed=0, cache=args.cache)


def run_teach(args: argparse.Namespace) -> None:
    from ..core.runtime import ModelRuntime
    from ..errors import ReteachWarning, SmallSampleWarning
    from ..guard.card import derived_data
    from ..guard.heads.training import teach_traffic

    runtime = _runtime(args, ModelRuntime)
    guard, folder = _guard_and_folder(args)
    prompts = read_prompt_file(args.benign, args.column)
    model, tokenizer = _load_model(args, runtime)
    guard.config.hook.check_model(model)
    taught_from = copy.deepcopy(guard) if args.chat_check or args.domain_check or args.harm_check else None
    with warnings.catch_warnings():
        for said in (SmallSampleWarning, ReteachWarning):  # said before the model loaded (cli.checks)
            warnings.simplefilter("ignore", said)
        budget = teach_traffic(
            model,
            tokenizer,
            guard,
            prompts,
            head=args.head,
            fit_fraction=args.fit_fraction,
            **({"pools": args.pools} if args.pools else {}),
            rows_per_pool=args.rows_per_pool,
            target_fpr=args.target_fpr,
            confidence=args.confidence,
            rows=f"the user's own benign prompts, {Path(args.benign).name}",
            cache_dir=args.cache,
            batch_size=args.batch_size,
            max_batch_tokens=args.max_batch_tokens,
            seed=args.seed,
            system=args.system,
            keep_nearest=args.keep_nearest,
            keep_bundled=args.keep_bundled,
        )
    out = args.out or args.guard
    kept_rows, kept = _kept_pools(args)
    held_back = budget.n_rows - kept_rows
    taught = len(prompts) - held_back
    change = (
        f"head `{args.head}` fitted again with `hf-lsad teach` on {taught} of the user's own benign prompts beside "
        f"the bundled pools' fit rows; thresholds set on the other {held_back}{kept}"
    ) + _how_read(args, guard)
    guard.save_pretrained(out, data=derived_data(_parent(args), folder, change))
    print(f"head {args.head!r} taught {taught} prompts of {args.benign}; thresholds set on the other {held_back}{kept}")
    print(f"wrote {out}")
    for name, share, threshold in zip(budget.heads, budget.shares, budget.thresholds):
        print(f"  {name}: share {share:.2f}, threshold {threshold:.4g}")
    confidence = f", {budget.confidence:.0%} confidence" if budget.confidence is not None else ""
    rows = "held-back prompts and kept rows" if kept else "held-back prompts"
    print(
        f"  together: {budget.measured_fpr:.2%} of the {budget.n_rows} {rows} "
        f"(target {budget.target_fpr:.0%}{confidence}{KEPT_WITHIN * bool(kept)})"
    )
    _echo_kept_rows(guard)
    if taught_from is not None:
        check = {"chat_rows": args.chat_check, "seed": args.seed, "cache": args.cache}
        _check_what_changed(args, model, tokenizer, taught_from, guard, **check)


KEPT_WITHIN = ", each kind of rows within it"
"""What the ``together`` line of ``set-budget`` and ``teach`` adds when ``--keep-bundled`` kept pools within the budget:
the rate over all rows is not the rule, each kind's is."""


def _kept_pools(args: argparse.Namespace) -> tuple[int, str]:
    """``--keep-bundled``: how many bundled validation rows the thresholds also kept within the budget, and the words
    that say which (``""`` for none)."""
    from ..guard.heads.budget import kept_pools_label
    from ..guard.heads.bundled import release_rows

    sizes = {pool: len(release_rows(pool, "validation")) for pool in args.keep_bundled}
    if not sizes:
        return 0, ""
    return sum(sizes.values()), f", beside {kept_pools_label(sizes)}, each kind kept within the budget"


HARMFUL_IN_SAMPLE = (
    "harmful prompts in the sample count as benign and raise them too: read what hf-lsad screen --with-prompt flags in "
    "it and take the harm out"
)
"""What ``--harm-check``'s warning after ``set-budget`` and ``teach`` adds: a sample in which one prompt in twenty was
a plain harmful request raised both thresholds above 0.99 (``heads/dev_traffic_harm_5pct``)."""
HARM_ADVICE = {
    "set-budget": "thresholds set on traffic that looks like harm rise; hf-lsad teach on that traffic keeps far more "
    f"of it; {HARMFUL_IN_SAMPLE} (docs/heads.md, 'Your own traffic')",
    "teach": f"the thresholds rose on the prompts held back; {HARMFUL_IN_SAMPLE}; about a thousand prompts hold them "
    "steadier (docs/heads.md, 'Your own traffic')",
    "add-head": "the new head's share of the budget came from the other heads; a smaller --share leaves them more",
}
"""What ``--harm-check``'s warning advises after each command that changes a guard."""
NO_TEACH_ADVICE = (
    "thresholds set on traffic that looks like harm rise; this guard has no supervised head to teach that traffic: "
    f"the default guard's hf-lsad teach keeps far more of it; {HARMFUL_IN_SAMPLE} (docs/heads.md, 'Your own traffic')"
)
"""``set-budget``'s advice instead, for a guard that ``teach`` cannot teach (no supervised head, as the paper's)."""


def harm_advice(command: str, guard: Any) -> str:
    """What ``--harm-check``'s warning advises after ``command`` changed ``guard``."""
    return NO_TEACH_ADVICE if command == "set-budget" and not guard.heads else HARM_ADVICE[command]


DOMAIN_ADVICE = {
    "set-budget": "the thresholds hold the budget on the traffic you brought; if the deployment also serves these, "
    "{keep}bring a sample that holds them too (docs/heads.md, 'Your own traffic')",
    "teach": "the head and thresholds hold the budget on the traffic you brought; if the deployment also serves these, "
    "{keep}bring a sample that holds them too (docs/heads.md, 'Your own traffic')",
    "add-head": "the new head flags them: bring prompts of these kinds as --safe, or give it a smaller --share",
}
"""What ``--domain-check``'s warning advises after each command that changes a guard (``{keep}``: the
``--keep-bundled`` that would keep the risen kinds within the budget, :func:`domain_advice`)."""
UNKEPT_DOMAINS = ("lookalike",)
"""Kinds of benign traffic the advice does not offer to keep within the budget: the released guard flags 22% of the
look-alikes' validation rows, above any budget of a few percent, so keeping them would raise the thresholds far."""


def domain_advice(command: str, risen: list[str]) -> str:
    """What ``--domain-check``'s warning advises after ``command`` changed a guard that now flags far more of the
    ``risen`` pools: for ``set-budget`` and ``teach``, to keep those it can within the budget by ``--keep-bundled``."""
    keep = [pool for pool in risen if pool not in UNKEPT_DOMAINS]
    offered = f"keep them within the budget too (--keep-bundled {' '.join(keep)}) or " if keep else ""
    return DOMAIN_ADVICE[command].format(keep=offered)


def _check_what_changed(
    args: argparse.Namespace,
    model: Any,
    tokenizer: Any,
    before: Any,
    after: Any,
    *,
    chat_rows: int,
    seed: int,
    cache: str | None,
) -> None:
    """``--chat-check``, ``--domain-check`` and ``--harm-check``: what the change did to ordinary chat (``chat_rows``
    of it, 0: not read), to the other kinds of benign traffic and to the bundled harm, beside the guard it came from,
    once the new guard is written (a check that fails loses nothing); the rows are drawn with ``seed`` and kept in the
    ``cache`` of the bundled rows, if any."""
    from ..data.pools import CHECK_DOMAINS
    from ..guard.heads.bundled import release_rows
    from ..guard.heads.bundled_checks import (
        bundled_chat_flag_rates,
        bundled_domain_flag_rates,
        bundled_harm_catch_rates,
        chat_shift_warning,
        domain_shift_warning,
        harm_drop_warning,
        risen_domains,
    )

    reading = {
        "seed": seed,
        "cache_dir": cache,
        "batch_size": args.batch_size,
        "max_batch_tokens": args.max_batch_tokens,
        "system": args.system,
    }
    if chat_rows:
        was, now = bundled_chat_flag_rates(model, tokenizer, [before, after], rows=chat_rows, **reading)
        rows = min(chat_rows, len(release_rows("chat", "validation")))
        print(
            f"  bundled validation chat ({rows} rows): the new guard flags {now:.1%}, the guard it came from {was:.1%}"
        )
        warning = chat_shift_warning(was, now, after.budget.target_fpr)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    if args.domain_check:
        was_flagged, now_flagged = bundled_domain_flag_rates(
            model, tokenizer, [before, after], rows_per_domain=args.domain_check, **reading
        )
        shares = ", ".join(
            f"{CHECK_DOMAINS[pool]} {now_flagged[pool]:.1%} ({was_flagged[pool]:.1%})" for pool in now_flagged
        )
        print(
            f"  bundled validation benign domains (at most {args.domain_check} rows of each): the new guard flags "
            f"{shares}; in brackets, the guard it came from"
        )
        warning = domain_shift_warning(was_flagged, now_flagged, after.budget.target_fpr)
        if warning:
            risen = risen_domains(was_flagged, now_flagged, after.budget.target_fpr)
            print(f"warning: {warning}: {domain_advice(args.command, risen)}", file=sys.stderr)
    if args.harm_check:
        was_caught, now_caught = bundled_harm_catch_rates(
            model, tokenizer, [before, after], rows_per_source=args.harm_check, **reading
        )
        print(
            f"  bundled validation harm (at most {args.harm_check} rows of each of {len(now_caught)} sources and "
            f"pools): the new guard catches {_caught(now_caught)}, the guard it came from {_caught(was_caught)}"
        )
        warning = harm_drop_warning(was_caught, now_caught)
        if warning:
            print(f"warning: {warning}: {harm_advice(args.command, after)}", file=sys.stderr)


def _caught(rates: dict[str, float]) -> str:
    from ..evaluation.prompts import median_and_worst

    spread = median_and_worst(rates)
    return f"{spread['median']:.0%} in the median (worst {spread['worst']['source']} {spread['worst']['rate']:.0%})"


def _echo_kept_rows(guard: Any) -> None:
    """Say which prompts the guard folder now carries: those nearest the thresholds, kept for the model check."""
    boundary = guard.fingerprint.boundary if guard.fingerprint is not None else None
    if boundary is not None:
        print(
            f"  kept in the folder for the model check: the {boundary.input_ids.shape[0]} of the {boundary.n_rows} "
            f"prompts nearest the thresholds ({boundary.rows})"
        )


def run_push(args: argparse.Namespace) -> None:
    from pathlib import Path

    from huggingface_hub import ModelCard

    from ..guard.files import BUNDLED_GUARDS, MODEL_CARD
    from ..guard.guard import SafetyGuard

    guard = SafetyGuard.from_pretrained(args.guard_dir)  # every check of loading, before anything is sent
    folder = Path(BUNDLED_GUARDS.get(args.guard_dir, args.guard_dir))
    card = ModelCard.load(folder / MODEL_CARD) if (folder / MODEL_CARD).is_file() else None
    commit = guard.push_to_hub(
        args.repo_id,
        subfolder=args.subfolder,
        commit_message=args.commit_message,
        private=True if args.private else None,
        token=args.token,
        revision=args.revision,
        card=card,
    )
    where = f"{args.repo_id}{'/' + args.subfolder if args.subfolder else ''}"
    print(f"pushed {folder} to {where} at {commit.oid}")
    print(f"load it pinned: SafetyGuard.from_pretrained({args.repo_id!r}, revision={commit.oid!r})")


def run_pull(args: argparse.Namespace) -> None:
    import shutil
    from pathlib import Path

    from ..core.hub import resolve_pretrained_dir
    from ..core.serialization import staged_folder
    from ..guard.files import GUARD_CONFIG
    from ..guard.guard import SafetyGuard

    location = {"revision": args.revision, "subfolder": args.subfolder, "token": args.token}
    folder = resolve_pretrained_dir(args.repo_id, **location)
    SafetyGuard.from_pretrained(folder)  # every check of loading, before anything is written
    out = Path(args.out)
    # staged as a save is: a pull that fails or is killed leaves no half of a guard in out, and is run again
    with staged_folder(out, GUARD_CONFIG) as staging:
        shutil.copytree(folder, staging, dirs_exist_ok=True)  # copies what the cache links point to
    parts = folder.parts
    commit = parts[parts.index("snapshots") + 1] if "snapshots" in parts else None
    print(f"pulled {args.repo_id}{f' at {commit}' if commit else ''} to {out}")


def run_screen(args: argparse.Namespace) -> None:
    from ..generation.bulk import screen_to_jsonl, verdicts_of

    rows = _prompt_table(
        args.input,
        column=args.column,
        id_column=args.id_column,
        limit=args.limit,
        split=args.split,
        conversation=args.conversation,
    )
    guarded = _guarded_model(args)
    print(f"screening {len(rows)} rows of {args.input} into {args.out}", file=sys.stderr, flush=True)
    try:
        summary = screen_to_jsonl(
            guarded,
            rows,
            args.out,
            batch_size=args.batch_size,
            max_batch_tokens=args.max_batch_tokens,
            chat_template=not args.raw,
            system=args.system,
            explain=args.explain,
            with_prompt=args.with_prompt,
            progress=True,
        )
    except KeyboardInterrupt:
        written = len({str(record["id"]) for record in verdicts_of(Path(args.out), [row.id for row in rows])})
        print(
            f"note: {written} of {len(rows)} rows have a verdict in {args.out}; run the same command again to screen "
            "the rest",
            file=sys.stderr,
        )
        raise
    print(summary.describe())
    advice = _flagged_often_advice(args, guarded.guard, summary)
    if advice:
        print(f"note: {advice}", file=sys.stderr)


def _flagged_often_advice(args: argparse.Namespace, guard: Any, summary: Any) -> str:
    """What to do about a table the guard flags often (:meth:`~hf_lsad.generation.bulk.ScreenSummary.flagged_often`):
    teach the guard a sample of it, if it is benign traffic the deployment serves, with the ``hf-lsad teach`` command
    that reads it as this screen did, for the supervised head that flagged most of it; a head added from the user's
    own examples, which ``teach`` refuses, is added again with the table as its safe prompts. ``""`` for a table
    flagged less, one read whole (``--conversation``) or without the chat template (``--raw``), which ``teach`` does
    not read so, or a guard without a budget or supervised head."""
    from ..generation.bulk import FLAGGED_OFTEN
    from ..guard.heads.training import added_from_own_examples

    budget = guard.budget
    supervised = list(guard.heads)  # the anomaly head is not among them
    if budget is None or not supervised or args.conversation or args.raw:
        return ""
    if not summary.flagged_often(budget.target_fpr):
        return ""
    head = max(supervised, key=lambda name: summary.flagged_by_head.get(name, 0))  # the first of equals
    sample = args.input if Path(args.input).is_file() else "YOUR_SAMPLE"
    reads = [] if args.column == DEFAULT_COLUMN else ["--column", args.column]  # the table as this screen read it
    reads += [] if args.model == "default" else ["--model", args.model]
    reads += [] if args.system is None else ["--system", args.system]
    flagged = (
        f"{summary.scored_flagged / summary.scored:.0%} of the rows scored were flagged, more than {FLAGGED_OFTEN:g} "
        f"times the {budget.target_fpr:.0%} of benign traffic the guard's thresholds allow (beyond chance, 95% "
        "confidence)."
    )
    if added_from_own_examples(guard.heads[head]):  # teach refuses it (check_teachable)
        added = ["hf-lsad", "add-head", "--guard", "GUARD_IT_WAS_ADDED_TO", "--name", head, "--unsafe"]
        added += ["YOUR_EXAMPLES", "--safe", sample, *reads, "--out", "my-guard"]
        return (
            f"{flagged} Head '{head}', which flagged most of them, was added from your own unsafe examples, which the "
            "guard does not keep, so it cannot be taught: if the rows are benign traffic your deployment serves, add "
            f"it again with them as its safe prompts ({shlex.join(added)}; docs/heads.md, 'A head for your own "
            "category'). If they hold what it was added for, it is doing its work."
        )
    command = ["hf-lsad", "teach", "--guard", args.guard, "--benign", sample]
    command += [] if args.revision is None else ["--revision", args.revision]
    command += [] if not args.subfolder else ["--subfolder", args.subfolder]
    command += [] if head == "harm" else ["--head", head]
    command += [*reads, "--rows-per-pool", "1000", "--out", "my-guard"]
    return (
        f"{flagged} If they are benign traffic your deployment serves, the guard does not know their kind: teach it "
        "about a thousand of them "
        f"({shlex.join(command)}; add --keep-bundled chat if it serves ordinary chat too; docs/heads.md, 'Your own "
        "traffic'). If they hold harm, it is doing its work."
    )


def run_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from ..serving import ServeConfig, create_app, raw_prompt_note

    guarded = _guarded_model(args)
    name = args.name or ("SmolLM2-135M-Instruct" if args.model == "default" else args.model)
    config = ServeConfig(
        model_name=name,
        api_key=args.api_key,
        max_tokens_limit=args.max_tokens,
        default_max_tokens=args.default_max_tokens,
        max_body_bytes=args.max_body_bytes,
        max_concurrency=args.max_concurrency,
        max_choices=args.max_choices,
        explain=args.explain,
    )
    print(f"serving {name} with {guarded.guard.describe()}", file=sys.stderr, flush=True)
    note = raw_prompt_note(guarded)
    if note is not None:
        print(note, file=sys.stderr, flush=True)
    uvicorn.run(create_app(guarded, config), host=args.host, port=args.port, log_level="info")

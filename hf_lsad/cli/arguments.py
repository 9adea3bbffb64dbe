"""The arguments of each ``hf-lsad`` command (:mod:`hf_lsad.cli` parses and calls).

Each ``*_arguments`` function builds one command's parser and is called only for the
command being run, so building them may import the library. ``--device`` / ``--dtype``
are generated from :mod:`hf_lsad.core.runtime`'s ``ModelRuntime`` / ``FitRuntime`` / ``GuardFitRuntime``
(group ``runtime``), a method's settings from its config (group ``setting``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..core.hook_point import POSITIONS
from ..core.runtime import FitRuntime, GuardFitRuntime, ModelRuntime
from ..data.pools import (
    CHAT_CHECK_ROWS,
    CHECK_DOMAINS,
    DOMAIN_CHECK_ROWS,
    EVAL_SOURCES,
    HARM_CHECK_POOLS,
    HARM_CHECK_ROWS,
    KEEPABLE_POOLS,
)
from ..data.tables import DEFAULT_COLUMN

RUNTIME = "runtime"
"""Destination group of the ``--device`` / ``--dtype`` flags (:func:`hf_lsad.core.settings.settings_from_args`)."""
PROMPT_FILE = "a text file (one prompt per line), or a .jsonl, .json, .csv or .parquet table (its --column)"
"""A prompt file of ``add-head``, ``set-budget`` and ``teach`` (:func:`hf_lsad.cli.commands.read_prompt_file`)."""
PROMPT_COLUMN_HELP = f"the prompt column of a table (default {DEFAULT_COLUMN!r}; else the last user turn of 'messages')"
"""``--column`` of every command that reads tables of prompts, which all read them alike."""


def runtime_config(args: argparse.Namespace, cls: type) -> Any:
    """The ``--device`` / ``--dtype`` flags given to a command, as a ``cls`` config (defaults for the others)."""
    from ..core.settings import build_config, settings_from_args

    return build_config(cls, settings_from_args(args, group=RUNTIME), source="hf-lsad --device / --dtype")


def guard_location(args: argparse.Namespace) -> dict[str, str]:
    """``revision`` / ``subfolder`` keyword arguments of ``SafetyGuard.from_pretrained`` for ``--guard``."""
    location = {"revision": getattr(args, "revision", None), "subfolder": getattr(args, "subfolder", "")}
    return {key: value for key, value in location.items() if value}


def store_folder(out: str, read: tuple[int, str], n_reads: int) -> str:
    """Where ``hf-lsad collect`` writes the store of one ``(layer, position)`` read: ``--out`` itself for a
    single read, ``<out>/layer<L>-<position>`` for several."""
    layer, position = read
    return out if n_reads == 1 else f"{out}/layer{layer}-{position}"


DATASET_FLAGS = ("category", "split", "column", "subset")
"""``collect`` arguments that only a dataset pool (not a bundled one) takes."""


def dataset_options(args: argparse.Namespace) -> dict[str, str]:
    """``load_hub_prompts`` keyword arguments of a dataset ``--pool``."""
    return dict(
        category=args.category, split=args.split or "train", text_field=args.column or "prompt", name=args.subset
    )


def _runtime_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    from ..core.settings import add_config_arguments

    add_config_arguments(parser, cls, title=f"device and precision ({cls.__name__})", group=RUNTIME)


def _guard_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    kwargs = {"required": True} if required else {"default": "default"}
    parser.add_argument(
        "--guard",
        **kwargs,
        help="guard folder or Hub repo; 'default': the bundled two-headed guard, 'paper': the paper's head alone",
    )
    parser.add_argument("--revision", help="Hub branch, tag or commit of --guard (default: main)")
    parser.add_argument("--subfolder", default="", help="folder of the guard inside --guard (several guards per repo)")


def _explain_argument(parser: argparse.ArgumentParser, does: str) -> None:
    """``--explain K``: the prompt tokens behind each verdict a supervised head decided (``generate``, ``screen``,
    ``serve``)."""
    parser.add_argument(
        "--explain",
        type=int,
        default=0,
        metavar="K",
        help=f"for each verdict a supervised head decided, {does} the K prompt tokens behind it (default: 0, none)",
    )


def model_argument(parser: argparse.ArgumentParser, mode: str = "") -> None:
    """``--model``: what :func:`hf_lsad.capture.pretrained.load_model` takes."""
    parser.add_argument(
        "--model",
        default="default",
        help=f"{mode}Hub id, model folder, .gguf file or peft adapter (on its base model), or 'default' (bundled "
        "SmolLM2)",
    )


def model_mismatch_arguments(parser: argparse.ArgumentParser) -> None:
    """``--allow-adapter-mismatch`` and ``--allow-score-shift``: guard a model that differs from the one the guard's
    thresholds were set through (:func:`hf_lsad.capture.adapters.check_adapter`,
    :func:`hf_lsad.guard.fingerprint.check_fingerprint`)."""
    parser.add_argument(
        "--allow-adapter-mismatch",
        action="store_true",
        help="guard a model that runs another peft adapter than the guard's thresholds were set through (or none "
        "where they were set through one), with a warning; refused otherwise, since an adapter moves the scores: "
        "re-set the thresholds through it with set-budget",
    )
    parser.add_argument(
        "--allow-score-shift",
        action="store_true",
        help="guard a model on which the guard's heads score its probe prompts otherwise than on the model its "
        "thresholds were set through (a fine-tune, a merged adapter, another quantisation), with a warning; refused "
        "otherwise: re-set the thresholds through it with set-budget",
    )


def mismatch_allowances(args: argparse.Namespace) -> dict[str, bool]:
    """The ``allow_*`` keywords of :class:`~hf_lsad.generation.model.GuardedModelForCausalLM` that
    :func:`model_mismatch_arguments` set (``False`` for a command without them)."""
    return {
        "allow_adapter_mismatch": getattr(args, "allow_adapter_mismatch", False),
        "allow_score_shift": getattr(args, "allow_score_shift", False),
    }


def collect_arguments(parser: argparse.ArgumentParser) -> None:
    from ..data import POOLS

    model_argument(parser)
    parser.add_argument(
        "--pool", required=True, help=f"bundled pool ({', '.join(POOLS)}), or a datasets name or local dataset folder"
    )
    hub = parser.add_argument_group("dataset pools (a --pool that is not bundled: datasets.load_dataset)")
    hub.add_argument("--category", help="category of every prompt (safe, harmful, ...): required for a dataset pool")
    hub.add_argument("--split", help="split to read (default: train)")
    hub.add_argument(
        "--column",
        "--text-field",  # its name before every command took --column
        dest="column",
        help="column holding the prompt text, as in screen and set-budget (default: prompt)",
    )
    hub.add_argument("--subset", help="dataset configuration (load_dataset's name=)")
    parser.add_argument("--limit", type=int, default=None, help="seeded random subset of this many prompts")
    parser.add_argument(
        "--layer",
        type=int,
        nargs="+",
        default=[20],
        help="decoder block(s) whose output is read (0-based; -1: the last); several: one store each, one pass",
    )
    parser.add_argument(
        "--position",
        choices=POSITIONS,
        nargs="+",
        default=["response_last"],
        help="token(s) whose activation is kept; several layers or positions need prompt positions only",
    )
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per forward pass")
    parser.add_argument(
        "--max-batch-tokens",
        type=_batch_tokens,
        default=None,
        help="padded prompt tokens a forward pass holds at most, prompts batched in order of their length in tokens "
        "(default: none, --batch-size prompts in order of their length in characters, as the bundled stores were made)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="response length for response positions")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --limit subset")
    parser.add_argument("--out", required=True, help="activation store folder to write")
    _runtime_arguments(parser, ModelRuntime)


def train_sae_arguments(parser: argparse.ArgumentParser) -> None:
    from ..sae.training import SAETrainConfig

    parser.add_argument("--activations", required=True, help="safe activation store (its fit split trains the SAE)")
    parser.add_argument("--d-sae", type=int, default=2304, help="dictionary features of the SAE")
    parser.add_argument("--l1", type=float, default=SAETrainConfig.l1_coefficient, help="L1 coefficient on the codes")
    parser.add_argument("--lr", type=float, default=SAETrainConfig.lr, help="Adam learning rate")
    parser.add_argument("--batch-size", type=int, default=SAETrainConfig.batch_size, help="activations per step")
    parser.add_argument("--epochs", type=int, default=SAETrainConfig.epochs, help="passes over the fit split")
    parser.add_argument("--holdout-fraction", type=float, default=0.2, help="safe rows held out (not trained on)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split and the initialisation")
    parser.add_argument("--out", required=True, help="SAE folder to write")
    _runtime_arguments(parser, FitRuntime)


def fit_arguments(parser: argparse.ArgumentParser, method: str, default_method: str) -> None:
    from ..core.settings import add_config_arguments
    from ..detectors import DETECTORS, detector_class

    cls = detector_class(method)
    parser.add_argument("--activations", required=True, help="safe activation store")
    parser.add_argument(
        "--sae",
        help="SAE folder or Hub repo: hf-lsad, SAELens, sparsify or Gemma Scope layout (methods that read SAE codes)",
    )
    parser.add_argument("--sae-revision", help="Hub branch, tag or commit of --sae (default: main)")
    parser.add_argument("--sae-subfolder", default="", help="folder of the SAE inside --sae (e.g. layers.20)")
    parser.add_argument(
        "--method", choices=sorted(DETECTORS), default=default_method, help="registered detector method"
    )
    parser.add_argument("--unsafe", nargs="+", help="unsafe stores: training positives of a SUPERVISED method only")
    parser.add_argument("--target-fpr", type=float, default=0.05, help="safe FPR the threshold is set at")
    parser.add_argument("--holdout-fraction", type=float, default=0.2, help="safe rows held out for the threshold")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the fit / held-out split")
    parser.add_argument("--out", required=True, help="guard folder to write")
    parser.add_argument(
        "--push-to-hub", metavar="REPO", help="also push the guard, with a model card, to this Hub repo"
    )
    parser.add_argument("--subfolder", default="", help="folder of the guard in the Hub repo (several guards per repo)")
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=(
            "any config field, dotted for nested ones (kmeans.n_clusters=25); values are JSON; "
            "repeatable, none by default"
        ),
    )
    _runtime_arguments(parser, GuardFitRuntime)
    add_config_arguments(
        parser, cls.config_class, title=f"{method} settings ({cls.config_class.__name__}, API defaults)"
    )


def calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    _guard_arguments(parser, required=True)
    parser.add_argument("--safe", required=True, help="the guard's safe store (half its held-out split is drawn)")
    parser.add_argument("--unsafe", required=True, nargs="+", help="unsafe stores (pooled; --budget of them drawn)")
    parser.add_argument("--benign-ood", required=True, help="benign out-of-distribution store (--budget drawn)")
    parser.add_argument("--budget", type=float, default=0.01, help="coupled budget p")
    parser.add_argument("--probability-threshold", type=float, default=0.5, help="flag rows above this probability")
    parser.add_argument("--seed", type=int, default=0, help="seed of the labelled draw")
    parser.add_argument("--out", required=True, help="calibrated guard folder to write")


def evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    from ..sae.training import SAETrainConfig

    parser.add_argument("--guard", help="a fitted guard: evaluate it alone (the simple mode)")
    parser.add_argument("--revision", help="Hub branch, tag or commit of --guard (default: main)")
    parser.add_argument("--subfolder", default="", help="folder of the guard inside --guard")
    parser.add_argument("--safe", help="safe store (guard mode: the store the guard was fitted on)")
    parser.add_argument("--unsafe", nargs="+", help="unsafe stores; the folder name is the category")
    parser.add_argument(
        "--benign-ood", help="benign out-of-distribution store: its flag rate (guard mode), test negatives (grid mode)"
    )
    parser.add_argument("--grid", help="grid mode: grid JSON file (hf_lsad.evaluation.GridConfig fields)")
    parser.add_argument("--seeds", type=int, nargs="+", help="grid mode: override the grid's seeds")
    parser.add_argument("--sae", help="grid mode: SAE folder; trained on the safe fit split and saved there if absent")
    parser.add_argument("--d-sae", type=int, default=2304, help="width of an SAE trained here")
    parser.add_argument("--sae-l1", type=float, default=SAETrainConfig.l1_coefficient, help="L1 of an SAE trained here")
    parser.add_argument("--sae-epochs", type=int, default=SAETrainConfig.epochs, help="epochs of an SAE trained here")
    parser.add_argument("--sae-seed", type=int, default=0, help="seed of an SAE trained here")
    parser.add_argument(
        "--benign-prompts",
        nargs="+",
        metavar="NAME=SOURCE",
        help="prompt mode (with --guard): benign prompt tables (a file or dataset, as hf-lsad screen reads), screened "
        "through --model; their flag rates are the false-positive rates",
    )
    parser.add_argument(
        "--unsafe-prompts", nargs="+", metavar="NAME=SOURCE", help="prompt mode: unsafe prompt tables, one per source"
    )
    parser.add_argument("--column", default=DEFAULT_COLUMN, help=f"prompt mode: {PROMPT_COLUMN_HELP}, in every table")
    parser.add_argument("--limit", type=int, help="prompt mode: the first LIMIT rows of each table")
    model_argument(parser, "prompt mode: ")
    model_mismatch_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=16, help="prompt mode: prompts per forward pass")
    system_argument(parser, "prompt mode: ")
    parser.add_argument(
        "--out", help="grid mode: report folder; prompt mode: metrics.json, ROC and score pictures, report.html"
    )
    parser.add_argument("--title", default="hf-lsad evaluation", help="grid mode: report title")
    parser.add_argument("--command-line", help="grid mode: the command recorded in the report (default: this one)")
    _runtime_arguments(parser, ModelRuntime)


def generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", help="prompts, each sent as a user turn of the chat template")
    model_argument(parser)
    model_mismatch_arguments(parser)
    _guard_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="response length")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy decoding; above 0: sampling from the whole distribution at this temperature",
    )
    parser.add_argument(
        "--top-p", type=float, help="with --temperature: sample from the fewest tokens holding this much probability"
    )
    parser.add_argument("--seed", type=int, help="with --temperature: seed of the draws (default: unseeded)")
    parser.add_argument(
        "--on-flag",
        choices=["stop", "report"],
        help="stop: end a flagged row (a prompt_last guard screens it before its first token, a running guard stops "
        "it where it is flagged); report: generate as the plain model and report (default: stop when the guard can, "
        "else report)",
    )
    parser.add_argument("--refusal", default="", help="what a stopped row says instead (default: nothing, EOS only)")
    system_argument(parser)
    _explain_argument(parser, "print")
    _runtime_arguments(parser, ModelRuntime)


def explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", help="prompts to explain, each sent as a user turn of the chat template")
    _guard_arguments(parser)
    parser.add_argument(
        "--activations",
        help="activation store (of the anomaly head's read) whose prompts illustrate each of its SAE features "
        "(default: none, the features alone)",
    )
    model_argument(parser)
    model_mismatch_arguments(parser)
    parser.add_argument("--top-k", type=int, default=10, help="features or tokens listed per prompt")
    parser.add_argument("--examples", type=int, default=3, help="store prompts shown per feature")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="for guards that read the response")
    system_argument(parser)
    _runtime_arguments(parser, ModelRuntime)


def add_head_arguments(parser: argparse.ArgumentParser) -> None:
    from ..guard.heads.training import NEW_HEAD_SHARE, NEW_HEAD_SHARE_BESIDE_ANOMALY

    _guard_arguments(parser)
    parser.add_argument("--name", required=True, help="the head's name (letters, digits, '-', '_')")
    parser.add_argument("--unsafe", required=True, help=f"prompts of the category: {PROMPT_FILE}")
    parser.add_argument(
        "--safe", help=f"your own benign prompts, fitted on beside the bundled benign pools: {PROMPT_FILE}"
    )
    parser.add_argument("--column", default=DEFAULT_COLUMN, help=PROMPT_COLUMN_HELP)
    parser.add_argument(
        "--share",
        type=float,
        help=f"the new head's share of the FPR budget (default: {NEW_HEAD_SHARE:g} beside supervised heads, "
        f"{NEW_HEAD_SHARE_BESIDE_ANOMALY:g} beside the anomaly head alone)",
    )
    parser.add_argument(
        "--safe-weight",
        type=float,
        help="the share of the benign weight your --safe prompts carry together, in (0, 1) (default: as much as one "
        "bundled benign pool, a fifth)",
    )
    parser.add_argument(
        "--out", help="where to write the guard with its new head (default: --guard itself, a local folder)"
    )
    model_argument(parser)
    parser.add_argument("--benign-per-pool", type=int, default=400, help="fit rows drawn from each bundled benign pool")
    parser.add_argument(
        "--threshold-rows", type=int, default=1000, help="validation chat rows the thresholds are set on"
    )
    _check_arguments(parser, chat=False)
    _cache_argument(parser)
    system_argument(parser)
    _budget_batch_arguments(parser)
    _runtime_arguments(parser, ModelRuntime)


def set_budget_arguments(parser: argparse.ArgumentParser) -> None:
    _budget_arguments(parser, benign_required=False)
    _check_arguments(parser, chat=True, chat_when="with --benign (without, the thresholds are set on that chat): ")
    _cache_argument(parser, kept="the bundled rows the checks read")
    system_argument(parser)


def system_argument(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """``--system``: the system turn a deployment puts before each user turn; verdicts depend on it."""
    parser.add_argument(
        "--system",
        help=f"{prefix}the system turn your deployment puts before each prompt (default: none, the chat template's "
        "own); a guard's thresholds hold for the system turn they were set under",
    )


def _budget_arguments(parser: argparse.ArgumentParser, *, benign_required: bool) -> None:
    _guard_arguments(parser)
    own = f"a sample of your own benign traffic, fitted on by no head: {PROMPT_FILE}"
    bundled = " (default: the bundled validation chat the released thresholds were set on, for a model that reads "
    bundled += "prompts otherwise, e.g. under a peft adapter)"
    parser.add_argument("--benign", required=benign_required, help=own if benign_required else own + bundled)
    parser.add_argument("--column", default=DEFAULT_COLUMN, help=PROMPT_COLUMN_HELP)
    parser.add_argument(
        "--target-fpr", type=float, help="the heads' combined flag rate on those prompts (default: the guard's)"
    )
    parser.add_argument(
        "--confidence",
        type=_confidence,
        default="keep",
        help="bound the rate on fresh traffic with this probability, or 'none' for the plain quantile "
        "(default: the guard's)",
    )
    parser.add_argument("--out", help="where to write the guard (default: --guard itself, a local folder)")
    parser.add_argument(
        "--keep-nearest",
        action="store_true",
        help="keep the --benign prompts nearest the thresholds, as token ids, in the guard folder, so that a model "
        "that moves them is refused; they travel with the folder wherever it is pushed (default: kept only for the "
        "bundled rows)",
    )
    parser.add_argument(
        "--keep-bundled",
        nargs="+",
        default=[],
        choices=KEEPABLE_POOLS,
        metavar="POOL",
        help="bundled benign pools whose validation rows the heads must also flag within the budget, each on its "
        "own, beside the --benign prompts: for a deployment that also serves that traffic, e.g. 'chat' (the rows the "
        f"released thresholds were set on); one or more of {', '.join(KEEPABLE_POOLS)} (default: none). Their "
        "activations are kept in --cache",
    )
    model_argument(parser)
    _budget_batch_arguments(parser)
    _runtime_arguments(parser, ModelRuntime)


def _budget_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """``--batch-size`` and ``--max-batch-tokens`` of the commands that batch a user's own prompts (fit heads or set
    thresholds on them, screen them): under a token budget by default."""
    from ..core.batching import BATCH_TOKENS

    parser.add_argument("--batch-size", type=int, default=16, help="prompts per forward pass, at most")
    parser.add_argument(
        "--max-batch-tokens",
        type=_batch_tokens,
        default=BATCH_TOKENS,
        help=f"padded tokens a forward pass holds at most, or 'none' for --batch-size prompts whatever their length "
        f"(default: {BATCH_TOKENS})",
    )


def teach_arguments(parser: argparse.ArgumentParser) -> None:
    _budget_arguments(parser, benign_required=True)
    parser.add_argument("--head", default="harm", help="the supervised head to fit again (default: harm)")
    parser.add_argument(
        "--fit-fraction",
        type=float,
        default=0.6,
        help="the share of the --benign prompts taught to the head; the rest set the thresholds (default: 0.6)",
    )
    parser.add_argument(
        "--pools",
        nargs="+",
        help="the bundled pools whose fit rows the head is fitted on again (default: those it was released with)",
    )
    parser.add_argument(
        "--rows-per-pool",
        type=int,
        help="fit rows drawn from each bundled pool (default: all of them, as the guard was released)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the cut and of --rows-per-pool's draw")
    _check_arguments(parser, chat=True)
    _cache_argument(parser)
    system_argument(parser)


def _check_arguments(parser: argparse.ArgumentParser, *, chat: bool, chat_when: str = "") -> None:
    """``--chat-check`` (with ``chat``; ``chat_when``: when it runs), ``--domain-check`` and ``--harm-check``: what a
    command that changed a guard did to ordinary chat, to the other kinds of benign traffic and to the bundled harm,
    read once the new guard is written."""
    if chat:
        parser.add_argument(
            "--chat-check",
            type=_row_count,
            default=CHAT_CHECK_ROWS,
            metavar="ROWS",
            help=f"{chat_when}once the guard is written, read this many bundled validation chat rows through the "
            "model and print the share the new guard flags beside the share the guard it came from flags, warning when "
            f"it is more than 1.5 times both that and the target; 0 skips it (default: {CHAT_CHECK_ROWS}; 41 s on a "
            "2-core CPU)",
        )
    domains = ", ".join(CHECK_DOMAINS.values())
    parser.add_argument(
        "--domain-check",
        type=_row_count,
        default=DOMAIN_CHECK_ROWS,
        metavar="ROWS",
        help=f"once the guard is written, read this many bundled validation rows of each kind of benign traffic "
        f"beside chat ({domains}) through the model and print the share of each the new guard flags beside the guard "
        "it came from, warning when one is more than 1.5 times both that and the target; 0 skips it (default: "
        f"{DOMAIN_CHECK_ROWS}; 25 s on a 2-core CPU)",
    )
    parser.add_argument(
        "--harm-check",
        type=_row_count,
        default=HARM_CHECK_ROWS,
        metavar="ROWS",
        help=f"once the guard is written, read this many bundled validation rows of each of the {len(EVAL_SOURCES)} "
        f"unsafe sources the evaluation holds out and of the {len(HARM_CHECK_POOLS)} other unsafe pools "
        f"({', '.join(HARM_CHECK_POOLS)}) through the model and print the share of each the new guard catches beside "
        "the guard it came from, warning when one falls by more than a fifth; 0 skips it (default: "
        f"{HARM_CHECK_ROWS}; about a minute on a 2-core CPU)",
    )


def _row_count(value: str) -> int:
    """``--chat-check``, ``--domain-check``, ``--harm-check``: a number of rows, 0 or more."""
    try:
        rows = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of rows, got {value!r}") from None
    if rows < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more rows, got {value!r}")
    return rows


def _cache_argument(parser: argparse.ArgumentParser, kept: str = "the bundled rows") -> None:
    parser.add_argument(
        "--cache",
        help=f"a folder that keeps the activations of {kept}: written as they are collected (an interrupted run "
        "resumes from it), read by later runs with the same model, reads and --system, one folder per system turn "
        "(default: collected every time, kept nowhere)",
    )


def _confidence(value: str) -> float | str | None:
    """``--confidence``: a probability, ``none`` (the plain quantile) or ``keep`` (the guard's, the default)."""
    if value in ("none", "keep"):
        return None if value == "none" else value
    try:
        confidence = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a probability in (0, 1) or 'none', got {value!r}") from None
    if not 0.0 < confidence < 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability in (0, 1) or 'none', got {value!r}")
    return confidence


def _batch_tokens(value: str) -> int | None:
    """``--max-batch-tokens``: a number of tokens, or ``none`` (no budget: ``--batch-size`` prompts a pass)."""
    if value == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'none', got {value!r}") from None


def push_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("guard_dir", help="the guard folder to upload ('default' or 'paper': a bundled guard)")
    parser.add_argument("repo_id", help="Hub repo, 'org/name' or 'name' (the token owner's namespace)")
    parser.add_argument("--revision", help="branch to push to (default: main; created if missing)")
    parser.add_argument("--subfolder", default="", help="folder of the repo for this guard (default: the root)")
    parser.add_argument("--private", action="store_true", help="create the repo private if it does not exist")
    parser.add_argument("--commit-message", default="Upload hf-lsad guard", help="the commit's summary")
    parser.add_argument("--token", help="Hub token (default: HF_TOKEN or the saved login, as huggingface_hub does)")


def pull_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo_id", help="Hub repo holding the guard")
    parser.add_argument("out", help="folder to write the guard to (must not exist, or be empty)")
    parser.add_argument("--revision", help="branch, tag or commit sha (default: main); pin a sha to reproduce")
    parser.add_argument("--subfolder", default="", help="folder of the guard inside the repo")
    parser.add_argument("--token", help="Hub token (default: HF_TOKEN or the saved login, as huggingface_hub does)")


def screen_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "input",
        help="a .jsonl, .json (an array or lines), .csv or .parquet file, a .txt file (one prompt per line), a saved "
        "dataset folder, or a dataset name datasets can load",
    )
    parser.add_argument("--out", required=True, help="JSON-lines file of verdicts; an existing one is resumed")
    parser.add_argument("--column", default=DEFAULT_COLUMN, help=PROMPT_COLUMN_HELP)
    parser.add_argument("--id-column", help="the column of unique row ids (default: the row's position)")
    parser.add_argument("--limit", type=int, help="screen only the first LIMIT rows")
    parser.add_argument("--split", default="train", help="the split of a datasets dataset")
    parser.add_argument("--raw", action="store_true", help="read prompts as they are, not as chat-template user turns")
    parser.add_argument(
        "--conversation",
        action="store_true",
        help="read each row's whole conversation ('messages', or --column: role/content turns ending with a user "
        "turn) as a chat server reads it, not its last user turn",
    )
    system_argument(parser)
    _explain_argument(parser, "write in a line's 'tokens'")
    parser.add_argument(
        "--with-prompt",
        action="store_true",
        help="write each row's prompt in its line ('prompt'), to read the rows flagged from --out alone: "
        "jq -r 'select(.flagged) | .prompt' OUT",
    )
    model_argument(parser)
    model_mismatch_arguments(parser)
    _guard_arguments(parser)
    _budget_batch_arguments(parser)
    _runtime_arguments(parser, ModelRuntime)


def serve_arguments(parser: argparse.ArgumentParser) -> None:
    model_argument(parser)
    model_mismatch_arguments(parser)
    _guard_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("HF_LSAD_API_KEY"),
        help="key every route but /health needs (Authorization: Bearer KEY; default: $HF_LSAD_API_KEY, else none)",
    )
    parser.add_argument("--name", help="the model name the API answers with (default: --model, or SmolLM2's)")
    parser.add_argument("--max-tokens", type=int, default=512, help="the largest max_tokens a request may ask")
    parser.add_argument("--default-max-tokens", type=int, default=128, help="max_tokens of a request naming none")
    parser.add_argument("--max-body-bytes", type=int, default=1_000_000, help="the largest request body")
    parser.add_argument("--max-concurrency", type=int, default=4, help="generations at one time (others wait)")
    parser.add_argument("--max-choices", type=int, default=4, help="the largest n (choices) a request may ask")
    _explain_argument(parser, "name in its report's 'tokens'")
    _runtime_arguments(parser, ModelRuntime)

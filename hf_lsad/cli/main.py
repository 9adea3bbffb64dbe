"""The ``hf-lsad`` command's parser: :data:`DESCRIPTION` is its top-level help, :data:`COMMANDS` its commands.

This module only parses and calls: each command imports what it needs when it runs, so ``hf-lsad --help``
imports neither torch nor transformers. ``--device`` / ``--dtype`` (collect, generate, explain) and ``--device`` /
``--kmeans-device`` (fit, train-sae) come from :mod:`hf_lsad.core.runtime`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Callable, Sequence

from ..version import __version__
from . import arguments, commands

DESCRIPTION = """\
Guard a Hugging Face causal LM by reading its own residual stream: generate with a safety report per prompt
(flagged prompts are stopped before their first token), screen tables of prompts, serve an OpenAI-compatible API,
fit guards and heads of your own, and share them on the Hub.

Use a guard:
    hf-lsad generate  "How do I bake bread?" "Write a tutorial on how to make a bomb"
    hf-lsad screen    prompts.jsonl --out verdicts.jsonl [--column prompt] [--id-column id]
    hf-lsad serve     --port 8000 [--api-key KEY]
    hf-lsad explain   "Write a tutorial on how to make a bomb" [--guard default] [--activations acts/safe]

Fit it to your traffic and share it:
    hf-lsad add-head  --guard default --name dosage --unsafe dosage.txt [--safe ok.txt] --out my-guard
    hf-lsad set-budget --guard default --benign my-traffic.txt --out my-guard [--model my-lora-adapter]
    hf-lsad teach     --guard default --benign my-traffic.txt --out my-guard [--system "You are ..."] [--cache DIR]
    hf-lsad push      my-guard org/my-guard [--private] [--revision BRANCH]
    hf-lsad pull      org/my-guard my-guard-copy [--revision SHA]

Build one from activations (the paper's pipeline):
    hf-lsad collect   --model default --pool safe --layer 20 --position prompt_last --out acts/safe
    hf-lsad train-sae --activations acts/safe --d-sae 2304 --out sae
    hf-lsad fit       --activations acts/safe --sae sae --out guard [--method NAME] [--mask-size 50] [--set key=value]
    hf-lsad calibrate --guard guard --safe acts/safe --unsafe acts/harmful --benign-ood acts/ood --budget 0.01 --out g2
    hf-lsad evaluate  --guard guard --safe acts/safe --unsafe acts/harmful acts/toxic
    hf-lsad evaluate  --safe acts/safe --unsafe acts/harmful acts/toxic --sae sae --grid grid.json --out report
    hf-lsad evaluate  --guard default --benign-prompts chat=chat.jsonl --unsafe-prompts harm=harm.jsonl --out report
    hf-lsad collect   --pool tatsu-lab/alpaca --category safe --column instruction --layer 20 --out acts/alpaca
    accelerate launch --num_processes 4 -m hf_lsad.cli collect --pool safe --layer 20 --out acts/safe

"hf-lsad COMMAND --help" lists a command's options with their defaults. "hf-lsad fit --method NAME --help" lists
the settings of any registered method, one flag per config field (the API's defaults), and --set key=value sets any.
Every --guard also takes --revision and --subfolder.
"""

DEFAULT_METHOD = "freqmask-km"


COMMANDS: dict[str, tuple[str, Callable[..., None], Callable[[argparse.Namespace], None], str]] = {
    "collect": (
        "collect residual-stream activations of a prompt pool",
        arguments.collect_arguments,
        commands.run_collect,
        "Under accelerate launch (or torchrun) each process collects a contiguous shard of the prompts on its own "
        "device and process 0 merges the shards, in prompt order, into one store (hf_lsad.capture.sharded).",
    ),
    "train-sae": (
        "train a ReLU+L1 SAE on the fit split of safe activations",
        arguments.train_sae_arguments,
        commands.run_train_sae,
        "",
    ),
    "fit": (
        "fit a guard of any registered method on safe activations",
        arguments.fit_arguments,
        commands.run_fit,
        "",
    ),
    "calibrate": (
        "per-cluster affine calibration from a small labelled budget",
        arguments.calibrate_arguments,
        commands.run_calibrate,
        "",
    ),
    "evaluate": (
        "evaluate one guard (--guard), or run a method grid and write a report folder (--out)",
        arguments.evaluate_arguments,
        commands.run_evaluate,
        "With --guard and prompt tables (--benign-prompts / --unsafe-prompts NAME=SOURCE): screen each through "
        "--model and report every head's flag rate and AUROC per source; with --out, ROC curves and score "
        "histograms per head (PNG) and one self-contained report.html (hf_lsad.evaluation.prompts, .plots). "
        "With --guard and stores: AUROC, TPR@5%FPR and flag rate of that guard against unsafe stores. "
        "Without: fit every method of a grid (--grid JSON, default hf_lsad.evaluation.default_grid) on the safe "
        "store's fit split, select hyperparameters on its validation split, and write report.md + results.json to "
        "--out "
        "(protocol in hf_lsad.evaluation.protocol).",
    ),
    "generate": (
        "guarded generation with a safety report per prompt",
        arguments.generate_arguments,
        commands.run_generate,
        "",
    ),
    "explain": (
        "what is behind each verdict: the prompt tokens behind a supervised head's score, the SAE features behind "
        "the anomaly head's (each with the store prompts that activate it most)",
        arguments.explain_arguments,
        commands.run_explain,
        "",
    ),
    "add-head": (
        "add a supervised head for your own category of prompts to a guard",
        arguments.add_head_arguments,
        commands.run_add_head,
        "Fits a logistic head on the --unsafe prompts (one per line, or a table's --column; about 100) "
        "against --safe (optional) and the fit rows of the bundled benign pools, then sets every head's threshold "
        "again on validation chat so that together they keep the guard's false-positive budget, the new head "
        "taking --share of it (hf_lsad.guard.heads.training.add_head). With --system, every prompt is formatted "
        "under your deployment's system turn. The guard must read prompt_last. Once it is written, says what the "
        "new head did to the other kinds of benign traffic the pools hold and its share of the budget to the bundled "
        "harm the other heads catch (--domain-check, --harm-check).",
    ),
    "set-budget": (
        "set every head's threshold on a sample of your own benign traffic",
        arguments.set_budget_arguments,
        commands.run_set_budget,
        "Screens the --benign prompts (one per line, or a table's --column; a sample of your traffic "
        "that no head was fitted on) and sets every head's threshold so that together they flag at most "
        "--target-fpr of them, each head keeping its share of the budget and the budget its confidence unless "
        "--confidence says otherwise (hf_lsad.guard.heads.budget.fit_budget_on_prompts). For traffic the heads "
        "flag more often than chat: they were not fitted on its kind. Passes more of the harm the guard catches than "
        "teach, which also teaches a head part of the sample (docs/heads.md, 'Your own traffic'). Too few prompts for "
        "the confidence are refused (59 at 5% and 0.95). The guard must read the prompt. Without --benign, the "
        "bundled validation chat the released thresholds were set on: the released operating point again for a "
        "model that reads prompts otherwise, e.g. --model a peft adapter (refused by the guard until then). Once "
        "the guard is written, says what the new thresholds did to the bundled harm, to the other kinds of benign "
        "traffic the pools hold and, with --benign, to bundled chat (--harm-check, --domain-check, --chat-check). "
        "--keep-bundled holds the budget on bundled pools as well as on --benign, each on its own. --cache keeps the "
        "rows those checks and pools read.",
    ),
    "teach": (
        "teach a supervised head a sample of your own benign traffic, and set the thresholds on the rest",
        arguments.teach_arguments,
        commands.run_teach,
        "Cuts the --benign prompts (one per line, or a table's --column; a sample of your traffic that no "
        "head was fitted on) by a seeded permutation: --fit-fraction of them join --head's fit as one more benign "
        "source beside the bundled pools' fit rows (the head keeps its reads and settings), the rest set every "
        "head's threshold as set-budget does (hf_lsad.guard.heads.training.teach_traffic). Costs less of the harm "
        "the guard catches than set-budget alone. Collecting the bundled rows is a forward pass over about 15,600 "
        "prompts (--rows-per-pool draws fewer; --cache keeps them for the next teach). With --system, every prompt, "
        "bundled or yours, is formatted under your deployment's system turn, and the guard records it (a --cache "
        "holds one turn). Too few held-back prompts for the confidence are refused before the model loads (59 at 5% "
        "and 0.95); bring about a thousand prompts, since with fewer the guard moves with the sample (said before the "
        "model loads). Once the guard is written, says what teaching did to bundled chat, to the other kinds of benign "
        "traffic the pools hold and to the bundled harm (--chat-check, --domain-check, --harm-check). With "
        "--keep-bundled chat the thresholds hold the budget on the bundled chat as well as on the held-back prompts, "
        "each on its own: for a deployment that serves chat too.",
    ),
    "screen": (
        "screen a table of prompts (JSONL, CSV, Parquet, a dataset) into a JSON-lines file of verdicts",
        arguments.screen_arguments,
        commands.run_screen,
        "One verdict per row (id, flagged, the heads that decided, each head's score, probability, p-value, error), "
        "written as it goes, batched by length, no decoding: a forward pass cut after the deepest block the guard "
        "reads; each line also says how its prompt was read (model, adapters, dtype, system turn, chat template). "
        "Run it again on the same --out to finish an interrupted run: rows already there are skipped (an --out "
        "written at other thresholds or read otherwise is refused). Bad "
        "rows (empty, not text, without the prompt column or an id, longer than the context) become per-row errors "
        "(hf_lsad.generation.bulk). A table flagged more than twice as often as the guard's budget allows of benign "
        "traffic gets a note with the teach command for it.",
    ),
    "serve": (
        "serve the guarded model over an OpenAI-compatible HTTP API (needs: pip install 'hf-lsad[serve]')",
        arguments.serve_arguments,
        commands.run_serve,
        "Routes: POST /v1/chat/completions (stream or not), POST /v1/completions, POST /v1/moderations (a category per "
        "guard head), GET /v1/models, GET /health. Each completion carries the guard's report in 'safety'; a prompt "
        "or response the guard stops ends with finish_reason 'content_filter' (hf_lsad.serving.app).",
    ),
    "push": (
        "upload a guard folder to the Hub (the CLI twin of SafetyGuard.push_to_hub)",
        arguments.push_arguments,
        commands.run_push,
        "Loads the folder with every check first, then uploads it in one commit with its README.md model card (a "
        "generated card if the folder has none) and prints the commit sha to pin.",
    ),
    "pull": (
        "download a guard from the Hub into a folder (the CLI twin of SafetyGuard.from_pretrained)",
        arguments.pull_arguments,
        commands.run_pull,
        "Downloads the guard's files, loads them with every check, and copies them to OUT unchanged.",
    ),
}
"""name -> (help, add its arguments, run it, description)."""


def _requested(argv: Sequence[str]) -> tuple[str | None, str]:
    """The command named in ``argv`` and fit's ``--method`` (default :data:`DEFAULT_METHOD`).

    They decide which flags exist (a method's settings are generated from its config), so they are read
    before the command's parser is built; building only that parser keeps ``hf-lsad --help`` free of torch.
    """
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("command", nargs="?")
    first.add_argument("--method", default=DEFAULT_METHOD)
    known, _ = first.parse_known_args([a for a in argv if a not in ("-h", "--help", "--version", "--debug")])
    return (known.command if known.command in COMMANDS else None), known.method


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and ends every option's help with its default (when it has one)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text or not action.option_strings or default is None or default is False:
            return text
        if default == argparse.SUPPRESS or default == []:
            return text
        if default == "":
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


def build_parser(command: str | None = None, method: str = DEFAULT_METHOD) -> argparse.ArgumentParser:
    """The parser; only ``command``'s arguments are built (they may import the library), the others list their help."""
    parser = argparse.ArgumentParser(
        prog="hf-lsad", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (hf-lsad command only)")
    parser.add_argument("--version", action="version", version=f"hf-lsad {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (summary, add_arguments, run, description) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=description or summary, formatter_class=HelpFormatter)
        if name == command:
            add_arguments(sub, method, DEFAULT_METHOD) if name == "fit" else add_arguments(sub)
        sub.set_defaults(run=run)
    return parser


def parse(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser of the command ``argv`` names and the parsed arguments (usage errors exit with code 2)."""
    argv = list(argv)
    command, method = _requested(argv)
    if command is None:  # argparse would only say that a command is missing, not what was wrong
        unknown = [a for a in argv if a.startswith("-") and a not in ("-h", "--help", "--version", "--debug")]
        if unknown:
            build_parser().error(f"unrecognized argument {unknown[0]!r} (commands: {', '.join(COMMANDS)})")
    if command == "fit":
        from ..detectors import DETECTORS

        if method not in DETECTORS:
            raise SystemExit(f"unknown detector method {method!r}; registered: {sorted(DETECTORS)}")
    parser = build_parser(command, method)
    args = parser.parse_args(argv)
    return command_parser(parser, args.command), args


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of ``command`` within ``parser``: its usage errors name the command and show the command's usage,
    as argparse's own errors of the command's arguments do."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


NOT_KEPT = (
    "the activations of the bundled rows collected so far were not kept: pass --cache DIR to keep them as they are "
    "collected, and the same --cache again to resume"
)
"""What an interrupted ``add-head``, ``set-budget`` or ``teach`` run without ``--cache`` says: it lost minutes of
forward passes (a ``teach`` of a thousand prompts takes about 20 minutes on a 2-core CPU) that ``--cache`` keeps."""


def main(argv: Sequence[str] | None = None) -> None:
    """Run a command from Python: parse and call, exceptions propagate (:func:`entry` is the shell's)."""
    _, args = parse(sys.argv[1:] if argv is None else argv)
    _run(args)


def _run(args: argparse.Namespace) -> None:
    """Run the parsed command; one that keeps the bundled rows in a ``--cache`` holds it from start to end, so that
    another run on it is refused at its start rather than between two collections of this one
    (:func:`~hf_lsad.guard.heads.bundled.held_cache`)."""
    cache = getattr(args, "cache", None)
    if cache is None:
        args.run(args)
        return
    from ..guard.heads.bundled import held_cache

    with held_cache(pathlib.Path(cache)):
        args.run(args)


def entry(argv: Sequence[str] | None = None) -> None:
    """The ``hf-lsad`` command: arguments checked before any model is loaded, one-line errors (exit 2 for usage,
    1 for failures), ``--debug`` for the traceback (:mod:`hf_lsad.cli.checks`)."""
    from .checks import PROG, check_args, run

    def checked(args: Sequence[str]) -> None:
        parser, namespace = parse(args)
        check_args(parser, namespace)
        try:
            _run(namespace)
        except KeyboardInterrupt:
            if getattr(namespace, "cache", False) is None:  # a command that could have kept its bundled rows
                print(f"{PROG}: {NOT_KEPT}", file=sys.stderr)
            raise

    run(checked, argv)

"""The ``hf-lsad`` command's contract with its user: arguments checked before any model is loaded, one-line errors.

- :func:`check_args` runs right after parsing: numeric ranges, input folders and files,
  the guard (loaded and verified: a few milliseconds), and for ``collect`` the layer
  against the model's config (read without the weights). A bad argument is a usage
  error: ``hf-lsad: error: ...`` and exit code 2, in seconds, not after a 30 s model load.
- :func:`run` wraps a command: any failure prints ``hf-lsad: error: <message>`` (one line)
  and exits with code 1, and a warning prints as one line too (``hf-lsad: warning: UserWarning: <message>``);
  ``--debug`` (anywhere on the command line) shows the traceback and Python's own warnings instead.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..core.validation import HALF_OPEN_UNIT, NON_NEGATIVE, OPEN_UNIT, POSITIVE, Range

PROG = "hf-lsad"
OUT_FOLDERS = {
    "fit": "guard",
    "calibrate": "guard",
    "add-head": "guard with card",
    "set-budget": "guard with card",
    "teach": "guard with card",
    "train-sae": "sae",
}
"""Commands that write a folder to ``--out``, and what they write there (a guard's model card is its
``README.md``)."""


def _flag_rules() -> dict[str, tuple[type, str] | Range]:
    """Each numeric flag -> the config field whose declared range it obeys, or the range of a flag no config holds."""
    from ..guard.calibration import AffineCalibration
    from ..guard.types import GuardConfig
    from ..sae import SAEConfig, SAETrainConfig

    return {
        "d_sae": (SAEConfig, "d_sae"),
        "l1": (SAETrainConfig, "l1_coefficient"),
        "sae_l1": (SAETrainConfig, "l1_coefficient"),
        "lr": (SAETrainConfig, "lr"),
        "epochs": (SAETrainConfig, "epochs"),
        "sae_epochs": (SAETrainConfig, "epochs"),
        "target_fpr": (GuardConfig, "target_fpr"),
        "probability_threshold": (AffineCalibration, "threshold"),
        # options of a command, not of a saved config
        "limit": POSITIVE,
        "batch_size": POSITIVE,
        "max_batch_tokens": POSITIVE,
        "max_new_tokens": POSITIVE,
        "temperature": NON_NEGATIVE,
        "top_p": HALF_OPEN_UNIT,
        "top_k": POSITIVE,
        "examples": POSITIVE,
        "explain": NON_NEGATIVE,
        "holdout_fraction": OPEN_UNIT,
        "budget": HALF_OPEN_UNIT,
        "share": OPEN_UNIT,
        "safe_weight": OPEN_UNIT,
        "port": Range(low=1, high=65535, expected="a port number (1-65535)"),
        "max_tokens": POSITIVE,
        "default_max_tokens": POSITIVE,
        "max_body_bytes": POSITIVE,
        "max_concurrency": POSITIVE,
        "max_choices": POSITIVE,
        "benign_per_pool": POSITIVE,
        "threshold_rows": POSITIVE,
        "rows_per_pool": POSITIVE,
        "fit_fraction": OPEN_UNIT,
    }


# arguments naming activation stores that must exist, per command
_STORES = {
    "train-sae": ["activations"],
    "fit": ["activations"],
    "calibrate": ["safe", "unsafe", "benign_ood"],
    "evaluate": ["safe", "unsafe", "benign_ood"],
    "explain": ["activations"],
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (``parser.error``: exit code 2) for arguments that cannot work, before any model is loaded."""
    from ..core.validation import field_range

    _check_not_empty(parser, args)
    _check_not_a_stream(parser, args)
    for name, rule in _flag_rules().items():
        bounds = field_range(*rule) if isinstance(rule, tuple) else rule
        value = getattr(args, name, None)
        if value is not None and bounds is not None and not bounds.holds(value):
            parser.error(f"argument {_flag(name)}: {value!r} is not {bounds.expected}")
    for name in _STORES.get(args.command, []):
        values = getattr(args, name, None)
        for value in values if isinstance(values, list) else [values] if values else []:
            if not Path(value).is_dir():
                parser.error(f"argument {_flag(name)}: no activation store folder {value!r}")
    if getattr(args, "model", None) is not None:
        _check_model(parser, args.model)
    out = getattr(args, "out", None)  # a folder to write; screen's is a file of verdicts, pull's is checked below
    if args.command not in ("screen", "pull") and out is not None and Path(out).exists() and not Path(out).is_dir():
        parser.error(f"argument --out: {out!r} is a file, not a folder")
    if args.command == "fit" and getattr(args, "sae", None):
        _check_sae(parser, args.sae, args.sae_subfolder)
    if getattr(args, "system", None) is not None:
        if not args.system.strip():
            parser.error("argument --system: empty; leave it out for the chat template's own system turn")
        from ..core.text import unencodable

        why = unencodable(args.system)  # bytes that are not UTF-8 in the argument
        if why:
            parser.error(f"argument --system: {why}")
        if getattr(args, "raw", False):
            parser.error("argument --system: a system turn is part of the chat template, which --raw leaves out")
        if args.command == "evaluate" and not (args.benign_prompts or args.unsafe_prompts):
            parser.error("argument --system: prompt mode only; an activation store's prompts were formatted already")
    if getattr(args, "conversation", False) and args.raw:
        parser.error("argument --conversation: a conversation is read under the chat template, which --raw leaves out")
    if args.command == "generate" and args.refusal and args.on_flag == "report":
        parser.error("argument --refusal: what a stopped row says, and --on-flag report stops no row")
    if args.command == "generate" and args.temperature == 0:
        given = [flag for flag, value in (("--top-p", args.top_p), ("--seed", args.seed)) if value is not None]
        if given:
            parser.error(
                f"argument {given[0]}: shapes sampling, which needs --temperature above 0 (0 decodes greedily)"
            )
    if args.command in ("generate", "explain"):
        from ..capture.collect import check_prompts

        try:
            check_prompts(args.prompts)
        except (TypeError, ValueError) as err:
            parser.error(f"argument prompts: {_one_line(err)}")
    cache = getattr(args, "cache", None)  # a cache of the bundled rows: teach, add-head, set-budget
    if cache is not None and Path(cache).exists() and not Path(cache).is_dir():
        parser.error(f"argument --cache: {cache!r} is a file, not a folder")
    if cache is not None and Path(cache).is_dir():
        from ..guard.heads.bundled import cache_in_use, check_cache_turn

        _check_not_held(parser, "--cache", Path(cache), cache_in_use(Path(cache)))
        try:
            check_cache_turn(cache, args.system)
        except ValueError as err:  # another turn, or a store that cannot be read
            parser.error(f"argument --cache: {_one_line(err)}")
    if getattr(args, "guard", None):  # first: the checks below read the guard
        _check_guard(parser, args.guard, getattr(args, "subfolder", "") if args.command != "fit" else "")
    if args.command == "add-head":
        _check_add_head(parser, args)
    if args.command in ("set-budget", "teach"):
        _check_set_budget(parser, args)
    if args.command == "screen" and not Path(args.input).exists() and Path(args.input).suffix:
        parser.error(f"argument input: no file {args.input!r}")
    if args.command == "collect":
        from ..capture.resumable import PARTIAL
        from .commands import collect_in_use

        # a run of one process holds its parts' folder (one of several, each its own)
        _check_not_held(parser, "--out", Path(args.out) / PARTIAL, collect_in_use(args.out))
    if args.command == "screen" and Path(args.out).is_dir():
        parser.error(f"argument --out: {args.out!r} is a folder; --out is the JSON-lines file of verdicts")
    if args.command == "screen":
        from ..generation.bulk import output_in_use, verdict_lines

        out = Path(args.out)
        if out.exists() and Path(args.input).exists() and out.samefile(args.input):
            parser.error(f"argument --out: {args.out!r} is the input table; --out is a JSON-lines file of verdicts")
        _check_not_held(parser, "--out", out, output_in_use(out))
        try:
            verdict_lines(out)  # a run resumes into it: a file of something else is refused, and left as it was
        except ValueError as err:
            parser.error(f"argument --out: {_one_line(err)}")
    if args.command == "evaluate":
        _check_evaluate(parser, args)
    if args.command == "serve":
        import importlib.util

        missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
        if missing:
            parser.error(f"serve needs {' and '.join(missing)}, which are not installed: pip install 'hf-lsad[serve]'")
        _check_listen_address(parser, args.host, args.port)
    if args.command == "push" and args.guard_dir not in ("default", "paper"):
        if not (Path(args.guard_dir) / "config.json").is_file():
            parser.error(f"argument guard_dir: {args.guard_dir!r} is not a guard folder (no config.json)")
    if args.command == "pull" and Path(args.out).exists():
        from ..core.serialization import STAGING_PREFIX

        # what a killed pull left (a staging folder) is no reason to refuse the pull that follows it
        out = Path(args.out)
        if not out.is_dir() or any(not entry.name.startswith(STAGING_PREFIX) for entry in out.iterdir()):
            parser.error(f"argument out: {args.out!r} exists and is not an empty folder")
    if args.command in OUT_FOLDERS and getattr(args, "out", None):
        from ..guard.files import check_guard_destination
        from ..sae.model import check_sae_destination

        kind = OUT_FOLDERS[args.command]
        try:  # before any work, which would be lost
            if kind == "sae":
                check_sae_destination(Path(args.out))
            else:
                check_guard_destination(Path(args.out), with_card=kind == "guard with card")
        except FileExistsError as err:
            parser.error(f"argument --out: {err}")
    if getattr(args, "grid", None) and not Path(args.grid).is_file():
        parser.error(f"argument --grid: no file {args.grid!r}")
    device = getattr(args, "runtime:device", None)
    if device is not None:
        from ..core.runtime import check_device

        try:
            check_device(device)
        except ValueError as err:
            parser.error(f"argument --device: {_one_line(err)}")
    if getattr(args, "runtime:kmeans_device", None) == "gpu":
        from ..detectors.clustering import kmeans_device

        try:
            kmeans_device("gpu")
        except RuntimeError as err:
            parser.error(f"argument --kmeans-device: {_one_line(err)}")
    if args.command == "collect":
        _check_pool(parser, args)
        _check_layers(parser, args.model, args.layer)
        _check_store_destination(parser, args)
        prompt_only = {"prompt_last", "prompt_mean"}
        if len(args.layer) * len(args.position) > 1 and not set(args.position) <= prompt_only:
            parser.error(
                "argument --position: several layers or positions are read from the prompt in one pass: "
                f"use {sorted(prompt_only)} only (response positions: one layer and position per run)"
            )


OWN_EMPTY_MESSAGES = ("prompts", "system")
"""Text arguments whose emptiness their own checks explain (each prompt by its position; the system turn)."""


def _check_not_empty(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A text argument given empty or blank is refused, but for those whose default is empty (``--subfolder``,
    ``--refusal``): an unset shell variable (``--out "$OUT"``) made a path of ``''``, the current folder, which
    ``collect`` filled with a store and ``generate --guard`` read for a guard after its model loaded."""
    for action in parser._actions:
        if action.dest in OWN_EMPTY_MESSAGES or action.default == "":
            continue
        value = getattr(args, action.dest, None)
        if any(isinstance(item, str) and not item.strip() for item in (value if isinstance(value, list) else [value])):
            parser.error(f"argument {_shown(action)}: empty")


PATH_ARGUMENTS = (
    "activations",
    "benign",
    "benign_ood",
    "benign_prompts",
    "cache",
    "grid",
    "guard",
    "guard_dir",
    "input",
    "model",
    "out",
    "safe",
    "sae",
    "unsafe",
    "unsafe_prompts",
)
"""The arguments that name a file, a folder or a Hub repo."""


def _check_not_a_stream(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``-``, the usual name of standard input or output, is refused where a file is named: ``screen --out -``
    wrote a file called ``-`` (a resumable file of verdicts, not a stream), and ``screen -`` loaded the model, then
    failed on ``-`` as a dataset name."""
    for action in parser._actions:
        value = getattr(args, action.dest, None) if action.dest in PATH_ARGUMENTS else None
        values = value if isinstance(value, list) else [value]
        if any(item == "-" or (isinstance(item, str) and item.endswith("=-")) for item in values):
            parser.error(
                f"argument {_shown(action)}: '-' (standard input or output) is not read or written here: name a file "
                "or folder"
            )


def _shown(action: argparse.Action) -> str:
    """An argument as its usage errors name it: its flags, or a positional argument's name."""
    return "/".join(action.option_strings) or action.dest


def _check_pool(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A bundled pool takes no dataset flags; a dataset pool needs ``--category``."""
    from ..data import POOL_CATEGORY, POOLS
    from .arguments import DATASET_FLAGS

    given = [_flag(name) for name in DATASET_FLAGS if getattr(args, name, None) is not None]
    if args.pool in POOLS and given:
        parser.error(
            f"argument {given[0]}: only for a dataset --pool; the bundled pool {args.pool!r} is "
            f"category {POOL_CATEGORY[args.pool]!r}"
        )
    if args.pool not in POOLS and not args.category:
        parser.error(
            f"argument --category: required for the dataset pool {args.pool!r} (e.g. safe, harmful); "
            f"bundled pools: {', '.join(POOLS)}"
        )


def _check_sae(parser: argparse.ArgumentParser, name: str, subfolder: str) -> None:
    """A local ``--sae`` folder must hold an SAE of a known layout; a Hub id is checked when it is downloaded."""
    from ..core.hub import looks_like_path

    folder = Path(name).expanduser()
    if not folder.is_dir():
        if folder.exists() or looks_like_path(name):
            parser.error(f"argument --sae: no SAE folder {name!r}")
        return
    from ..sae.formats import detect_sae_layout

    try:
        detect_sae_layout(folder / subfolder if subfolder else folder)
    except (ValueError, OSError) as err:
        parser.error(f"argument --sae: {_one_line(err)}")


def _check_guard(parser: argparse.ArgumentParser, name: str, subfolder: str) -> None:
    from ..core.hub import looks_like_path
    from ..guard.guard import SafetyGuard

    if name not in ("default", "paper") and not Path(name).expanduser().exists() and not looks_like_path(name):
        return  # a Hub repo id: checked when it is downloaded
    try:
        SafetyGuard.from_pretrained(name, **({"subfolder": subfolder} if subfolder else {}))
    except (ValueError, OSError) as err:
        parser.error(f"argument --guard: {_one_line(err)}")


def _check_listen_address(parser: argparse.ArgumentParser, host: str, port: int) -> None:
    """``serve``'s address, bound once and let go, as uvicorn binds it (``SO_REUSEADDR``): a host that names no
    address and a port another server listens on fail here, not after the model has loaded."""
    import errno
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as err:
        parser.error(f"argument --host: {host!r} names no address ({_one_line(err)})")
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRNOTAVAIL:
                parser.error(f"argument --host: {host!r} is not an address of this machine ({err.strerror})")
            held = "another server holds it: stop it, or " if err.errno == errno.EADDRINUSE else ""
            parser.error(f"argument --port: cannot listen on {host}:{port} ({err.strerror}); {held}choose another")


def _check_model(parser: argparse.ArgumentParser, model: str) -> None:
    """A ``--model`` that is a path must hold a model (:func:`~hf_lsad.capture.pretrained.check_model_path`); else the
    command would load for seconds and fail at the Hub with a message about repo ids."""
    from ..capture.pretrained import check_model_path

    try:
        check_model_path(model)
    except FileNotFoundError as err:
        parser.error(f"argument --model: {err}")


def _check_store_destination(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A store ``collect`` writes into ``--out`` itself (one layer and position) must not replace an ``index.json``
    of something else: found after the collection, the run's work would be lost. Several reads are written to
    folders of their own inside it (``layer<L>-<position>``)."""
    from ..data.store import check_store_destination

    if len(args.layer) * len(args.position) == 1:
        try:
            check_store_destination(Path(args.out))
        except FileExistsError as err:
            parser.error(f"argument --out: {err}")


def _check_layers(parser: argparse.ArgumentParser, model: str, layers: Sequence[int]) -> None:
    """The layers against the model's config, for a local model folder or GGUF file (the bundled model has 30
    layers), or a local peft adapter's base model. The depth is read once: for a GGUF file from its conversion if
    the cache holds one, else its header."""
    from ..capture.pretrained import DEFAULT_MODEL_ALIASES, adapter_base, is_gguf_path, model_location

    path = Path(model).expanduser()
    if (path / "adapter_config.json").is_file():
        try:
            base = adapter_base(str(path))
        except ValueError as err:
            parser.error(f"argument --model: {_one_line(err)}")
        if base is not None:
            _check_layers(parser, base, layers)
            return
    if model in DEFAULT_MODEL_ALIASES:
        n_layers: int = 30  # SmolLM2-135M-Instruct
    elif (path / "config.json").is_file() or (is_gguf_path(model) and path.is_file()):
        from transformers import AutoConfig

        from ..capture.gguf import cached_conversion

        folder, location = model_location(model)
        converted = cached_conversion(path) if is_gguf_path(model) else None  # its config.json: no header to parse
        if converted is not None:
            folder, location = str(converted), {}
        n_layers = AutoConfig.from_pretrained(folder, **location).get_text_config().num_hidden_layers
    else:
        return  # a Hub id (a local path that is no model is refused by _check_model): checked when downloaded
    for layer in layers:
        if not -n_layers <= layer < n_layers:
            parser.error(f"argument --layer: layer {layer} is out of range: {model} has {n_layers} decoder layers")


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


def _show_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    """A warning as one line of the command's output, like its errors (``--debug`` shows Python's own, with where it
    was raised)."""
    print(f"{PROG}: warning: {category.__name__}: {' '.join(str(message).split())}", file=file or sys.stderr)


def run(main: Callable[[Sequence[str]], None], argv: Sequence[str] | None = None) -> None:
    """Run ``main(argv)`` as the ``hf-lsad`` command (module docstring); ``--debug`` shows tracebacks."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if debug:
        main(argv)
        return
    try:
        try:
            with warnings.catch_warnings():
                warnings.showwarning = _show_warning
                main(argv)
        finally:
            sys.stdout.flush()  # what is still buffered (--help into a pipe) fails here, not as Python exits
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except SystemExit as exit_:
        if isinstance(exit_.code, str):  # raise SystemExit("message") in a command: a usage problem
            print(f"{PROG}: error: {_one_line(exit_)}", file=sys.stderr)
            raise SystemExit(2) from None
        raise
    except BrokenPipeError as err:
        if not _stdout_closed():  # a connection's, not the reader of our output's
            _fail(err)
        # the reader of the output went away (| head): stop quietly, as Python's documentation advises
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None
    except Exception as err:  # the one place that turns any failure into a one-line error
        _fail(err)


def _fail(err: Exception) -> NoReturn:
    """Say ``err`` in one line and exit 1."""
    name = type(err).__name__
    print(f"{PROG}: error: {name}: {_one_line(err)} (run with --debug for the traceback)", file=sys.stderr)
    raise SystemExit(1) from None


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone: polling its write end reports an error."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or no file behind sys.stdout
        return False
    return any(event & select.POLLERR for _, event in poller.poll(0))


def _check_not_held(parser: argparse.ArgumentParser, flag: str, path: Path, busy: str) -> None:
    """A usage error for ``flag`` while another run holds ``path`` (:func:`~hf_lsad.core.locking.check_not_held`):
    before a model loads."""
    from ..core.locking import check_not_held

    try:
        check_not_held(path, busy)
    except ValueError as err:
        parser.error(f"argument {flag}: {_one_line(err)}")


def _check_add_head(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The head's name, its prompt files (readable, not empty, both labels), where the guard goes, and whether
    adding the head sets thresholds set on the user's traffic again on bundled chat."""
    from ..guard.guard import SafetyGuard
    from ..guard.heads import check_head_name, check_name_free
    from ..guard.heads.training import MIN_UNSAFE, thresholds_reset_warning
    from .arguments import guard_location
    from .commands import read_prompt_file

    try:
        check_head_name(args.name)
    except ValueError as err:
        parser.error(f"argument --name: {_one_line(err)}")
    prompts = {}
    for flag in ("unsafe", "safe"):
        path = getattr(args, flag)
        if path is None:
            continue
        if not Path(path).is_file():
            parser.error(f"argument --{flag}: no file {path!r}")
        try:
            prompts[flag] = read_prompt_file(path, args.column)
        except (ValueError, UnicodeDecodeError) as err:
            parser.error(f"argument --{flag}: {_one_line(err)}")
        if not prompts[flag]:
            parser.error(f"argument --{flag}: {path!r} holds no prompts")
    if len(prompts["unsafe"]) < MIN_UNSAFE:
        parser.error(
            f"argument --unsafe: a head needs at least {MIN_UNSAFE} examples; {args.unsafe!r} has "
            f"{len(prompts['unsafe'])}"
        )
    if args.safe_weight is not None and not args.safe:
        parser.error("argument --safe-weight: weighs the --safe prompts; give them with --safe")
    both = set(prompts["unsafe"]) & set(prompts.get("safe", []))
    if both:
        parser.error(
            f"argument --safe: {len(both)} prompts are in --unsafe too (one class each), e.g. {sorted(both)[0]!r}"
        )
    if args.out is None and (args.guard in ("default", "paper") or not Path(args.guard).is_dir()):
        parser.error(
            "argument --out: needed unless --guard is a local guard folder (the bundled guards stay as shipped)"
        )
    guard = SafetyGuard.from_pretrained(args.guard, **guard_location(args))  # loaded and checked by _check_guard
    try:
        check_name_free(args.name, guard.head_names)
    except ValueError as err:
        parser.error(f"argument --name: {_one_line(err)}")
    reset = thresholds_reset_warning(guard.budget, args.name)
    if reset:  # said before the model loads, not after the head's fit
        print(f"warning: {reset}", file=sys.stderr)


def _check_set_budget(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The prompt file (readable, not empty, enough rows for the confidence: for ``teach``, in the part held back for
    the thresholds; ``set-budget`` without one takes the bundled validation chat), the head ``teach`` fits again, the
    pools kept within the budget, and where the guard goes."""
    from ..guard.guard import SafetyGuard
    from ..guard.heads.budget import (
        budget_rule,
        check_keep_bundled,
        check_reads_prompt,
        kept_pool_rows,
        taught_budget_warning,
    )
    from ..guard.heads.training import check_teachable, cut_traffic, reteach_warning, small_sample_warning
    from ..guard.threshold import allowed_flags
    from .arguments import guard_location
    from .commands import read_prompt_file

    if args.benign is None:  # set-budget on the bundled rows the released thresholds were set on
        from ..data.tables import DEFAULT_COLUMN
        from ..guard.heads.budget import released_threshold_prompts

        if args.column != DEFAULT_COLUMN:
            parser.error("argument --column: names the column of --benign's table; no --benign was given")
        prompts = released_threshold_prompts()
    else:
        if not Path(args.benign).is_file():
            parser.error(f"argument --benign: no file {args.benign!r}")
        try:
            prompts = read_prompt_file(args.benign, args.column)
        except (ValueError, UnicodeDecodeError) as err:
            parser.error(f"argument --benign: {_one_line(err)}")
        if not prompts:
            parser.error(f"argument --benign: {args.benign!r} holds no prompts")
    brought = len(prompts)
    if args.out is None and (args.guard in ("default", "paper") or not Path(args.guard).is_dir()):
        parser.error(
            "argument --out: needed unless --guard is a local guard folder (the bundled guards stay as shipped)"
        )
    guard = SafetyGuard.from_pretrained(args.guard, **guard_location(args))  # loaded and checked by _check_guard
    try:
        check_reads_prompt(guard)
    except ValueError as err:
        parser.error(f"argument --guard: {err}")
    if args.command == "teach":
        from ..data import POOL_CATEGORY

        unknown = sorted(set(args.pools or []) - set(POOL_CATEGORY))
        if unknown:
            parser.error(f"argument --pools: {unknown} are not bundled pools ({sorted(POOL_CATEGORY)})")
        if args.head not in guard.heads:
            parser.error(f"argument --head: the guard has no supervised head {args.head!r}; it has {guard.head_names}")
        try:
            check_teachable(guard.heads[args.head])
        except ValueError as err:
            parser.error(f"argument --head: {_one_line(err)}")
        try:
            _, prompts = cut_traffic(prompts, args.fit_fraction, args.seed)  # the thresholds' part
        except ValueError as err:
            parser.error(f"argument --fit-fraction: {_one_line(err)}")
    target_fpr, confidence = budget_rule(guard, args.target_fpr, args.confidence)
    try:
        allowed = allowed_flags(len(prompts), target_fpr, confidence)
    except ValueError as err:
        held_back = " held back for the thresholds" if args.command == "teach" else ""
        if args.benign is None:  # the bundled validation chat: what cannot be met is the rule, not the rows given
            chat = f"the bundled validation chat's {len(prompts)} prompts"
            asked = ["--target-fpr"] if args.target_fpr is not None else []
            asked += ["--confidence"] if args.confidence != "keep" else []
            where = f"argument {asked[0]}" if asked else "argument --guard: its own target and confidence"
            parser.error(f"{where}: {chat}: {_one_line(err)}")
        parser.error(f"argument --benign: {len(prompts)} prompts{held_back}: {_one_line(err)}")
    try:
        kept_pool_rows(
            check_keep_bundled(args.keep_bundled, own_prompts=args.benign is not None), target_fpr, confidence
        )
    except ValueError as err:
        parser.error(f"argument --keep-bundled: {_one_line(err)}")
    if args.command == "teach":  # said before the model loads, not after an hour's forward pass
        for warning in (small_sample_warning(brought, len(prompts), allowed), reteach_warning(guard.budget, args.head)):
            if warning:
                print(f"warning: {warning}", file=sys.stderr)
    else:
        taught = taught_budget_warning(guard.budget, own_prompts=args.benign is not None)
        if taught:
            print(f"warning: {taught}", file=sys.stderr)


def _check_evaluate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Store mode needs --safe and --unsafe; prompt mode --guard and NAME=SOURCE pairs of both kinds."""
    prompts = args.benign_prompts or args.unsafe_prompts
    if prompts:
        if not args.guard:
            parser.error("argument --benign-prompts/--unsafe-prompts: prompt mode evaluates a --guard")
        if not (args.benign_prompts and args.unsafe_prompts):
            parser.error("prompt mode needs both --benign-prompts and --unsafe-prompts")
        if args.safe or args.unsafe:
            parser.error("give prompt tables or activation stores (--safe/--unsafe), not both")
        names = []
        for flag in ("benign_prompts", "unsafe_prompts"):
            for item in getattr(args, flag):
                name, sep, source = item.partition("=")
                if not (sep and name and source):
                    parser.error(f"argument {_flag(flag)}: expected NAME=SOURCE, got {item!r}")
                names.append(name)
        if len(set(names)) != len(names):
            parser.error("argument --benign-prompts/--unsafe-prompts: every source needs its own NAME")
    elif not (args.safe and args.unsafe):
        parser.error(
            "the arguments --safe and --unsafe are required (or --guard with --benign-prompts/--unsafe-prompts)"
        )

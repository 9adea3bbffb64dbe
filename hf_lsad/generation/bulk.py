"""Screening a table of prompts into a JSON-lines file of verdicts, resumably: what ``hf-lsad screen`` runs.

Each verdict is written as soon as its batch is scored, so a run that is killed loses at most the batch in flight;
started again on the same output, it reads the ids already there (cutting off a line the kill left half written)
and screens only the rest. A run started on an output another run is still writing is refused. Rows are batched
in order of token length (little padding, so the forward pass costs what the prompts cost) and written in that
order; each line carries its row's id.

Bad rows become per-row errors, never a crash: an empty or non-text prompt, a row without the prompt column or an
id (found when the table is read), a prompt longer than the model's context, a batch that raises (its rows are
retried one by one).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
from tqdm.auto import tqdm

from ..capture.adapters import adapter_digest, adapter_label
from ..capture.collect import check_pad_token, conversation_token_ids, pad_left, prompt_token_ids
from ..capture.recorder import PROMPT_POSITIONS
from ..core.batching import BATCH_TOKENS, check_batching, length_batches
from ..core.locking import held_alone
from ..core.prompt_tokens import check_explain_count
from ..data.tables import PromptRow
from .model import GuardedModelForCausalLM

FLAGGED_OFTEN = 2.0
"""How many times the guard's target a table's flagged share must exceed for :meth:`ScreenSummary.flagged_often`:
benign traffic of a kind the guard does not know, or a table that holds much harm. Twice the 5% budget of chat sits
above every benign domain the guard was fitted on (chat 7.0% of test rows, the others 0.5-4.0%) and below the kinds
of traffic teaching was measured to help (bug-report titles 47%, security questions 57%); agent tasks (8-9%) are not
told."""


@dataclass
class ScreenSummary:
    """What a screening run did, over every row of its input (rows screened by earlier runs included)."""

    rows: int
    """Rows in the input."""
    written: int
    """Rows with a verdict in the output file (all of them, at the end of a run that was not interrupted)."""
    resumed: int
    """Rows already in the output when this run started, skipped."""
    flagged: int
    """Rows flagged (rows that failed closed included)."""
    flagged_by_head: dict[str, int] = field(default_factory=dict)
    """Rows each head flagged (a row two heads flagged counts for both)."""
    failed_closed: int = 0
    """Rows that could not be scored (a NaN or inf activation): flagged, with an ``error``."""
    errors: int = 0
    """Rows not screened: empty, not text, beyond the model's context, or a failure of their own."""
    seconds: float = 0.0
    """Wall time of this run's screening."""
    rows_per_second: float = 0.0
    """Rows this run screened, per second."""

    def describe(self) -> str:
        """A few lines for a person. The shares flagged are of the rows screened: rows not screened (``errors``)
        would lower them by their number alone."""
        screened = max(self.screened, 1)
        share = {name: n / screened for name, n in self.flagged_by_head.items()}
        heads = ", ".join(f"{name} {value:.1%}" for name, value in share.items()) or "none"
        return (
            f"{self.written} of {self.rows} rows have a verdict ({self.resumed} from an earlier run); "
            f"flagged {self.flagged} of {self.screened} screened ({self.flagged / screened:.1%}), "
            f"by head: {heads}; "
            f"failed closed {self.failed_closed}; errors {self.errors}; "
            f"{self.rows_per_second:.1f} rows/s over {self.seconds:.1f} s"
        )

    @property
    def screened(self) -> int:
        """Rows screened: every row with a verdict but those not screened (``errors``); rows that failed closed are
        screened, and flagged."""
        return self.written - self.errors

    @property
    def scored(self) -> int:
        """Rows with a score: not an error, not failed closed."""
        return self.screened - self.failed_closed

    @property
    def scored_flagged(self) -> int:
        """Rows with a score that the guard flagged."""
        return self.flagged - self.failed_closed

    def flagged_often(self, target_fpr: float, confidence: float = 0.95) -> bool:
        """Whether the rows scored are flagged more often than :data:`FLAGGED_OFTEN` times ``target_fpr``, the share of
        benign traffic the guard's thresholds allow, with ``confidence``: traffic flagged at that rate would give this
        many flags or more with probability below ``1 - confidence``, so that a small table's chance share does not
        count (7 of 60 web-agent tasks, a kind flagged at 8%)."""
        from scipy.stats import binom  # over a second to import: read once, at the end of a run

        if self.scored <= 0:
            return False
        return float(binom.sf(self.scored_flagged - 1, self.scored, FLAGGED_OFTEN * target_fpr)) < 1.0 - confidence

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def screen_to_jsonl(
    guarded: GuardedModelForCausalLM,
    rows: Sequence[PromptRow],
    out: str | os.PathLike,
    *,
    batch_size: int = 16,
    max_batch_tokens: int | None = BATCH_TOKENS,
    chat_template: bool = True,
    system: str | None = None,
    explain: int = 0,
    with_prompt: bool = False,
    progress: bool = True,
) -> ScreenSummary:
    """Screen ``rows`` with ``guarded`` (:meth:`GuardedModelForCausalLM.screen`: a forward pass cut after the
    deepest block the guard reads, no decoding) and append one JSON line per row to ``out``.

    A line is ``{"id": ..., **report.to_json(), "read": ...}`` for a screened row
    (:meth:`hf_lsad.guard.SafetyReport.to_json`) and ``{"id": ..., "flagged": null, "error": ..., "read": ...}`` for
    a row that could not be screened; ``read`` says how the run read its prompts (:func:`read_by`). Rows whose id is
    already in ``out`` are skipped: run it again on the same ``out`` to finish an interrupted run. An ``out`` whose
    lines were screened otherwise (at other thresholds, or read otherwise) is refused rather than resumed, and so
    is an ``out`` another run is writing (on Linux and macOS).

    Args:
        guarded: A guarded model with its ``tokenizer``, whose guard reads the prompt.
        rows: The input rows (:func:`hf_lsad.data.tables.read_prompt_table`); ids must be unique. A row read with
            its conversation (``conversation=True``) is read whole, as a chat server reads it.
        out: The JSON-lines file to append to (created if missing, with its folder).
        batch_size: Prompts per forward pass, at most.
        max_batch_tokens: Padded tokens per forward pass, at most (``None``: ``batch_size`` prompts whatever their
            length); rows are batched in order of their length in tokens either way.
        chat_template: Read each prompt as a user turn of the tokenizer's chat template (as ``screen`` does).
        system: A system turn before each user turn, as the deployment sets it (``None``: the template's default);
            a guard's thresholds hold for the turn they were set under.
        explain: Name this many prompt tokens behind each verdict a supervised head decided: the line's ``tokens``
            (:meth:`hf_lsad.guard.SafetyReport.to_json`, with their text). 0: none.
        with_prompt: Write each row's prompt in its line (``"prompt"``: the row's text, of a conversation its last
            user turn; ``None`` for a row without one), so that the rows flagged can be read from ``out`` alone. An
            ``out`` whose lines were written otherwise (with prompts or without) is refused rather than resumed.
        progress: Show a progress bar with rows/s.
    """
    if guarded.tokenizer is None:
        raise ValueError("screening strings needs a tokenizer: GuardedModelForCausalLM(model, guard, tokenizer=tok)")
    check_batching(batch_size, max_batch_tokens)
    check_explain_count(explain)
    position = guarded.guard.config.hook.position
    if position not in PROMPT_POSITIONS:
        raise ValueError(f"screening needs a guard that reads the prompt {PROMPT_POSITIONS}; this one reads {position}")
    ids = [row.id for row in rows]
    if len(set(ids)) != len(ids):
        raise ValueError("row ids must be unique: they are what a resumed run skips")
    path = Path(out)
    conversation = any(row.conversation is not None for row in rows)
    read = read_by(guarded, chat_template=chat_template, system=system, conversation=conversation)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; out is the JSON-lines file of verdicts")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    with held_alone(path, output_in_use(path)):
        done = _finished_ids(path, guarded.guard.head_thresholds(), read, with_prompt)
        prompts = {row.id: row.text for row in rows} if with_prompt else {}
        pending = [row for row in rows if row.id not in done]
        resumed = len(rows) - len(pending)
        start = time.perf_counter()
        with (
            path.open("a", encoding="utf-8") as handle,
            tqdm(total=len(pending), unit="row", desc="screening", disable=not progress) as bar,
        ):

            def write(records: list[dict[str, Any]]) -> None:
                if with_prompt:
                    records = [{**record, "prompt": prompts[record["id"]]} for record in records]
                handle.write("".join(json.dumps({**record, "read": read}) + "\n" for record in records))
                handle.flush()  # a kill loses at most the batch in flight
                bar.update(len(records))

            batches, errors = plan_batches(
                guarded,
                pending,
                batch_size=batch_size,
                max_batch_tokens=max_batch_tokens,
                chat_template=chat_template,
                system=system,
            )
            write([_error_record(row_id, error) for row_id, error in errors])
            for batch in batches:
                write(_screen_batch(guarded, batch, explain))
    seconds = time.perf_counter() - start
    return _summary(path, ids, resumed, seconds, len(pending))


def output_in_use(path: Path) -> str:
    """What a screening run on ``path`` is told while another run writes it."""
    return (
        f"{path} is being written by another screening run: wait for it to end (then run again to screen what it "
        "left), or choose another --out"
    )


def read_by(
    guarded: GuardedModelForCausalLM, *, chat_template: bool, system: str | None, conversation: bool = False
) -> dict[str, Any]:
    """How a screening run reads its prompts, written on each of its lines: the model's name (``None``: unnamed),
    the digest of the peft adapters it runs (:func:`hf_lsad.capture.adapters.adapter_digest`, ``None`` for none),
    the dtype of its weights, the system turn (``None``: the template's default), whether prompts are read as user
    turns of the chat template, and whether rows are whole conversations rather than one user turn. Each moves the
    scores, so lines read otherwise are not one run's verdicts."""
    model = guarded.model
    return {
        "model": str(model.config.name_or_path) or None,
        "adapter": adapter_digest(model),
        "dtype": str(model.dtype).removeprefix("torch."),
        "system": system,
        "chat_template": chat_template,
        "conversation": conversation,
    }


_READ_NAMES = {
    "model": "model",
    "adapter": "adapters",
    "dtype": "dtype",
    "system": "system turn",
    "chat_template": "chat template",
    "conversation": "whole conversations",
}
_READ_BEFORE = {"conversation": False}
"""What a line written before ``read`` held a key read it as."""


VERDICT_LINE_START = b'{"id": '
"""How every line :func:`screen_to_jsonl` writes begins (``json.dumps`` of a record whose first key is ``id``)."""


def verdict_lines(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """The verdict lines of ``path`` with their line numbers, as :func:`screen_to_jsonl` wrote them (a missing or
    empty file has none). A last line without its newline (a kill mid-write) is left out. ``ValueError`` names the
    first line that is not a verdict line (a JSON object with ``id`` and ``flagged``), or a last line that does not
    begin as one: such a file is not a screening run's, and resuming into it would destroy what it holds. The file
    is read, never changed."""
    return _read_verdicts(path)[0]


def _read_verdicts(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """:func:`verdict_lines` of ``path``, and the length in bytes of its whole lines (a kill's unfinished line
    after them)."""
    if not path.is_file():
        return [], 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    records = []
    for number, line in enumerate(data[:end].decode("utf-8", errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "id" not in record or "flagged" not in record:
                raise ValueError("a verdict line is a JSON object with id and flagged")
        except ValueError as err:  # json.JSONDecodeError among them
            raise ValueError(
                f"{path}:{number}: not a verdict line of hf-lsad screen ({err}); choose another --out"
            ) from err
        records.append((number, record))
    unfinished = data[end:]
    if unfinished and not (VERDICT_LINE_START.startswith(unfinished) or unfinished.startswith(VERDICT_LINE_START)):
        raise ValueError(f"{path}:{len(records) + 1}: not a verdict line of hf-lsad screen; choose another --out")
    return records, end


def _finished_ids(path: Path, thresholds: dict[str, float], read: dict[str, Any], with_prompt: bool) -> set[str]:
    """Ids already in ``path``, once every line is found to be a verdict line (:func:`verdict_lines`); a last line
    without its newline (a kill mid-write) is then cut off. A screened line whose heads have other ``thresholds``
    than the guard's (another guard, or the same after ``set-budget``), a line read otherwise than this run reads
    (:func:`read_by`; lines written before lines said so are not checked), or a line with its prompt where this run
    writes none or the other way round, is an error: resuming would leave its verdicts beside this run's, and skip
    its rows."""
    done = set()
    records, complete = _read_verdicts(path)  # one read: the file may hold a long run's verdicts
    for number, record in records:
        try:
            done.add(str(record["id"]))
            written = {name: head["threshold"] for name, head in record.get("heads", {}).items()}
            written_read: Any = record.get("read")  # None on lines written before lines said how they were read
            differs = [
                key
                for key in read
                if written_read is not None and written_read.get(key, _READ_BEFORE.get(key)) != read[key]
            ]
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(
                f"{path}:{number}: not a verdict line of hf-lsad screen ({err}); choose another --out"
            ) from err
        if written and written != thresholds:  # an error line (a row that could not be screened) has no heads
            raise ValueError(
                f"{path}:{number} was screened at other thresholds ({_thresholds(written)}) than this guard's "
                f"({_thresholds(thresholds)}): resuming would mix two guards' verdicts and skip these rows. "
                "Choose another --out, or delete this one to screen every row again"
            )
        if ("prompt" in record) != with_prompt:
            held = "holds its prompt" if "prompt" in record else "holds no prompt"
            asked = "writes each row's prompt" if with_prompt else "writes none"
            raise ValueError(
                f"{path}:{number} {held} and this run {asked}: resuming would leave lines of both kinds. Choose "
                "another --out, or run as the lines there were written"
            )
        if differs:
            changes = "; ".join(
                f"{_READ_NAMES[key]} {_read_value(key, written_read.get(key, _READ_BEFORE.get(key)))} here, "
                f"{_read_value(key, read[key])} in this run"
                for key in differs
            )
            raise ValueError(
                f"{path}:{number} was read otherwise than this run reads its prompts ({changes}): resuming would mix "
                "verdicts of two readings and skip these rows. Choose another --out, or delete this one to screen "
                "every row again"
            )
    if path.is_file() and complete != path.stat().st_size:
        with path.open("r+b") as handle:
            handle.truncate(complete)
    return done


def _read_value(key: str, value: Any) -> str:
    if key == "adapter":
        return adapter_label(value)
    if key == "system" and value is None:
        return "the template's default"
    return repr(value)


def _thresholds(thresholds: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.6g}" for name, value in thresholds.items())


class PromptBatch(NamedTuple):
    """Rows screened in one forward pass: their ids and token ids."""

    ids: list[str]
    token_ids: list[list[int]]

    def tensors(self, tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` and ``attention_mask``, padded on the left by the tokenizer."""
        return pad_left(tokenizer, self.token_ids)


def plan_batches(
    guarded: GuardedModelForCausalLM,
    rows: Sequence[PromptRow],
    *,
    batch_size: int,
    max_batch_tokens: int | None = None,
    chat_template: bool = True,
    system: str | None = None,
) -> tuple[list[PromptBatch], list[tuple[str, str]]]:
    """The rows that can be screened, tokenised as ``screen`` reads them and batched in order of token length
    (:func:`~hf_lsad.core.batching.length_batches`), and ``(id, error)`` of the others: rows read without a prompt,
    then rows longer than the model's context. A row read with its conversation
    (:attr:`~hf_lsad.data.tables.PromptRow.conversation`) is read whole, as a chat server reads it
    (:func:`~hf_lsad.capture.collect.conversation_token_ids`)."""
    tokenizer = guarded.tokenizer
    check_pad_token(tokenizer)
    errors = [(row.id, row.error) for row in rows if row.error is not None]
    readable = [row for row in rows if row.error is None]
    conversations = [row.conversation for row in readable if row.conversation is not None]
    if conversations and not chat_template:
        raise ValueError("conversations are read under the chat template; chat_template=False reads prompts raw")
    # a row without an error has its prompt, or its conversation (PromptRow)
    prompts = [cast(str, row.text) for row in readable if row.conversation is None]
    plain = iter(prompt_token_ids(tokenizer, prompts, chat_template=chat_template, system=system))
    whole = iter(conversation_token_ids(tokenizer, conversations, system=system))
    token_ids = [next(plain) if row.conversation is None else next(whole) for row in readable]
    context = getattr(guarded.model.config.get_text_config(), "max_position_embeddings", None)
    fits = [not context or len(ids) <= context for ids in token_ids]
    errors += [
        (row.id, f"{len(ids)} tokens, longer than the model's context ({context})")
        for row, ids, ok in zip(readable, token_ids, fits)
        if not ok
    ]
    fitting = [i for i, ok in enumerate(fits) if ok]
    batches = [
        PromptBatch([readable[fitting[j]].id for j in chunk], [token_ids[fitting[j]] for j in chunk])
        for chunk in length_batches([len(token_ids[i]) for i in fitting], batch_size, max_batch_tokens)
    ]
    return batches, errors


def _screen_batch(guarded: GuardedModelForCausalLM, batch: PromptBatch, explain: int = 0) -> list[dict]:
    """Verdict records of one batch; if the batch raises, its rows one by one, each failure its row's error."""
    try:
        reports = guarded.screen(*batch.tensors(guarded.tokenizer), explain=explain > 0, top_k=max(explain, 1))
        tokenizer = guarded.tokenizer
        return [{"id": row_id, **report.to_json(tokenizer)} for row_id, report in zip(batch.ids, reports)]
    except Exception as err:  # one row's problem must not end the run
        if len(batch.ids) == 1:
            return [_error_record(batch.ids[0], f"{type(err).__name__}: {err}")]
        return [
            record
            for row_id, ids in zip(batch.ids, batch.token_ids)
            for record in _screen_batch(guarded, PromptBatch([row_id], [ids]), explain)
        ]


def _error_record(row_id: str, error: str) -> dict[str, Any]:
    return {"id": row_id, "flagged": None, "error": error}


def verdicts_of(path: Path, ids: Sequence[str]) -> list[dict[str, Any]]:
    """The verdict lines in ``path`` of the rows ``ids``: every whole line (a line a kill or an interrupt left
    unfinished is not one), as :func:`screen_to_jsonl` wrote them."""
    wanted = set(ids)
    data = path.read_text(encoding="utf-8") if path.is_file() else ""
    records = [json.loads(line) for line in data[: data.rfind("\n") + 1].splitlines()]
    return [record for record in records if str(record["id"]) in wanted]


def _summary(path: Path, ids: list[str], resumed: int, seconds: float, screened: int) -> ScreenSummary:
    records = verdicts_of(path, ids)
    by_head: Counter[str] = Counter()
    for record in records:
        by_head.update(record.get("decided_by") or [])
    return ScreenSummary(
        rows=len(ids),
        written=len({str(r["id"]) for r in records}),
        resumed=resumed,
        flagged=sum(r["flagged"] is True for r in records),
        flagged_by_head=dict(sorted(by_head.items())),
        failed_closed=sum(r["flagged"] is True and r.get("error") is not None for r in records),
        errors=sum(r["flagged"] is None for r in records),
        seconds=seconds,
        rows_per_second=screened / seconds if seconds > 0 else 0.0,
    )

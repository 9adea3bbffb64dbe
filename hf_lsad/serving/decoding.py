"""How the server decodes one request's answer, beside what guarded ``generate`` does: the OpenAI API's sampling
settings as logits processors (:class:`AnswerPenalties`, :class:`SeededSampling`), the tokens' log-probabilities
(:class:`TokenLogprobs`), its stop sequences
(:class:`StopSequences` ends a row, :func:`cut_at_stop` and :class:`StopText` cut the text, whole or streamed), the
text of each choice as it is written (:class:`ChoicesStreamer`), where each ends (:func:`answer_ends`) and a client that
went away (:class:`Cancelled`).

The guard's own logits processor and stopping criterion are added after these by guarded ``generate``, so a row the
guard stops is stopped whatever they ask.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any, cast

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    StoppingCriteria,
    TemperatureLogitsWarper,
    TextStreamer,
    TopPLogitsWarper,
)
from transformers.generation.streamers import BaseStreamer

from ..capture.generate_call import eos_token_ids


def answer_ends(model: PreTrainedModel, tokenizer: Any) -> list[int]:
    """The ids that end an answer: the generation config's (what ``generate`` stops on) and the tokenizer's EOS
    (an id may be 0, as Pythia's is)."""
    tokenizer_eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    return sorted({*eos_token_ids(model, {}), *tokenizer_eos})


class Cancelled(StoppingCriteria):
    """Stops every row once ``event`` is set."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class AnswerPenalties(LogitsProcessor):
    """The OpenAI API's presence and frequency penalties: the logit of each token the answer has written is lowered by
    ``presence`` once and by ``frequency`` for each time it was written. The prompt's tokens, the first
    ``prompt_tokens`` of every row, do not count."""

    def __init__(self, prompt_tokens: int, presence: float, frequency: float) -> None:
        self.prompt_tokens, self.presence, self.frequency = prompt_tokens, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        written = input_ids[:, self.prompt_tokens :]  # [rows, answer tokens so far]
        counts = torch.zeros_like(scores).scatter_add_(1, written, torch.ones_like(written, dtype=scores.dtype))
        penalty = self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)  # [rows, vocabulary]
        return cast(torch.FloatTensor, scores - penalty)  # transformers' annotation; a plain Tensor


class TokenLogprobs(LogitsProcessor):
    """Records, at each step, each row's log-probabilities: the ``top`` most likely tokens, and the log-probability of
    the token the row then wrote (read from ``input_ids`` at the next step, or from the final sequences by
    :meth:`finish`).

    Put first among the request's processors, it is given the model's next-token logits before the request's
    ``logit_bias``, penalties, temperature and top-p: what the OpenAI API's ``logprobs`` report. transformers runs the
    processors the model's own generation config asks for (a repetition penalty, say; SmolLM2's asks for none) before
    any a call passes, so those are in. Only the last step's full distribution is kept, until the token drawn from it
    is known."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.top_tokens: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Per step: the ids ``[rows, top]`` of the most likely tokens and their log-probabilities."""
        self.written: list[torch.Tensor] = []
        """Per step: the log-probability ``[rows]`` of the token each row wrote."""
        self.last: torch.Tensor | None = None
        """The last step's log-probabilities ``[rows, vocabulary]``, until its tokens are known."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._read_written(input_ids[:, -1])  # the tokens drawn at the step before
        self.last = torch.log_softmax(scores.float(), dim=-1)  # [rows, vocabulary]
        values, ids = self.last.topk(self.top, dim=-1)  # [rows, top]
        self.top_tokens.append((ids.cpu(), values.cpu()))
        return scores

    def finish(self, sequences: torch.Tensor) -> None:
        """Reads the last step's tokens from the sequences ``generate`` returned."""
        self._read_written(sequences[:, -1])

    def _read_written(self, tokens: torch.Tensor) -> None:
        if self.last is not None:
            self.written.append(self.last.gather(1, tokens[:, None].to(self.last.device)).squeeze(1).cpu())
            self.last = None

    def row(self, index: int, steps: int) -> list[tuple[float, list[tuple[int, float]]]]:
        """Row ``index``'s first ``steps`` positions: the written token's log-probability, and the most likely tokens
        with theirs, most likely first."""
        return [
            (float(self.written[step][index]), list(zip(ids[index].tolist(), values[index].tolist())))
            for step, (ids, values) in enumerate(self.top_tokens[:steps])
        ]


class SeededSampling(LogitsProcessor):
    """Draws each next token from the temperature and top-p distribution with the request's own generator, and
    forces it (every other logit ``-inf``), so that greedy search picks it.

    transformers' sampling draws from torch's global generator, which concurrent requests share: a seed set there
    would not make one request's answer reproducible. The guard's processor runs after this one, so a stopped row's
    forced tokens still win."""

    def __init__(self, seed: int, temperature: float, top_p: float) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)])

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probabilities = torch.softmax(self.warpers(input_ids, scores).float(), dim=-1).cpu()
        tokens = torch.multinomial(probabilities, 1, generator=self.generator).squeeze(1).to(scores.device)
        forced = torch.full_like(scores, float("-inf"))
        forced[torch.arange(len(tokens), device=scores.device), tokens] = 0.0
        return cast(torch.FloatTensor, forced)  # transformers' annotation; a plain Tensor


class StopSequences(StoppingCriteria):
    """Ends the row once the text of its new tokens, decoded as the answer is, holds one of ``stops``.

    The text is decoded whole at every step rather than matched token by token, so a stop sequence that straddles
    tokens, or that the tokenizer writes in pieces, is found; one request is one row of at most a few hundred tokens.
    """

    def __init__(self, tokenizer: Any, prompt_tokens: int, stops: list[str]) -> None:
        self.tokenizer, self.prompt_tokens, self.stops = tokenizer, prompt_tokens, stops

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_tokens :], skip_special_tokens=True)
        ended = [any(stop in text for stop in self.stops) for text in texts]
        return torch.tensor(ended, dtype=torch.bool, device=input_ids.device)


class ChoicesStreamer(BaseStreamer):
    """The text of each row of a ``generate`` call (one row per choice) as ``(index, text)`` pieces, in the order
    they are written; iterate it from another thread than the one generating.

    Each row is decoded by a transformers :class:`~transformers.TextStreamer` of its own (which holds a word back until
    it is whole); a row that wrote an end-of-sequence id is fed no more, since ``generate`` pads it while the others
    go on."""

    def __init__(self, tokenizer: Any, choices: int, ends: list[int]) -> None:
        self.pieces: queue.Queue[tuple[int, str] | None] = queue.Queue()
        self.rows = [_RowText(tokenizer, index, self.pieces) for index in range(choices)]
        self.ends = set(ends)
        self.ended = [False] * choices
        self.prompt = True

    def put(self, value: torch.Tensor) -> None:
        if self.prompt:  # generate's first put is the prompt
            self.prompt = False
            return
        tokens = value.reshape(len(self.rows), -1)[:, -1].tolist()  # [choices]: each row's newest token
        for index, token in enumerate(tokens):
            if not self.ended[index]:
                self.rows[index].put(torch.tensor([token]))
                self.ended[index] = token in self.ends

    def end(self) -> None:
        for row in self.rows:
            row.end()
        self.pieces.put(None)

    def __iter__(self) -> Iterator[tuple[int, str]]:
        while (piece := self.pieces.get()) is not None:
            yield piece


class _RowText(TextStreamer):
    """One row's decoded text, put on the shared queue with the row's index."""

    def __init__(self, tokenizer: Any, index: int, pieces: queue.Queue[tuple[int, str] | None]) -> None:
        super().__init__(tokenizer, skip_prompt=False, skip_special_tokens=True)
        self.index, self.pieces = index, pieces

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.pieces.put((self.index, text))


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first of ``stops`` it holds, and whether it held one."""
    found = [text.index(stop) for stop in stops if stop in text]
    return (text[: min(found)], True) if found else (text, False)


class StopText:
    """Streamed text cut at the first stop sequence: each piece is sent as far as no stop sequence could begin in
    it, the rest held until the next piece tells."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.pending = ""
        self.sent = ""
        """The text sent so far: the answer's, once flushed."""
        self.found = False
        """Whether a stop sequence was written (nothing is sent after it)."""

    def feed(self, piece: str) -> str:
        """What of the text so far can be sent now."""
        if self.found:
            return ""
        self.pending += piece
        text, self.found = cut_at_stop(self.pending, self.stops)
        if self.found:
            self.pending = ""
            return self._send(text)
        # The longest end of the text that begins a stop sequence waits: the next piece may complete it.
        held = max(
            (n for stop in self.stops for n in range(1, len(stop)) if self.pending.endswith(stop[:n])), default=0
        )
        sendable = self.pending[: len(self.pending) - held]
        self.pending = self.pending[len(sendable) :]
        return self._send(sendable)

    def flush(self) -> str:
        """The text held at the end (no stop sequence began in it)."""
        rest, self.pending = ("" if self.found else self.pending), ""
        return self._send(rest)

    def _send(self, text: str) -> str:
        self.sent += text
        return text

"""The OpenAI shapes of the server's answers: a completion whole or as stream chunks (:class:`Answer`), a moderation
result (:func:`moderation_result`)."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
from tokenizers import decoders
from transformers.convert_slow_tokenizer import bytes_to_unicode

from ..guard.types import SafetyReport
from .decoding import TokenLogprobs, cut_at_stop


class Answer:
    """The OpenAI shapes of one request's answer: whole, or as stream chunks."""

    def __init__(
        self,
        model: str,
        chat: bool,
        reads_prompt: bool,
        prompt_tokens: int,
        tokenizer: Any,
        stops: list[str],
        ends: list[int],
        logprobs: TokenLogprobs | None = None,
        include_usage: bool = False,
    ) -> None:
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.chat, self.reads_prompt = model, chat, reads_prompt
        self.prompt_tokens, self.tokenizer, self.stops, self.ends = prompt_tokens, tokenizer, stops, set(ends)
        self.logprobs = logprobs
        """The tokens' log-probabilities, recorded during ``generate``; ``None``: not asked for."""
        self.include_usage = include_usage
        """A stream's usage, in a chunk of its own at the end (``stream_options.include_usage``); else none."""
        self.token_bytes = token_bytes(tokenizer)

    def whole(self, sequences: torch.Tensor, reports: list[SafetyReport], max_new: int) -> dict[str, Any]:
        """The answer to a request: a choice per row of ``sequences`` ``[choices, tokens]``, each with its report."""
        choices, written = [], 0
        for index, (sequence, report) in enumerate(zip(sequences, reports)):
            new = self._new_tokens(sequence)
            written += len(new)
            text, stopped = cut_at_stop(self.tokenizer.decode(new, skip_special_tokens=True), self.stops)
            choice: dict[str, Any] = {"index": index, "logprobs": self._logprobs(index, new, text, stopped)}
            choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
            choice.update(finish_reason=self._finish(new, report, max_new, stopped), safety=self._safety(report))
            choices.append(choice)
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": choices,
            "usage": self._usage(written),
            "safety": self._safety(reports[0]),
        }

    def chunk(self, index: int, *, role: str | None = None, content: str | None = None) -> dict[str, Any]:
        """A stream chunk of choice ``index``: its role (the first), or a piece of its text."""
        choice: dict[str, Any]
        if self.chat:
            delta = {"role": role} if role else {"content": content}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": index, "text": content or "", "logprobs": None, "finish_reason": None}
        return {**self._stream_head(), "choices": [choice]}

    def last_chunks(
        self, sequences: torch.Tensor, reports: list[SafetyReport], max_new: int, texts: list[tuple[str, bool]]
    ) -> list[dict[str, Any]]:
        """The chunks that end a stream: each choice's finish reason, report and the log-probabilities of its tokens
        (when asked for: every token's, in this one chunk), the answer's report on the last, then, when asked for, a
        chunk of the usage alone; ``texts``: per choice, the text sent and whether a stop sequence ended it."""
        chunks, written = [], 0
        for index, (sequence, report, (text, stop)) in enumerate(zip(sequences, reports, texts)):
            new = self._new_tokens(sequence)
            written += len(new)
            chunk = self.chunk(index, content="")
            choice = chunk["choices"][0]
            if self.chat:
                choice["delta"] = {}
            choice.update(
                logprobs=self._logprobs(index, new, text, stop),
                finish_reason=self._finish(new, report, max_new, stop),
                safety=self._safety(report),
            )
            chunks.append(chunk)
        chunks[-1].update(safety=self._safety(reports[0]))
        if self.include_usage:
            chunks.append({**self._stream_head(), "choices": [], "usage": self._usage(written)})
        return chunks

    @staticmethod
    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _stream_head(self) -> dict[str, Any]:
        usage = {"usage": None} if self.include_usage else {}  # every chunk but the last, as the OpenAI API
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), **usage}

    def _new_tokens(self, sequence: torch.Tensor) -> list[int]:
        """A choice's tokens: up to its first end-of-sequence id, without the padding ``generate`` puts after a row
        that ended (at EOS, or at a stop sequence) while other choices went on."""
        new = sequence[self.prompt_tokens :].tolist()
        end = next((i for i, token in enumerate(new) if token in self.ends), None)
        if end is not None:
            return new[: end + 1]
        while new and new[-1] == self.tokenizer.pad_token_id:
            new.pop()
        return new

    def _logprobs(self, index: int, new: list[int], text: str, stopped: bool) -> dict[str, Any] | None:
        """Choice ``index``'s tokens with their log-probabilities in the OpenAI shape (chat; or the legacy
        completions shape), ``None`` when not asked for. The tokens are those of ``text``: a special token (an
        end-of-sequence id; any the text leaves out) is not listed, nor a token that begins after a stop sequence cut
        the text."""
        if self.logprobs is None:
            return None
        steps = self.logprobs.row(index, len(new))
        unwritten = self.ends | set(self.tokenizer.all_special_ids)  # what skip_special_tokens leaves out of text
        listed = [step for step, token in enumerate(new) if token not in unwritten]
        # the tokens that begin before the cut: the row ended as it wrote the stop sequence, so they are all but a few
        decode = self.tokenizer.decode
        while stopped and listed and len(decode(new[: listed[-1]], skip_special_tokens=True)) >= len(text):
            listed.pop()
        if self.chat:
            content = []
            for step in listed:
                logprob, most_likely = steps[step]
                top = [self._token(token, value) for token, value in most_likely]
                content.append({**self._token(new[step], logprob), "top_logprobs": top})
            return {"content": content, "refusal": None}
        tokens = [self.tokenizer.decode([new[step]]) for step in listed]
        offsets = list(itertools.accumulate((len(token) for token in tokens[:-1]), initial=0)) if tokens else []
        return {
            "tokens": tokens,
            "token_logprobs": [steps[step][0] for step in listed],
            "top_logprobs": [{self.tokenizer.decode([t]): p for t, p in steps[step][1]} for step in listed],
            "text_offset": offsets,
        }

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        """One token of a chat answer's ``logprobs``: its text, log-probability and UTF-8 bytes."""
        return {"token": self.tokenizer.decode([token]), "logprob": logprob, "bytes": list(self.token_bytes(token))}

    def _finish(self, new: list[int], report: SafetyReport, max_new: int, stopped: bool) -> str:
        if report.stopped:
            return "content_filter"
        if stopped:
            return "stop"
        ended = bool(new) and new[-1] in self.ends
        return "length" if not ended and len(new) >= max_new else "stop"

    def _usage(self, written: int) -> dict[str, int]:
        """Token counts as the OpenAI API gives them: the prompt once, the tokens of every choice."""
        total = self.prompt_tokens + written
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": written, "total_tokens": total}

    def _safety(self, report: SafetyReport) -> dict[str, Any]:
        return {"prompt" if self.reads_prompt else "response": report.to_json(self.tokenizer)}


def moderation_result(report: SafetyReport, tokenizer: Any) -> dict[str, Any]:
    """One result of ``/v1/moderations``: a category per head; a row that failed closed is flagged in every one."""
    verdicts = report.head_verdicts()
    failed = report.error is not None
    return {
        "flagged": bool(report.flagged),
        "categories": {v.name: bool(v.flagged or failed) for v in verdicts},
        "category_scores": {v.name: 1.0 if failed else float(v.score) for v in verdicts},
        "category_applied_input_types": {v.name: ["text"] for v in verdicts},
        "hf_lsad": report.to_json(tokenizer),
    }


def token_bytes(tokenizer: Any) -> Callable[[int], bytes]:
    """The UTF-8 bytes of one token, as the OpenAI API gives them so that a client can join tokens that each hold part
    of a character. A byte-level BPE tokenizer (GPT-2's, SmolLM2's) writes each byte as a character of its own, which is
    mapped back; any other, the token's decoded text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and isinstance(backend.decoder, decoders.ByteLevel):
        byte_of = {character: byte for byte, character in bytes_to_unicode().items()}

        def from_byte_level(token: int) -> bytes:
            piece = tokenizer.convert_ids_to_tokens(token)
            if all(character in byte_of for character in piece):
                return bytes(byte_of[character] for character in piece)
            return tokenizer.decode([token]).encode()  # an added token, written as itself

        return from_byte_level
    return lambda token: tokenizer.decode([token]).encode()

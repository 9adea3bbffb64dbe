"""An OpenAI-compatible HTTP server over a guarded model: what ``hf-lsad serve`` runs.

Routes: ``POST /v1/chat/completions`` (streaming and not), ``POST /v1/completions``, ``POST /v1/moderations``,
``GET /v1/models``, ``GET /health``. Every choice of a completion carries the guard's report in an extra field
``safety`` (``{"prompt": report}`` for a guard that reads the prompt, ``{"response": report}`` for one that reads the
response; :meth:`hf_lsad.guard.SafetyReport.to_json`), and the completion's own ``safety`` is its first choice's.
A prompt the guard flags is stopped before its first token and a response a running guard flags is stopped where it
is flagged: either way the choice ends with ``finish_reason: "content_filter"``, as Azure OpenAI's content filter
does. ``/v1/moderations`` answers in the OpenAI moderation shape with one category per guard head.

This module holds the routes, the limits and the errors. How an answer is decoded (the ``n`` choices of a request are
rows of one ``generate`` call; penalties, seeds and ``stop`` sequences) is :mod:`hf_lsad.serving.decoding`, and the
shapes it is sent in :mod:`hf_lsad.serving.answer`.

Concurrency: each request runs its own ``generate`` in a worker thread (one guarded model serves concurrent calls;
reports never mix, tested), at most ``max_concurrency`` at a time so that a burst does not split the CPU into
slivers. Requests are not micro-batched: a batch would make every row wait for the longest and tie a stopped row's
fate to its neighbours'; measured in ``benchmarks/perf/serve_load.py``.

Errors use the OpenAI error shape ``{"error": {"message", "type", "param", "code"}}``: malformed JSON, a missing or
mistyped field, an empty message list, an empty user turn or prompt, ``max_tokens`` above the limit or a prompt beyond
the model's context are 400; a missing or wrong key 401; a body above the size limit 413. A client that disconnects
mid-stream stops its generation at the next token.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.exceptions import HTTPException
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    SequenceBiasLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
)

from ..capture.collect import check_pad_token, check_prompts, conversation_token_ids
from ..capture.inputs import check_context
from ..capture.recorder import PROMPT_POSITIONS
from ..core.prompt_tokens import check_explain_count
from ..errors import InputError
from ..generation.generate import decoding_settings
from ..generation.model import GuardedModelForCausalLM
from ..version import __version__
from .answer import Answer, moderation_result
from .decoding import (
    AnswerPenalties,
    Cancelled,
    ChoicesStreamer,
    SeededSampling,
    StopSequences,
    StopText,
    TokenLogprobs,
    answer_ends,
)
from .schemas import ChatCompletionRequest, CompletionRequest, ModerationRequest


@dataclass
class ServeConfig:
    """What the server answers as and the limits it keeps."""

    model_name: str
    """The name ``/v1/models`` lists and every answer carries."""
    api_key: str | None = None
    """When set, every route but ``/health`` needs ``Authorization: Bearer <api_key>``."""
    max_tokens_limit: int = 512
    """The largest ``max_tokens`` a request may ask for."""
    default_max_tokens: int = 128
    """``max_tokens`` of a request that names none."""
    max_body_bytes: int = 1_000_000
    """The largest request body."""
    max_concurrency: int = 4
    """Generations at one time; further requests wait their turn."""
    max_moderation_inputs: int = 64
    """Inputs per ``/v1/moderations`` request."""
    max_choices: int = 4
    """The largest ``n`` a request may ask for (its choices are rows of one ``generate`` call)."""
    explain: int = 0
    """Prompt tokens each report names when a supervised head decided it (its ``tokens``,
    :meth:`hf_lsad.guard.SafetyReport.to_json`); 0: none."""

    def __post_init__(self) -> None:
        for name in (
            "max_tokens_limit",
            "default_max_tokens",
            "max_body_bytes",
            "max_concurrency",
            "max_moderation_inputs",
            "max_choices",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        check_explain_count(self.explain)
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must not exceed max_tokens_limit")


class ServeError(HTTPException):
    """An error answered in the OpenAI shape."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(status, message)
        self.kind, self.param = kind, param


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def raw_prompt_note(guarded: GuardedModelForCausalLM) -> str | None:
    """What the operator should know at start about ``/v1/completions``, which reads each prompt as it is: a guard
    fitted on prompts under the chat template reads a prompt without it out of its distribution. ``None`` for a guard
    fitted on raw prompts, or one that did not record how its prompts were given."""
    inputs = guarded.guard.inputs
    if inputs is None or inputs.prompt_format != "chat_template":
        return None
    return (
        "note: /v1/completions reads each prompt as it is, but this guard was fitted on prompts under the chat "
        "template and flags many benign prompts given without it: send /v1/chat/completions, or format prompts with "
        "the template (docs/traffic.md)"
    )


def create_app(guarded: GuardedModelForCausalLM, config: ServeConfig) -> FastAPI:
    """The FastAPI application serving ``guarded`` (which must carry its ``tokenizer``) under ``config``."""
    if guarded.tokenizer is None:
        raise ValueError("serving needs the tokenizer: GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)")
    tokenizer = guarded.tokenizer
    check_pad_token(tokenizer)
    reads_prompt = guarded.guard.config.hook.position in PROMPT_POSITIONS
    ends = answer_ends(guarded.model, tokenizer)
    vocabulary = int(guarded.model.get_output_embeddings().weight.shape[0])  # the width of the logits a bias adds to
    gate = threading.BoundedSemaphore(config.max_concurrency)
    explaining: dict[str, Any] = {"explain": True, "top_k": config.explain} if config.explain else {}

    app = FastAPI(title="hf-lsad", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        said = str(first.get("msg")).removeprefix("Value error, ")  # pydantic's prefix to a validator's own message
        message = f"{where}: {said}" if where else said
        return JSONResponse(error_body(message, "invalid_request_error", where or None), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException) -> JSONResponse:
        kind = getattr(err, "kind", "invalid_request_error" if err.status_code < 500 else "server_error")
        return JSONResponse(error_body(str(err.detail), kind, getattr(err, "param", None)), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def crashed(_: Request, err: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"{type(err).__name__}: {err}", "server_error"), status_code=500)

    def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {config.api_key}":
            raise ServeError(401, "missing or wrong API key (Authorization: Bearer KEY)", kind="authentication_error")

    api = APIRouter(dependencies=[Depends(check_key)])

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": config.model_name, "heads": guarded.guard.head_names}

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "hf-lsad"}
        return {"object": "list", "data": [card]}

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:  # read as screen(conversations) and hf-lsad screen --conversation read a conversation
            (ids,) = conversation_token_ids(tokenizer, [messages])
        except Exception as err:
            message = f"the model's chat template cannot render these messages: {err}"
            raise ServeError(400, message, param="messages") from err
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        return await complete(inputs, body, body.max_completion_tokens or body.max_tokens, chat=True)

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        inputs = tokenizer([body.prompt], return_tensors="pt")
        return await complete(dict(inputs), body, body.max_tokens, chat=False)

    @api.post("/v1/moderations")
    async def moderations(body: ModerationRequest) -> dict[str, Any]:
        if not reads_prompt:
            raise ServeError(400, "this guard reads the response; moderating text needs a guard that reads the prompt")
        texts = body.texts()
        if not 1 <= len(texts) <= config.max_moderation_inputs:
            raise ServeError(400, f"input: 1 to {config.max_moderation_inputs} texts, got {len(texts)}", param="input")
        try:
            check_prompts(texts)
        except (TypeError, ValueError) as err:
            raise ServeError(400, f"input: {err}", param="input") from err
        try:
            reports = await run_in_threadpool(gated, gate, lambda: guarded.screen(texts, **explaining))
        except InputError as err:  # a text longer than the model's context
            raise ServeError(400, f"input: {err}", param="input") from err
        return {
            "id": f"modr-{uuid.uuid4().hex}",
            "model": config.model_name,
            "results": [moderation_result(report, tokenizer) for report in reports],
        }

    async def complete(inputs: dict[str, torch.Tensor], body: Any, max_tokens: int | None, *, chat: bool) -> Any:
        max_new = config.default_max_tokens if max_tokens is None else max_tokens
        if max_new > config.max_tokens_limit:
            raise ServeError(400, f"max_tokens: at most {config.max_tokens_limit}, got {max_new}", param="max_tokens")
        if body.n > config.max_choices:
            raise ServeError(400, f"n: at most {config.max_choices} choices, got {body.n}", param="n")
        tensors: dict[str, Any] = {name: inputs[name].to(guarded.device) for name in ("input_ids", "attention_mask")}
        try:
            check_context(guarded.model, tensors["input_ids"], tensors["attention_mask"])
        except InputError as err:
            raise ServeError(400, str(err), param="messages" if chat else "prompt") from err
        # each choice is a row of its own: greedy search answers alike, sampling draws each row apart
        tensors = {name: tensor.repeat(body.n, 1) for name, tensor in tensors.items()}
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = body.top_p or 1.0
        settings: dict[str, Any] = dict(max_new_tokens=max_new, pad_token_id=tokenizer.pad_token_id)
        prompt_tokens = int(tensors["input_ids"].shape[1])
        # transformers runs these before its temperature and top-p warpers, and the guard's own after them
        processors: list[LogitsProcessor] = []
        top_logprobs = body.token_logprobs()
        logprobs = None if top_logprobs is None else TokenLogprobs(top_logprobs)
        if logprobs is not None:  # first: it reads the model's own logits
            processors.append(logprobs)
        if body.logit_bias:
            beyond = sorted(token for token in body.logit_bias if token >= vocabulary)
            if beyond:
                known = f"ids 0 to {vocabulary - 1}"
                message = f"logit_bias: token ids {beyond} are beyond the model's vocabulary ({known})"
                raise ServeError(400, message, param="logit_bias")
            processors.append(SequenceBiasLogitsProcessor([[[token], bias] for token, bias in body.logit_bias.items()]))
        if body.presence_penalty or body.frequency_penalty:
            processors.append(AnswerPenalties(prompt_tokens, body.presence_penalty, body.frequency_penalty))
        if temperature == 0 or body.seed is None:
            settings.update(decoding_settings(temperature, top_p))
        else:  # the same distribution, drawn with the request's own generator and forced (greedy picks it)
            settings.update(decoding_settings(0))
            processors.append(SeededSampling(body.seed, temperature, top_p))
        if processors:
            settings["logits_processor"] = LogitsProcessorList(processors)
        stops = body.stop or []
        answer = Answer(
            config.model_name, chat, reads_prompt, prompt_tokens, tokenizer, stops, ends, logprobs, body.include_usage()
        )

        if config.explain:
            settings.update(explain=True, explain_top_k=config.explain)

        def generate(*criteria: StoppingCriteria, **extra: Any) -> Any:
            ending = [StopSequences(tokenizer, prompt_tokens, stops)] if stops else []
            output = guarded.generate(
                **tensors,
                **settings,
                **extra,
                stopping_criteria=StoppingCriteriaList([*ending, *criteria]),
                on_flag="stop",
                return_dict_in_generate=True,
            )
            if logprobs is not None:
                logprobs.finish(output.sequences)
            return output

        if not body.stream:
            output = await run_in_threadpool(gated, gate, generate)
            return answer.whole(output.sequences, output.safety, max_new)
        return StreamingResponse(
            stream(answer, generate, max_new, body.n),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def stream(answer: Answer, generate: Callable[..., Any], max_new: int, choices: int) -> AsyncIterator[str]:
        streamer = ChoicesStreamer(tokenizer, choices, ends)
        cancelled = threading.Event()
        result: dict[str, Any] = {}

        def work() -> None:
            try:
                result["output"] = gated(gate, lambda: generate(Cancelled(cancelled), streamer=streamer))
            except BaseException as err:  # reported in the stream: the status line is already sent
                result["error"] = err
                streamer.end()

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        texts = [StopText(answer.stops) for _ in range(choices)]
        try:
            for index in range(choices):
                yield answer.event(answer.chunk(index, role="assistant"))
            async for index, piece in iterate_in_threadpool(streamer):
                sendable = texts[index].feed(piece)
                if sendable:
                    yield answer.event(answer.chunk(index, content=sendable))
            await run_in_threadpool(worker.join)
            for index, text in enumerate(texts):
                rest = text.flush()
                if rest:
                    yield answer.event(answer.chunk(index, content=rest))
            if "error" in result:
                err = result["error"]
                yield answer.event(error_body(f"{type(err).__name__}: {err}", "server_error"))
            else:
                output = result["output"]
                ended = [(text.sent, text.found) for text in texts]
                for chunk in answer.last_chunks(output.sequences, output.safety, max_new, ended):
                    yield answer.event(chunk)
            yield "data: [DONE]\n\n"
        finally:
            cancelled.set()  # a client that went away stops its generation at the next token

    app.include_router(api)
    return app


def gated(gate: threading.BoundedSemaphore, work: Callable[[], Any]) -> Any:
    """``work()`` once a generation slot is free."""
    with gate:
        return work()


class BodyLimit:
    """ASGI middleware: a request body above ``limit`` bytes is answered 413 before a route reads it."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await self._too_large(receive, send)
            return
        # Read the body here, up to the limit, and hand it on: a route's parser would turn an error raised from
        # inside receive() into "error parsing the body".
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._too_large(receive, send)
                return
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices, as the server sends them

        await self.app(scope, replay, send)

    async def _too_large(self, receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
        response = JSONResponse(
            error_body(f"request body above {self.limit} bytes", "invalid_request_error"), status_code=413
        )
        await response({"type": "http"}, receive, send)

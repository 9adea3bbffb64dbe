"""``hf-lsad serve``: a live server on a free port with the tiny model and a two-headed guard, talked to by the
official ``openai`` client and by plain HTTP. Every answer's report is the one the prompt gets alone; every bad
request is a clear 4xx in the OpenAI error shape, and the server keeps serving."""

from __future__ import annotations

import contextlib
import copy
import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from tiny import PROMPTS, RUNNING_MAX_NEW, UNSAFE_PROMPTS, tiny_guard, tiny_running_guard, two_headed_guard
from transformers import GenerationConfig

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from hf_lsad.core.prompt_inputs import InputProfile  # noqa: E402
from hf_lsad.generation.model import GuardedModelForCausalLM  # noqa: E402
from hf_lsad.guard.types import SafetyReport  # noqa: E402
from hf_lsad.serving import ServeConfig, create_app, raw_prompt_note  # noqa: E402
from hf_lsad.serving.answer import Answer  # noqa: E402
from hf_lsad.serving.decoding import ChoicesStreamer, StopText, answer_ends  # noqa: E402

KEY = "sekret"
BENIGN, UNSAFE = PROMPTS[5], UNSAFE_PROMPTS[3]
LIMIT = 20_000
HI = b'{"messages": [{"role": "user", "content": "hi"}]}'


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(guarded, config):
    """A live server of ``guarded`` on a free port; yields the port."""
    port = free_port()
    app = create_app(guarded, config)
    running = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not running.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert running.started
    try:
        yield port
    finally:
        running.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server():
    model, tokenizer, _ = tiny_guard("prompt_last")
    guarded = GuardedModelForCausalLM(model, two_headed_guard(), tokenizer=tokenizer)
    config = ServeConfig(
        model_name="tiny-llama", api_key=KEY, max_tokens_limit=16, default_max_tokens=6, max_body_bytes=LIMIT
    )
    with serving(guarded, config) as port:
        yield port, guarded


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[0]}/v1", api_key=KEY, max_retries=0)


def alone(guarded, prompt):
    return guarded.screen([prompt])[0].to_json()


def assert_same_report(got, want):
    assert (got["flagged"], got["decided_by"], got["error"]) == (want["flagged"], want["decided_by"], want["error"])
    for head, verdict in want["heads"].items():
        assert got["heads"][head]["score"] == pytest.approx(verdict["score"], abs=1e-4), head


def request(port, method, path, body=None, *, key=KEY, raw=None, headers=None):
    """(status, parsed JSON) of one plain HTTP request."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    sent = {
        "Content-Type": "application/json",
        **({"Authorization": f"Bearer {key}"} if key else {}),
        **(headers or {}),
    }
    payload = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    connection.request(method, path, body=payload, headers=sent)
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, json.loads(data) if data else None


def chat_body(prompt, **extra):
    return {"model": "tiny-llama", "messages": [{"role": "user", "content": prompt}], "temperature": 0, **extra}


def test_chat_with_the_openai_client_benign_answered_unsafe_filtered(server, client):
    _, guarded = server
    answered = client.chat.completions.create(**chat_body(BENIGN, max_tokens=5))
    assert answered.choices[0].finish_reason in ("stop", "length") and answered.usage.completion_tokens >= 1
    assert_same_report(answered.model_extra["safety"]["prompt"], alone(guarded, BENIGN))
    filtered = client.chat.completions.create(**chat_body(UNSAFE, max_tokens=5))
    choice = filtered.choices[0]
    assert choice.finish_reason == "content_filter" and choice.message.content == ""
    report = filtered.model_extra["safety"]["prompt"]
    assert report["stopped"] and report["step"] == 0 and "harm" in report["decided_by"]
    assert_same_report(report, alone(guarded, UNSAFE))


def test_a_conversation_is_read_whole_as_screen_reads_it(server, client):
    """The server reads every turn of a conversation, the assistant's included, as ``screen(conversations)`` does
    (one home: ``conversation_token_ids``)."""
    _, guarded = server
    turns = [
        {"role": "user", "content": UNSAFE},
        {"role": "assistant", "content": "I can't help with that."},
        {"role": "user", "content": "Go on."},
    ]
    answered = client.chat.completions.create(model="tiny-llama", messages=turns, max_tokens=3, temperature=0)
    (want,) = guarded.screen([turns])
    assert_same_report(answered.model_extra["safety"]["prompt"], want.to_json())


def test_streaming_chat_ends_with_the_verdict(server, client):
    _, guarded = server
    for prompt, finish in ((BENIGN, ("stop", "length")), (UNSAFE, ("content_filter",))):
        chunks = list(client.chat.completions.create(**chat_body(prompt, max_tokens=5), stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason in finish
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert (text == "") == (prompt == UNSAFE)
        assert_same_report(chunks[-1].model_extra["safety"]["prompt"], alone(guarded, prompt))


def test_an_answer_ends_before_the_first_stop_sequence_it_writes_streamed_or_not(server, client):
    full = client.chat.completions.create(**chat_body(BENIGN, max_tokens=12)).choices[0].message.content
    assert len(full) >= 6, full
    stop = full[3:5]
    cut = full[: full.index(stop)]
    answer = client.chat.completions.create(**chat_body(BENIGN, max_tokens=12, stop=[stop, "never written"]))
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == (cut, "stop")
    assert answer.usage.completion_tokens < 12  # generation ended at the stop sequence
    chunks = list(client.chat.completions.create(**chat_body(BENIGN, max_tokens=12, stop=stop), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    unwritten = client.chat.completions.create(**chat_body(BENIGN, max_tokens=12, stop="never written"))
    assert unwritten.choices[0].message.content == full


def test_a_seed_gives_the_same_sampled_answer_whatever_other_requests_draw_meanwhile(server, client):
    def sampled(seed):
        body = chat_body(BENIGN, max_tokens=8, temperature=1.0, **({} if seed is None else {"seed": seed}))
        return client.chat.completions.create(**body).choices[0].message.content

    first = sampled(7)
    with ThreadPoolExecutor(4) as pool:  # seeded requests beside unseeded ones drawing from torch's generator
        answers = list(pool.map(sampled, [7, None, 7, None, 7, None, 7, None]))
    assert answers[::2] == [first] * 4
    assert len({sampled(seed) for seed in range(4)}) > 1  # the seed decides the draw
    assert sampled(-(2**63)) == sampled(-(2**63))


def greedy_steps(guarded, prompt, max_new, *, presence=0.0, frequency=0.0, bias=None, top=0):
    """The greedy answer under the OpenAI API's logit bias and penalties, computed token by token: each logit raised by
    its token's ``bias``, lowered by ``presence`` if the answer has written its token and by ``frequency`` per time it
    has. Per token written (the end-of-sequence id aside): its id, its log-probability under the model's own logits,
    and the ``top`` most likely (id, log-probability) pairs."""
    tokenizer = guarded.tokenizer
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    steps: list[tuple[int, float, list[tuple[int, float]]]] = []
    written: list[int] = []
    for _ in range(max_new):
        with torch.no_grad():
            logprobs = torch.log_softmax(guarded.model(input_ids=ids).logits[0, -1].float(), dim=-1)
        logits = logprobs.clone()  # a shift of every logit leaves the argmax where it is
        for token, raised in (bias or {}).items():
            logits[token] += raised
        for token in set(written):
            logits[token] -= presence + frequency * written.count(token)
        token = int(logits.argmax())
        if token == tokenizer.eos_token_id:
            break
        values, most_likely = logprobs.topk(top)
        steps.append((token, float(logprobs[token]), list(zip(most_likely.tolist(), values.tolist()))))
        written.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return steps


def answer_text(guarded, steps):
    return guarded.tokenizer.decode([token for token, _, _ in steps], skip_special_tokens=True)


@pytest.mark.parametrize(("presence", "frequency"), [(2.0, 0.0), (0.0, 2.0), (-2.0, -1.5)])
def test_presence_and_frequency_penalties_act_on_the_answers_own_tokens(server, client, presence, frequency):
    _, guarded = server
    plain = client.chat.completions.create(**chat_body(BENIGN, max_tokens=16)).choices[0].message.content
    body = chat_body(BENIGN, max_tokens=16, presence_penalty=presence, frequency_penalty=frequency)
    penalised = client.chat.completions.create(**body).choices[0].message.content
    assert penalised == answer_text(guarded, greedy_steps(guarded, BENIGN, 16, presence=presence, frequency=frequency))
    assert penalised != plain
    streamed = client.chat.completions.create(**body, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == penalised
    filtered = client.chat.completions.create(**chat_body(UNSAFE, max_tokens=16, presence_penalty=-2.0))
    assert (filtered.choices[0].finish_reason, filtered.choices[0].message.content) == ("content_filter", "")


def test_a_logit_bias_moves_the_answers_tokens_but_not_the_guards_stop(server, client):
    _, guarded = server
    tokenizer = guarded.tokenizer
    plain = client.chat.completions.create(**chat_body(BENIGN, max_tokens=8)).choices[0].message.content
    first = tokenizer(plain, add_special_tokens=False)["input_ids"][0]
    favoured = tokenizer(" bread", add_special_tokens=False)["input_ids"][-1]
    for bias in ({first: -100}, {favoured: 100, tokenizer.eos_token_id: -100}, {first: -3.5, favoured: 2}):
        body = chat_body(BENIGN, max_tokens=8, logit_bias={str(token): value for token, value in bias.items()})
        biased = client.chat.completions.create(**body).choices[0].message.content
        assert biased == answer_text(guarded, greedy_steps(guarded, BENIGN, 8, bias=bias))
        assert biased != plain
        streamed = client.chat.completions.create(**body, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == biased
    # the guard's processor runs after the bias: a token raised by 100 does not get past a stopped row
    body = chat_body(UNSAFE, max_tokens=8, logit_bias={str(favoured): 100, str(tokenizer.eos_token_id): -100})
    filtered = client.chat.completions.create(**body).choices[0]
    assert (filtered.finish_reason, filtered.message.content) == ("content_filter", "")


def assert_chat_logprobs(content, steps, tokenizer):
    assert [entry["token"] for entry in content] == [tokenizer.decode([token]) for token, _, _ in steps]
    for entry, (token, logprob, top) in zip(content, steps):
        assert entry["logprob"] == pytest.approx(logprob, abs=1e-4)
        assert bytes(entry["bytes"]) == tokenizer.decode([token]).encode()
        assert [t["token"] for t in entry["top_logprobs"]] == [tokenizer.decode([t]) for t, _ in top]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx([p for _, p in top], abs=1e-4)


def test_log_probabilities_are_the_models_own_for_each_token_of_the_answer(server, client):
    port, guarded = server
    tokenizer = guarded.tokenizer
    steps = greedy_steps(guarded, BENIGN, 8, top=3)
    body = chat_body(BENIGN, max_tokens=8, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**body).choices[0]
    content = whole.model_dump()["logprobs"]["content"]
    assert len(content) == len(steps) >= 1
    assert_chat_logprobs(content, steps, tokenizer)
    assert whole.message.content == answer_text(guarded, steps)
    # streamed, every token comes in the choice's last chunk, as it would whole; each of n choices has its own
    chunks = list(client.chat.completions.create(**body, stream=True, n=2))
    last = {c.choices[0].index: c.choices[0] for c in chunks if c.choices[0].finish_reason is not None}
    assert sum(c.choices[0].logprobs is not None for c in chunks) == 2
    for index in (0, 1):
        assert_chat_logprobs(last[index].model_dump()["logprobs"]["content"], steps, tokenizer)
    # sampled choices differ, and each lists its own tokens: a token among its position's most likely has their value
    body = chat_body(BENIGN, max_tokens=8, logprobs=True, top_logprobs=20, temperature=1.5, seed=1, n=2)
    choices = client.chat.completions.create(**body).choices
    assert choices[0].message.content != choices[1].message.content
    for choice in choices:
        content = choice.model_dump()["logprobs"]["content"]
        assert (
            tokenizer.decode(tokenizer.convert_tokens_to_ids([e["token"] for e in content])) == choice.message.content
        )
        for entry in content:
            top = {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
            assert top.get(entry["token"], entry["logprob"]) == pytest.approx(entry["logprob"], abs=1e-5)
    # before the request's bias: a token the bias chose has the model's own (lower) log-probability
    first = steps[0][0]
    biased = greedy_steps(guarded, BENIGN, 8, top=2, bias={first: -100})
    body = chat_body(BENIGN, max_tokens=8, logprobs=True, top_logprobs=2, logit_bias={str(first): -100})
    content = client.chat.completions.create(**body).choices[0].model_dump()["logprobs"]["content"]
    assert_chat_logprobs(content, biased, tokenizer)
    assert content[0]["logprob"] < content[0]["top_logprobs"][0]["logprob"]
    # without top_logprobs, none are listed; a stopped prompt lists no token
    plain = client.chat.completions.create(**chat_body(BENIGN, max_tokens=8, logprobs=True)).choices[0]
    assert [entry["top_logprobs"] for entry in plain.model_dump()["logprobs"]["content"]] == [[]] * len(steps)
    filtered = client.chat.completions.create(**chat_body(UNSAFE, max_tokens=8, logprobs=True)).choices[0]
    assert filtered.finish_reason == "content_filter" and filtered.model_dump()["logprobs"]["content"] == []
    # a completion gives them in the legacy shape
    turn = [{"role": "user", "content": BENIGN}]  # formatted as the guard reads prompts: not flagged
    formatted = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    status, answer = request(
        port, "POST", "/v1/completions", {"prompt": formatted, "temperature": 0, "max_tokens": 8, "logprobs": 2}
    )
    assert status == 200 and answer["choices"][0]["finish_reason"] != "content_filter"
    legacy = answer["choices"][0]["logprobs"]
    tokens = [tokenizer.decode([token]) for token, _, _ in steps]  # the same ids as the chat answer's
    assert legacy["tokens"] == tokens
    assert legacy["token_logprobs"] == pytest.approx([logprob for _, logprob, _ in steps], abs=1e-4)
    assert [list(top) for top in legacy["top_logprobs"]] == [
        [tokenizer.decode([t]) for t, _ in top[:2]] for *_, top in steps
    ]
    assert legacy["text_offset"] == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_log_probabilities_end_with_the_text_a_stop_sequence_cut(server, client):
    _, guarded = server
    tokenizer = guarded.tokenizer
    steps = greedy_steps(guarded, BENIGN, 12, top=1)
    full = answer_text(guarded, steps)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    for stream in (False, True):
        body = chat_body(BENIGN, max_tokens=12, logprobs=True, stop=[stop])
        if stream:
            chunks = list(client.chat.completions.create(**body, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            content = chunks[-1].choices[0].model_dump()["logprobs"]["content"]
        else:
            choice = client.chat.completions.create(**body).choices[0]
            text, content = choice.message.content, choice.model_dump()["logprobs"]["content"]
        assert text == full[: full.index(stop)]
        listed = [entry["token"] for entry in content]
        kept = [tokenizer.decode([token]) for token, _, _ in steps][: len(listed)]
        assert listed == kept and len(listed) < len(steps)
        assert len(tokenizer.decode([token for token, _, _ in steps[: len(listed) - 1]])) < len(text)
        assert len(tokenizer.decode([token for token, _, _ in steps[: len(listed)]])) >= len(text)


def test_a_byte_level_tokens_bytes_are_its_own_not_its_decoded_text():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_lsad.serving.answer import token_bytes

    backend = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    text = "héllo 😀"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode())  # one token per byte: the emoji's four bytes are four tokens
    read = token_bytes(tokenizer)
    assert b"".join(read(token) for token in ids) == text.encode()
    assert tokenizer.decode(ids[-1:]) == "\ufffd" and read(ids[-1]) == "😀".encode()[-1:]


def test_null_settings_are_the_defaults(server):
    port, _ = server
    nulls = {"n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None, "max_tokens": None}
    status, body = request(port, "POST", "/v1/chat/completions", chat_body(BENIGN, **nulls))
    assert status == 200 and len(body["choices"]) == 1, body
    _, plain = request(port, "POST", "/v1/chat/completions", chat_body(BENIGN))
    assert body["choices"][0]["message"] == plain["choices"][0]["message"]


def test_unsupported_fields_at_their_defaults_leave_the_answer_as_it_is(server, client):
    """Clients that spell out a default (plain text, no tools, one candidate, no echo) get the plain answer."""
    port, _ = server
    plain = client.chat.completions.create(**chat_body(BENIGN, max_tokens=4))
    spelt = client.chat.completions.create(
        **chat_body(BENIGN, max_tokens=4), response_format={"type": "text"}, tools=[], tool_choice="none"
    )
    assert spelt.choices[0].message.content == plain.choices[0].message.content
    completion = {"prompt": BENIGN, "max_tokens": 4}
    _, alone = request(port, "POST", "/v1/completions", completion)
    status, body = request(port, "POST", "/v1/completions", {**completion, "best_of": 1, "echo": False, "suffix": ""})
    assert status == 200 and body["choices"][0]["text"] == alone["choices"][0]["text"], body


def test_several_choices_are_rows_of_one_call_each_with_its_finish_and_report(server, client):
    _, guarded = server
    one = client.chat.completions.create(**chat_body(BENIGN, max_tokens=8))
    greedy = client.chat.completions.create(**chat_body(BENIGN, max_tokens=8, n=3))
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.message.content for c in greedy.choices} == {one.choices[0].message.content}  # greedy answers alike
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens
    for choice in greedy.choices:
        assert_same_report(choice.model_extra["safety"]["prompt"], alone(guarded, BENIGN))

    sampled = chat_body(BENIGN, max_tokens=8, n=3, temperature=1.0, seed=11)
    whole = client.chat.completions.create(**sampled)
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) > 1  # each row draws apart
    assert [c.message.content for c in client.chat.completions.create(**sampled).choices] == texts
    chunks = list(client.chat.completions.create(**sampled, stream=True, stream_options={"include_usage": True}))
    *chunks, usage = chunks  # the usage alone, choices empty, as the OpenAI API ends a stream that asks for it
    assert usage.choices == [] and usage.usage == whole.usage and all(c.usage is None for c in chunks)
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert_same_report(chunks[-1].model_extra["safety"]["prompt"], alone(guarded, BENIGN))
    plain = list(client.chat.completions.create(**sampled, stream=True))  # no usage unless asked, as the API
    assert [c.choices[0].delta.content for c in plain] == [c.choices[0].delta.content for c in chunks]
    assert all(c.usage is None for c in plain)

    stop = texts[1][2:4]  # written by the second choice: it ends there, the others as they would
    cut = client.chat.completions.create(**{**sampled, "stop": stop})
    assert [c.message.content for c in cut.choices] == [t[: t.index(stop)] if stop in t else t for t in texts]
    assert cut.choices[1].finish_reason == "stop"

    filtered = client.chat.completions.create(**chat_body(UNSAFE, max_tokens=8, n=2, temperature=1.0), stream=True)
    ends = [c for c in filtered if c.choices[0].finish_reason]
    assert [(c.choices[0].index, c.choices[0].finish_reason) for c in ends] == [
        (0, "content_filter"),
        (1, "content_filter"),
    ]


def test_each_choice_counts_its_own_tokens_not_the_padding_after_it_ended():
    _, tokenizer, _ = tiny_guard("prompt_last")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    words = tokenizer(" red green blue", add_special_tokens=False)["input_ids"]
    assert pad not in words and eos != pad
    prompt = [5, 6]
    rows = [
        [*prompt, words[0], eos, pad, pad],  # ended at EOS
        [*prompt, words[0], words[1], pad, pad],  # ended at a stop sequence: generate pads it
        [*prompt, words[1], words[2], words[0], words[1]],  # written to max_tokens
    ]
    answer = Answer("tiny", True, True, len(prompt), tokenizer, ["never"], [eos])
    report = SafetyReport(0.0, 1.0, False, 0, None)
    whole = answer.whole(torch.tensor(rows), [report] * 3, max_new=4)
    assert whole["usage"]["completion_tokens"] == 2 + 2 + 4
    assert [c["finish_reason"] for c in whole["choices"]] == ["stop", "stop", "length"]
    assert [c["message"]["content"] for c in whole["choices"]] == [
        tokenizer.decode(row[2:], skip_special_tokens=True) for row in rows
    ]


@pytest.mark.parametrize(
    ("config_eos", "tokenizer_eos", "ends"),
    [(None, 0, [0]), ([2, 7], 7, [2, 7]), (5, None, [5]), (None, None, [])],
)
def test_an_answer_ends_at_the_generation_configs_eos_and_the_tokenizers(config_eos, tokenizer_eos, ends):
    model = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=config_eos))
    assert answer_ends(model, SimpleNamespace(eos_token_id=tokenizer_eos)) == ends  # 0 is an id, not "none"


def test_the_choices_streamer_gives_each_row_its_text_up_to_its_end():
    _, tokenizer, _ = tiny_guard("prompt_last")
    eos = tokenizer.eos_token_id
    words = tokenizer(" red green blue", add_special_tokens=False)["input_ids"]
    rows = [[words[0], eos, words[1]], [words[1], words[2], words[0]]]  # row 0 ends; generate pads it (here: a word)
    streamer = ChoicesStreamer(tokenizer, 2, [eos])
    streamer.put(torch.tensor([[5, 6], [5, 6]]))  # the prompt
    for step in range(3):
        streamer.put(torch.tensor([rows[0][step], rows[1][step]]))
    streamer.end()
    texts = ["", ""]
    for index, piece in streamer:
        texts[index] += piece
    assert texts == [tokenizer.decode(rows[0][:1]), tokenizer.decode(rows[1])]


@pytest.mark.parametrize(
    ("pieces", "stops", "sent"),
    [
        (["ab", "c", "de"], ["cd"], ["ab", "", ""]),  # "c" waits: the next piece completes the stop
        (["ax", "yb"], ["xyz"], ["a", "xyb"]),  # "x" waits, then goes with the piece that rules the stop out
        (["hello wor", "ld"], ["o w", "xx"], ["hell", ""]),
        (["text"], ["t"], [""]),
    ],
)
def test_streamed_text_is_sent_as_far_as_no_stop_sequence_could_begin(pieces, stops, sent):
    text = StopText(stops)
    assert [text.feed(piece) for piece in pieces] == sent
    assert text.flush() == ""


def test_completions_and_moderations(server, client):
    port, guarded = server
    completion = client.completions.create(model="tiny-llama", prompt="once upon a time", max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason in ("stop", "length", "content_filter")
    assert "prompt" in completion.model_extra["safety"]
    turn = [{"role": "user", "content": BENIGN}]  # the prompt formatted as the guard reads prompts: not flagged
    formatted = guarded.tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    settings = dict(model="tiny-llama", prompt=formatted, max_tokens=6, temperature=1.0, seed=5, n=2)
    pair = client.completions.create(**settings)
    assert [c.index for c in pair.choices] == [0, 1] and pair.choices[0].text != pair.choices[1].text
    streamed = ["", ""]
    for chunk in client.completions.create(**settings, stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == [c.text for c in pair.choices]
    moderation = client.moderations.create(model="tiny-llama", input=[BENIGN, UNSAFE])
    assert [r.flagged for r in moderation.results] == [alone(guarded, p)["flagged"] for p in (BENIGN, UNSAFE)]
    status, body = request(port, "POST", "/v1/moderations", {"input": UNSAFE})
    result = body["results"][0]
    assert status == 200 and set(result["categories"]) == {"anomaly", "harm"} and result["categories"]["harm"]
    assert result["category_scores"]["harm"] == pytest.approx(alone(guarded, UNSAFE)["heads"]["harm"]["score"])
    # a list of text parts is one input, as the OpenAI API reads multi-modal inputs (it was refused, item 0 an object)
    parts = [{"type": "text", "text": UNSAFE[:9]}, {"type": "text", "text": UNSAFE[9:]}]
    moderation = client.moderations.create(model="tiny-llama", input=parts)
    assert len(moderation.results) == 1 and moderation.results[0].flagged == result["flagged"]
    assert moderation.results[0].category_scores.model_extra == result["category_scores"]


def test_a_server_that_explains_names_the_words_behind_each_flag():
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = two_headed_guard()
    guard.budget.thresholds[0] = 1e9  # the anomaly head flags nothing: the harm head decides the unsafe prompts
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    with serving(guarded, ServeConfig(model_name="tiny-llama", default_max_tokens=4, explain=2)) as port:
        status, body = request(port, "POST", "/v1/chat/completions", chat_body(UNSAFE), key=None)
        report = body["safety"]["prompt"]
        assert status == 200 and body["choices"][0]["finish_reason"] == "content_filter"
        (alone,) = guarded.screen([UNSAFE], explain=True, top_k=2)
        assert [t["text"] for t in report["tokens"]] == [tokenizer.decode([t.token_id]) for t in alone.tokens]
        status, body = request(port, "POST", "/v1/chat/completions", chat_body(BENIGN), key=None)
        assert status == 200 and not body["safety"]["prompt"]["flagged"] and "tokens" not in body["safety"]["prompt"]
        status, body = request(port, "POST", "/v1/moderations", {"input": [UNSAFE, BENIGN]}, key=None)
        flagged, benign = (result["hf_lsad"] for result in body["results"])
        assert len(flagged["tokens"]) == 2 and "tokens" not in benign
    with pytest.raises(ValueError, match="explain must be a number of tokens"):
        ServeConfig(model_name="tiny-llama", explain=-1)


def test_a_developer_turn_is_the_system_turn(server):
    """The OpenAI API's newer name for the system turn: read as screen() reads it, one home for both."""
    port, guarded = server
    turns = [{"role": "system", "content": "You are a support bot."}, {"role": "user", "content": BENIGN}]
    developer = [{"role": "developer", "content": "You are a support bot."}, turns[1]]
    status, body = request(port, "POST", "/v1/chat/completions", {"messages": developer, "max_tokens": 1})
    assert status == 200, body
    assert_same_report(body["choices"][0]["safety"]["prompt"], guarded.screen([turns])[0].to_json())


def test_models_and_health(server, client):
    port, _ = server
    assert [m.id for m in client.models.list()] == ["tiny-llama"]
    health = {"status": "ok", "model": "tiny-llama", "heads": ["anomaly", "harm"]}
    assert request(port, "GET", "/health", key=None) == (200, health)


BAD_REQUESTS = [
    ("malformed JSON", {"raw": b'{"messages": [}'}, 400, "JSON"),
    ("missing messages", {"body": {"model": "tiny-llama"}}, 400, "messages"),
    ("wrong type", {"body": chat_body(BENIGN, max_tokens="many")}, 400, "max_tokens"),
    ("a switch for a count", {"body": chat_body(BENIGN, max_tokens=True)}, 400, "max_tokens: Input should be"),
    ("a count with a fraction", {"body": chat_body(BENIGN, max_completion_tokens=2.0)}, 400, "max_completion_tokens"),
    ("a temperature in quotes", {"body": chat_body(BENIGN, temperature="0.7")}, 400, "temperature"),
    ("a NaN temperature", {"raw": HI[:-1] + b', "temperature": NaN}'}, 400, "temperature: Input should be a finite"),
    ("an infinite top_p", {"raw": HI[:-1] + b', "top_p": Infinity}'}, 400, "top_p: Input should be a finite"),
    ("stream as text", {"body": chat_body(BENIGN, stream="yes")}, 400, "stream"),
    ("empty message list", {"body": {"messages": []}}, 400, "messages"),
    ("content not text", {"body": {"messages": [{"role": "user", "content": 3}]}}, 400, "content: a string or a list"),
    (
        "an image part",
        {"body": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}},
        400,
        "messages.0.content: part 0 is a part of type 'image_url': only text parts",
    ),
    ("an empty user turn", {"body": chat_body("")}, 400, "messages.0.content: a user turn is empty"),
    (
        "a user turn of blank parts",
        {
            "body": {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": " "}, {"type": "text", "text": "\n"}]}
                ]
            }
        },
        400,
        "messages.0.content: a user turn is empty: whitespace only (2 characters)",
    ),
    ("an empty prompt", {"path": "/v1/completions", "body": {"prompt": ""}}, 400, "prompt: empty"),
    # JSON's \\ud800 escape decodes to a lone surrogate, which no tokenizer encodes: a 500, or a 400 naming its error
    *[
        (
            f"a lone surrogate: {case}",
            {"path": path, "raw": raw},
            400,
            f"{says}not Unicode text: a lone surrogate (U+D800)",
        )
        for case, path, raw, says in [
            ("user", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "content: "),
            (
                "system",
                "/v1/chat/completions",
                b'{"messages": [{"role": "system", "content": "a\\ud800"}, {"role": "user", "content": "hi"}]}',
                "messages.0.content: ",
            ),
            ("prompt", "/v1/completions", b'{"prompt": "a\\ud800"}', "prompt: "),
            ("moderation", "/v1/moderations", b'{"input": ["hi", "a\\ud800"]}', "input: item 1 is "),
            ("text part", "/v1/moderations", b'{"input": [{"type": "text", "text": "a\\ud800"}]}', "input: part 0 is "),
        ]
    ],
    ("a blank prompt", {"path": "/v1/completions", "body": {"prompt": "  "}}, 400, "prompt: empty: whitespace only"),
    ("moderation input not text", {"path": "/v1/moderations", "body": {"input": [1]}}, 400, "input: item 0 is"),
    (
        "moderation of an image",
        {"path": "/v1/moderations", "body": {"input": [{"type": "image_url", "image_url": {"url": "x"}}]}},
        400,
        "input: part 0 is a part of type 'image_url': only text parts",
    ),
    (
        "moderation of texts and parts",
        {"path": "/v1/moderations", "body": {"input": ["hi", {"type": "text", "text": "hi"}]}},
        400,
        "input: item 1 is an object, not a string",
    ),
    (
        "moderation of an empty part",
        {"path": "/v1/moderations", "body": {"input": [{"type": "text", "text": " "}]}},
        400,
        "input: prompt 0 is empty",
    ),
    ("two prompts", {"path": "/v1/completions", "body": {"prompt": ["a", "b"]}}, 400, "prompt: one prompt per request"),
    ("unknown role", {"body": {"messages": [{"role": "robot", "content": "hi"}]}}, 400, "role"),
    ("max_tokens above the limit", {"body": chat_body(BENIGN, max_tokens=17)}, 400, "at most 16"),
    ("more choices than the limit", {"body": chat_body(BENIGN, n=5)}, 400, "n: at most 4 choices, got 5"),
    ("no choice", {"body": chat_body(BENIGN, n=0)}, 400, "n: Input should be greater than or equal to 1"),
    ("five stop sequences", {"body": chat_body(BENIGN, stop=list("abcde"))}, 400, "at most 4 stop sequences, got 5"),
    ("an empty stop sequence", {"body": chat_body(BENIGN, stop=["x", ""])}, 400, "stop: a stop sequence is empty"),
    ("a stop sequence not text", {"body": chat_body(BENIGN, stop=[1])}, 400, "stop: item 0 is a number"),
    ("a seed with a fraction", {"body": chat_body(BENIGN, seed=1.5)}, 400, "seed: Input should be a valid int"),
    ("a seed beyond 64 bits", {"body": chat_body(BENIGN, seed=2**64)}, 400, "seed: Input should be less than"),
    (
        "an echo",
        {"path": "/v1/completions", "body": {"prompt": "a", "echo": True}},
        400,
        "not supported by hf-lsad serve: echo (it takes only false or null)",
    ),
    (
        "a JSON answer",
        {"body": chat_body(BENIGN, response_format={"type": "json_object"})},
        400,
        'response_format (it takes only {"type": "text"} or {} or null)',
    ),
    ("tools", {"body": chat_body(BENIGN, tools=[{"type": "function", "function": {"name": "f"}}])}, 400, "tools ("),
    ("a tool choice", {"body": chat_body(BENIGN, tool_choice="auto")}, 400, 'tool_choice (it takes only "none" or'),
    ("best of two", {"path": "/v1/completions", "body": {"prompt": "a", "best_of": 2}}, 400, "best_of (it takes"),
    # answered in text alone before, as if asked for it
    ("audio out", {"body": chat_body(BENIGN, modalities=["text", "audio"])}, 400, 'modalities (it takes only ["text"]'),
    ("a voice", {"body": chat_body(BENIGN, audio={"voice": "alloy"})}, 400, "audio (it takes only null)"),
    ("a web search", {"body": chat_body(BENIGN, web_search_options={})}, 400, "web_search_options (it takes only"),
    ("usage of no stream", {"body": chat_body(BENIGN, stream_options={"include_usage": True})}, 400, "only allowed"),
    ("best of true", {"path": "/v1/completions", "body": {"prompt": "a", "best_of": True}}, 400, "best_of (it takes"),
    (
        "a suffix",
        {"path": "/v1/completions", "body": {"prompt": "a", "suffix": "end"}},
        400,
        'suffix (it takes only ""',
    ),
    ("top log-probabilities alone", {"body": chat_body(BENIGN, top_logprobs=2)}, 400, "needs logprobs: true"),
    ("too many top tokens", {"body": chat_body(BENIGN, logprobs=True, top_logprobs=21)}, 400, "top_logprobs: Input"),
    ("log-probabilities as text", {"body": chat_body(BENIGN, logprobs="yes")}, 400, "logprobs: Input should be"),
    (
        "a completion's top tokens above 5",
        {"path": "/v1/completions", "body": {"prompt": "a", "logprobs": 6}},
        400,
        "logprobs: Input should be less than or equal to 5",
    ),
    ("a logit bias list", {"body": chat_body(BENIGN, logit_bias=[5])}, 400, "logit_bias: an object of token ids"),
    ("a bias of a word", {"body": chat_body(BENIGN, logit_bias={"bread": 3})}, 400, "'bread' is not a token id"),
    ("a negative token id", {"body": chat_body(BENIGN, logit_bias={"-5": 3})}, 400, "'-5' is not a token id"),
    ("a bias above 100", {"body": chat_body(BENIGN, logit_bias={"5": 101})}, 400, "token 5: the bias is 101, not"),
    ("a bias as a switch", {"body": chat_body(BENIGN, logit_bias={"5": True})}, 400, "the bias is a boolean, not"),
    ("a bias as text", {"body": chat_body(BENIGN, logit_bias={"5": "3"})}, 400, "the bias is a string, not"),
    ("a NaN bias", {"raw": HI[:-1] + b', "logit_bias": {"5": NaN}}'}, 400, "the bias is nan, not"),
    (
        "a token beyond the vocabulary",
        {"body": chat_body(BENIGN, logit_bias={"5": 1, "100000": -100})},
        400,
        "logit_bias: token ids [100000] are beyond the model's vocabulary (ids 0 to",
    ),
    ("a penalty above 2", {"body": chat_body(BENIGN, presence_penalty=2.5)}, 400, "presence_penalty: Input should be"),
    ("a penalty as text", {"body": chat_body(BENIGN, frequency_penalty="1")}, 400, "frequency_penalty: Input should"),
    ("prompt beyond the context", {"body": chat_body("word " * 600)}, 400, "context"),
    (
        "moderation beyond the context",
        {"path": "/v1/moderations", "body": {"input": [BENIGN, "word " * 600]}},
        400,
        "context",
    ),
    ("wrong key", {"body": chat_body(BENIGN), "key": "guess"}, 401, "API key"),
    ("no key", {"body": chat_body(BENIGN), "key": None}, 401, "API key"),
    ("oversize body", {"body": chat_body("x" * (LIMIT + 1))}, 413, "above"),
    ("oversize body, no length header", {"body": chat_body("x" * (LIMIT + 1)), "chunked": True}, 413, "above"),
]


@pytest.mark.parametrize(("case", "spec", "status", "says"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_are_clear_errors_and_the_server_keeps_serving(server, case, spec, status, says):
    port, _ = server
    if spec.get("chunked"):
        got, body = chunked_post(port, json.dumps(spec["body"]).encode())
    else:
        path = spec.get("path", "/v1/chat/completions")
        got, body = request(port, "POST", path, spec.get("body"), raw=spec.get("raw"), key=spec.get("key", KEY))
    assert got == status and says in body["error"]["message"], body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert request(port, "POST", "/v1/chat/completions", chat_body(BENIGN, max_tokens=2))[0] == 200


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"max_tokens_limit": 0}, "max_tokens_limit must be a positive integer, got 0"),
        ({"default_max_tokens": 0}, "default_max_tokens must be a positive integer, got 0"),
        ({"max_body_bytes": -1}, "max_body_bytes must be a positive integer, got -1"),
        ({"max_concurrency": 0}, "max_concurrency must be a positive integer, got 0"),
        ({"max_moderation_inputs": 0}, "max_moderation_inputs must be a positive integer, got 0"),
        ({"default_max_tokens": 65, "max_tokens_limit": 64}, "default_max_tokens must not exceed max_tokens_limit"),
    ],
)
def test_limits_that_would_refuse_every_request_are_refused_up_front(limits, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(model_name="tiny-llama", **limits)


def chunked_post(port, payload):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.putrequest("POST", "/v1/chat/completions")
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "Transfer-Encoding": "chunked"}
    for name, value in headers.items():
        connection.putheader(name, value)
    connection.endheaders()
    for start in range(0, len(payload), 4096):
        piece = payload[start : start + 4096]
        connection.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
    connection.send(b"0\r\n\r\n")
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def test_a_client_that_disconnects_mid_stream_does_not_stop_the_server(server):
    port, _ = server
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps(chat_body(BENIGN, max_tokens=16, stream=True)).encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    connection.request("POST", "/v1/chat/completions", body=body, headers=headers)
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    assert request(port, "GET", "/v1/models")[0] == 200
    assert request(port, "POST", "/v1/chat/completions", chat_body(BENIGN, max_tokens=2))[0] == 200


def test_concurrent_requests_each_get_their_own_report(server, client):
    _, guarded = server
    prompts = [*PROMPTS[:6], *UNSAFE_PROMPTS[:6]]

    def ask(prompt):
        stream = prompt in UNSAFE_PROMPTS[:3] or prompt in PROMPTS[:3]
        if stream:
            return list(client.chat.completions.create(**chat_body(prompt, max_tokens=4), stream=True))[-1]
        return client.chat.completions.create(**chat_body(prompt, max_tokens=4))

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(ask, prompts))
    for prompt, answer in zip(prompts, answers):
        assert_same_report(answer.model_extra["safety"]["prompt"], alone(guarded, prompt))


def test_serve_without_the_extra_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    from hf_lsad.cli.main import entry

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    with pytest.raises(SystemExit) as info:
        entry(["serve"])
    assert info.value.code == 2 and "pip install 'hf-lsad[serve]'" in capsys.readouterr().err


def test_an_address_serve_cannot_listen_on_fails_before_the_model_loads(monkeypatch, capsys):
    from hf_lsad.capture import pretrained
    from hf_lsad.cli.main import entry

    monkeypatch.setattr(pretrained, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    with socket.socket() as held:  # another server's port: uvicorn failed after the model had loaded
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            entry(["serve", "--port", str(port)])
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert info.value.code == 2 and error.startswith("hf-lsad serve: error: argument --port: cannot listen on")
        assert error.endswith("another server holds it: stop it, or choose another")
    with pytest.raises(SystemExit) as info:
        entry(["serve", "--host", "192.0.2.1"])  # TEST-NET-1: an address no machine here has
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2 and "argument --host: '192.0.2.1' is not an address of this machine" in error


def test_a_response_a_running_guard_stops_mid_way_ends_with_content_filter():
    from hf_lsad.capture.collect import encode_prompts
    from hf_lsad.guard import SafetyGuard

    model, tokenizer, fit, _ = tiny_running_guard()
    guard = SafetyGuard(copy.deepcopy(fit.guard.config), fit.guard.detector, fit.guard.sae)  # threshold set below
    guard.running = fit.guard.running
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    prompts = PROMPTS[:8]

    def alone(prompt):
        inputs = encode_prompts(tokenizer, [prompt])
        settings = dict(max_new_tokens=RUNNING_MAX_NEW, do_sample=False, return_dict_in_generate=True)
        return guarded.generate(**inputs, **settings, on_flag="stop").safety[0]

    # About half flagged; between two rows' scores, so that round-off between batchings cannot flip a row.
    scores = sorted(alone(p).score for p in prompts)
    guard.config.threshold = (scores[len(prompts) // 2 - 1] + scores[len(prompts) // 2]) / 2
    want = {p: alone(p) for p in prompts}
    with serving(guarded, ServeConfig(model_name="tiny-llama", default_max_tokens=RUNNING_MAX_NEW)) as port:
        answers = {p: request(port, "POST", "/v1/chat/completions", chat_body(p), key=None)[1] for p in prompts}
        pairs = {p: request(port, "POST", "/v1/chat/completions", chat_body(p, n=2), key=None)[1] for p in prompts}
    for prompt, answer in pairs.items():  # each choice is a row the running guard reads on its own
        expected = want[prompt]
        for choice in answer["choices"]:
            report = choice["safety"]["response"]
            assert (report["flagged"], report["step"], report["stopped"]) == (
                expected.flagged,
                expected.step,
                expected.stopped,
            )
            assert (choice["finish_reason"] == "content_filter") == expected.stopped
    stopped = 0
    for prompt, answer in answers.items():
        report, choice = answer["safety"]["response"], answer["choices"][0]
        expected = want[prompt]
        assert (report["flagged"], report["step"], report["stopped"]) == (
            expected.flagged,
            expected.step,
            expected.stopped,
        )
        if report["stopped"]:
            stopped += 1
            assert choice["finish_reason"] == "content_filter" and report["step"] >= 1
        else:
            assert choice["finish_reason"] in ("stop", "length")
    assert stopped >= 1


def test_the_operator_is_told_at_start_that_raw_completions_are_out_of_a_chat_guards_distribution():
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = copy.deepcopy(two_headed_guard())
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    assert raw_prompt_note(guarded) is None  # a guard that did not record how its prompts were given
    guard.inputs = InputProfile("raw", max_prompt_tokens=64)
    assert raw_prompt_note(guarded) is None
    guard.inputs = InputProfile("chat_template", max_prompt_tokens=64)
    note = raw_prompt_note(guarded)
    assert note is not None and "/v1/completions reads each prompt as it is" in note and "chat template" in note

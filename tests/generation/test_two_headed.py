"""A two-headed guard on every path: screen, report, stop, on_step, threads, pipeline, Hub, and add_head.

Table: path (screen, report, stop, on_step) x padding side (left, right) x threads (1, 4). Each row of a batched
call gets the verdict it gets alone (every head's score within 1e-4, the same deciding heads), and on the stop
path every row flagged alone is stopped before its first token.
"""

from __future__ import annotations

import copy
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

import pytest
import torch
from tiny import MIXED_BATCH, PROMPTS, UNSAFE_PROMPTS, tiny_guard, two_headed_guard
from transformers import pipeline

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.core.splits import split_of
from hf_lsad.data import is_reserved, load_pool
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.heads.bundled import release_rows
from hf_lsad.guard.heads.training import NEW_HEAD_SHARE, NEW_HEAD_SHARE_BESIDE_ANOMALY, add_head

UNDER_TEST = [*MIXED_BATCH, PROMPTS[3], UNSAFE_PROMPTS[50 % len(UNSAFE_PROMPTS)], UNSAFE_PROMPTS[7], "x y z"]
PATHS = ("screen", "report", "stop", "on_step")


@cache
def guarded() -> GuardedModelForCausalLM:
    model, tokenizer, _ = tiny_guard("prompt_last")
    return GuardedModelForCausalLM(model, two_headed_guard(), tokenizer=tokenizer)


def call(
    model: GuardedModelForCausalLM, prompts: list[str], path: str, padding_side: str = "left", explain: bool = False
) -> list[Any]:
    inputs = encode_prompts(model.tokenizer, prompts, padding_side=padding_side)
    if path == "screen":
        return model.screen(inputs["input_ids"], inputs["attention_mask"], explain=explain)
    options: dict[str, Any] = {"on_flag": "stop" if path == "stop" else "report", "explain": explain}
    if path == "on_step":
        options["on_step"] = lambda verdict: None
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, **options)
    out.safety[0] = out.safety[0]._replace()  # reports are plain tuples
    if path == "stop":
        first = out.sequences[:, inputs["input_ids"].shape[1]]
        for report, token in zip(out.safety, first.tolist()):
            assert report.stopped == report.flagged
            if report.flagged:
                assert token == model.tokenizer.eos_token_id  # no token of its own
    return out.safety


@cache
def alone(prompt: str) -> Any:
    return call(guarded(), [prompt], "report")[0]


def same_verdict(got: Any, expected: Any) -> None:
    assert got.flagged == expected.flagged and got.decided_by == expected.decided_by
    assert got.reading == expected.reading
    for a, b in zip(got.heads, expected.heads):
        assert a.name == b.name and a.score == pytest.approx(b.score, rel=1e-4, abs=1e-4)


def test_both_verdicts_occur_under_test():
    verdicts = {alone(p).flagged for p in UNDER_TEST}
    assert verdicts == {True, False}
    assert any(alone(p).decided_by == ("harm",) or "harm" in alone(p).decided_by for p in UNDER_TEST)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("path", PATHS)
def test_every_row_gets_its_verdict_alone(path, padding_side, threads):
    model = guarded()
    expected = [alone(p) for p in UNDER_TEST]

    def work(_: int) -> None:
        for _ in range(3):
            for got, want in zip(call(model, UNDER_TEST, path, padding_side), expected):
                same_verdict(got, want)

    if threads == 1:
        work(0)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
    assert threading.active_count() >= 1


@cache
def harm_decides() -> GuardedModelForCausalLM:
    """The two-headed guard with an anomaly head that flags nothing: the supervised head decides the unsafe rows."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = two_headed_guard()
    budget = copy.deepcopy(guard.budget)
    budget.thresholds[0] = 1e9
    guard.set_budget(budget)
    return GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)


@cache
def explained_alone(prompt: str) -> Any:
    return call(harm_decides(), [prompt], "report", explain=True)[0]


def same_tokens(got: Any, expected: Any) -> None:
    """The same tokens named at the same positions (among the row's real tokens) in the same order."""
    assert (got.tokens is None) == (expected.tokens is None)
    for a, b in zip(got.tokens or (), expected.tokens or (), strict=True):
        assert (a.token_id, a.position) == (b.token_id, b.position)
        assert a.contribution == pytest.approx(b.contribution, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("path", PATHS)
def test_every_path_names_the_tokens_each_row_gets_alone(path, padding_side):
    model = harm_decides()
    inputs = encode_prompts(model.tokenizer, UNDER_TEST, padding_side=padding_side)
    reports = call(model, UNDER_TEST, path, padding_side, explain=True)
    assert any(r.tokens for r in reports) and not all(r.tokens for r in reports)
    for row, (report, prompt) in enumerate(zip(reports, UNDER_TEST)):
        same_verdict(report, explained_alone(prompt))
        assert (report.tokens is not None) == (report.explained_head == "harm")
        same_tokens(report, explained_alone(prompt))
        real = inputs["input_ids"][row][inputs["attention_mask"][row].bool()]
        assert all(real[t.position] == t.token_id for t in report.tokens or ())


def test_stop_with_several_sequences_per_prompt():
    model = guarded()
    inputs = encode_prompts(model.tokenizer, UNDER_TEST)
    out = model.generate(
        **inputs, max_new_tokens=3, do_sample=True, num_return_sequences=2, on_flag="stop", return_dict_in_generate=True
    )
    assert len(out.safety) == 2 * len(UNDER_TEST)
    for i, report in enumerate(out.safety):
        same_verdict(report, alone(UNDER_TEST[i // 2]))
    options: dict[str, Any] = {"do_sample": True, "num_return_sequences": 2, "on_flag": "stop", "explain": True}
    explained = harm_decides().generate(**inputs, max_new_tokens=3, return_dict_in_generate=True, **options).safety
    assert any(r.tokens for r in explained)
    for i, report in enumerate(explained):
        same_tokens(report, explained_alone(UNDER_TEST[i // 2]))


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_beam_search_reports_each_returned_sequence_its_prompt_verdict(padding_side):
    """Beam search repeats each prompt once per beam in its prefill and returns its best sequences: each returned
    sequence gets its prompt's verdict and tokens, and the sequences are plain beam search's."""
    model = harm_decides()
    inputs = encode_prompts(model.tokenizer, UNDER_TEST, padding_side=padding_side)
    options: dict[str, Any] = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 3, "do_sample": False}
    out = model.generate(**inputs, **options, explain=True, return_dict_in_generate=True)
    plain = model.model.generate(**inputs, **options, pad_token_id=model.tokenizer.pad_token_id)
    assert torch.equal(out.sequences, plain)
    assert len(out.safety) == 2 * len(UNDER_TEST)
    assert any(r.flagged for r in out.safety) and not all(r.flagged for r in out.safety)
    for i, report in enumerate(out.safety):
        same_verdict(report, explained_alone(UNDER_TEST[i // 2]))
        same_tokens(report, explained_alone(UNDER_TEST[i // 2]))
    stopped = model.generate(**inputs, **options, on_flag="stop", explain=True, return_dict_in_generate=True)
    start, eos = inputs["input_ids"].shape[1], model.tokenizer.eos_token_id
    for i, report in enumerate(stopped.safety):
        same_verdict(report, explained_alone(UNDER_TEST[i // 2]))
        same_tokens(report, explained_alone(UNDER_TEST[i // 2]))
        assert report.stopped == report.flagged
        if report.flagged:  # every returned sequence of a flagged prompt ends at once
            assert stopped.sequences[i, start] == eos
        else:
            assert torch.equal(stopped.sequences[i], plain[i, : stopped.sequences.shape[1]])


def test_pipeline_reports_every_head():
    model = guarded()
    pipe = pipeline("text-generation", model=model, tokenizer=copy.deepcopy(model.tokenizer))
    outputs = pipe([[{"role": "user", "content": p}] for p in UNDER_TEST[:4]], max_new_tokens=3, do_sample=False)
    for out, prompt in zip(outputs, UNDER_TEST[:4]):
        same_verdict(out[0]["safety"], alone(prompt))


def test_push_and_pull_at_a_revision_bit_exact(hub_server, hub_cache):
    repo_id = f"hf-lsad-org/two-heads-{uuid.uuid4().hex[:8]}"
    guard = guarded().guard
    first = guard.push_to_hub(repo_id)
    changed = two_headed_guard(target_fpr=0.1)
    changed.push_to_hub(repo_id, commit_message="a tighter budget")
    pulled = SafetyGuard.from_pretrained(repo_id, revision=first.oid, cache_dir=hub_cache)
    assert pulled.budget == guard.budget and pulled.head_names == guard.head_names
    for name, tensor in guard.state_dict().items():
        assert torch.equal(tensor, pulled.state_dict()[name]), name
    latest = SafetyGuard.from_pretrained(repo_id, cache_dir=hub_cache)
    assert latest.budget.target_fpr == 0.1
    model, tokenizer, _ = tiny_guard("prompt_last")
    reloaded = GuardedModelForCausalLM(model, pulled, tokenizer=tokenizer)
    for got, prompt in zip(call(reloaded, UNDER_TEST, "stop"), UNDER_TEST):
        same_verdict(got, alone(prompt))
    card = hub_cache.parent / "card.md"
    card.write_text(guard.model_card().content)
    assert "| `harm` |" in card.read_text() and "any** head" in card.read_text()


def test_add_head_learns_a_category_from_100_rows_and_keeps_the_budget():
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = two_headed_guard(target_fpr=0.1)
    rows = [f"what is the internal codename of project {w} number {i}?" for i in range(70) for w in ("alpha",)]
    rows += [f"tell me the secret launch date of project bluebird {i}" for i in range(80)]
    unsafe, held_out = rows[::3] + rows[1::3], rows[2::3]  # 100 to fit, 50 held out
    budget = add_head(
        model, tokenizer, guard, "secrets", unsafe, share=1 / 3, benign_per_pool=150, threshold_rows=300, progress=False
    )
    assert budget.heads == ["anomaly", "harm", "secrets"] and budget.shares[2] == pytest.approx(1 / 3)
    assert budget.shares[0] / budget.shares[1] == pytest.approx(1.0)  # the others keep their proportions
    reads = guarded_reads(model, tokenizer, guard, held_out)
    reports = guard.reports(reads)
    assert sum("secrets" in r.decided_by for r in reports) / len(reports) >= 0.9
    chat = [p.text for p in load_pool("chat") if split_of(p.id) == "test"][:300]
    flagged = guard(guarded_reads(model, tokenizer, guard, chat)).flagged.float().mean().item()
    assert flagged <= budget.target_fpr + 0.05  # held-out chat: the target, within sampling error of 300 rows


def test_a_new_head_takes_a_small_share_by_default_and_the_other_heads_keep_the_rest():
    """By default a head added beside supervised heads takes NEW_HEAD_SHARE of the budget, and one added to an
    anomaly-only guard NEW_HEAD_SHARE_BESIDE_ANOMALY; the heads there before keep their proportions of the rest, so
    their thresholds move less than at a larger share."""
    model, tokenizer, anomaly_only = tiny_guard("prompt_last")
    unsafe = [f"tell me the secret launch date of project bluebird {i}" for i in range(12)]
    kwargs = dict(benign_per_pool=20, threshold_rows=120, progress=False)
    budget = add_head(model, tokenizer, copy.deepcopy(anomaly_only), "secrets", unsafe, **kwargs)
    assert budget.shares == pytest.approx([1 - NEW_HEAD_SHARE_BESIDE_ANOMALY, NEW_HEAD_SHARE_BESIDE_ANOMALY])
    before = two_headed_guard(target_fpr=0.1).budget
    thresholds = {}
    for share in (None, 1 / 3):
        budget = add_head(model, tokenizer, two_headed_guard(target_fpr=0.1), "secrets", unsafe, share=share, **kwargs)
        expected = NEW_HEAD_SHARE if share is None else share
        assert budget.shares == pytest.approx([s * (1 - expected) for s in before.shares] + [expected])
        thresholds[share] = budget.thresholds
    assert all(small <= large for small, large in zip(thresholds[None][:2], thresholds[1 / 3][:2]))
    assert thresholds[None][2] >= thresholds[1 / 3][2]


def test_add_head_keeps_the_bundled_rows_in_a_cache(tmp_path):
    """A second head with the same reads runs the model over its own prompts alone, and fits what a run without the
    cache fits (the bundled rows are batched apart from the user's in both)."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    unsafe = [f"tell me the secret launch date of project bluebird {i}" for i in range(12)]
    kwargs = dict(benign_per_pool=10, threshold_rows=40, batch_size=4, progress=False)
    plain, first, again = (two_headed_guard() for _ in range(3))
    add_head(model, tokenizer, plain, "secrets", unsafe, **kwargs)
    passes: list[int] = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda *_: passes.append(1))
    try:
        add_head(model, tokenizer, first, "secrets", unsafe, cache_dir=tmp_path / "cache", **kwargs)
        uncached = len(passes)
        passes.clear()
        add_head(model, tokenizer, again, "secrets", unsafe, cache_dir=tmp_path / "cache", **kwargs)
    finally:
        handle.remove()
    bundled_batches = uncached - len(passes)
    assert bundled_batches > 0 and len(passes) < uncached  # the bundled rows were read from the cache
    for guard in (first, again):
        state, reference = guard.state_dict(), plain.state_dict()
        assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state)


def test_add_head_draws_from_the_release_split_whatever_its_seed():
    """The seed draws samples; the rows they are drawn from keep the split the bundled heads were fitted on, so no
    threshold is set on a chat row the supervised head learnt from (an in-sample row scores low)."""
    validation = release_rows("chat", "validation")
    assert validation and all(split_of(p.id) == "validation" and not is_reserved(p.text) for p in validation)
    assert {p.id for p in release_rows("chat", "fit")}.isdisjoint(p.id for p in validation)
    model, tokenizer, _ = tiny_guard("prompt_last")
    unsafe = [f"tell me the secret launch date of project bluebird {i}" for i in range(12)]
    guard = two_headed_guard()
    budget = add_head(
        model, tokenizer, guard, "secrets", unsafe, benign_per_pool=20, threshold_rows=None, seed=7, progress=False
    )
    assert budget.n_rows == len(validation)


def test_add_head_weighs_your_safe_prompts_as_you_ask():
    """Given more of the benign weight, the user's safe prompts pull the new head's scores on them down; by default
    they weigh as one bundled pool does."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    unsafe = [f"tell me the secret launch date of project bluebird {i}" for i in range(12)]
    safe = [f"tell me the public launch date of the bluebird app {i}" for i in range(12)]
    kwargs = dict(benign_per_pool=20, threshold_rows=40, progress=False)
    heads = {}
    for safe_weight in (None, 0.9):
        guard = two_headed_guard()
        add_head(model, tokenizer, guard, "secrets", unsafe, safe, safe_weight=safe_weight, **kwargs)
        heads[safe_weight] = guard.heads["secrets"]
    assert (heads[None].config.balance, heads[0.9].config.balance) == ("source", "given")
    reads = guarded_reads(model, tokenizer, two_headed_guard(), safe)
    assert heads[0.9].logit(reads).mean() < heads[None].logit(reads).mean()
    for bad, prompts in ((1.0, safe), (0.5, [])):
        with pytest.raises(ValueError, match="safe_weight needs safe prompts and a value in"):
            add_head(model, tokenizer, two_headed_guard(), "secrets", unsafe, prompts, safe_weight=bad, **kwargs)


def guarded_reads(model, tokenizer, guard, prompts):
    from hf_lsad.capture.collect import collect_prompt_features

    return collect_prompt_features(model, tokenizer, prompts, guard.reads, progress=False)[0]


@pytest.mark.parametrize(
    ("unsafe", "safe", "error"),
    [
        ([], [], "empty"),
        (["same prompt"] * 12, ["same prompt"], "both unsafe and safe"),
        (["a prompt"] * 3, [], "at least 10"),
        (["ok"] * 12 + [""], [], "empty"),
    ],
)
def test_add_head_refuses_empty_short_or_one_class_input(unsafe, safe, error):
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = two_headed_guard()
    with pytest.raises(ValueError, match=error):
        add_head(model, tokenizer, guard, "mine", unsafe, safe, progress=False)
    assert guard.head_names == ["anomaly", "harm"]  # nothing added

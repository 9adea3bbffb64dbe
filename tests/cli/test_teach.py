"""``hf-lsad teach`` and :func:`teach_traffic`: a head taught part of the user's traffic, thresholds on the rest."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import shlex

import pytest
import torch
from tiny import PROMPTS, fresh_guard, tiny_guard, two_headed_guard

from hf_lsad.capture.collect import collect_prompt_features
from hf_lsad.cli.commands import domain_advice
from hf_lsad.cli.main import entry, parse
from hf_lsad.core.batching import BATCH_TOKENS
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.data.pools import CHECK_DOMAINS, EVAL_SOURCES, GUARD_POOLS, HARM_CHECK_POOLS, is_unsafe_pool
from hf_lsad.data.store import load_activations, save_activations
from hf_lsad.errors import SmallSampleWarning
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.heads.bundled import (
    CHAT_CACHE,
    DOMAIN_CACHE,
    HARM_CACHE,
    KEPT_CACHE,
    PARTIAL,
    _PartialCollection,
    bundled_features,
    cache_record,
    check_cache_turn,
    read_folder,
    release_rows,
    sample_rows,
)
from hf_lsad.guard.heads.bundled_checks import (
    bundled_chat_flag_rates,
    bundled_domain_flag_rates,
    bundled_harm_catch_rates,
    chat_shift_warning,
    domain_shift_warning,
    harm_drop_warning,
)
from hf_lsad.guard.heads.training import STEADY_SAMPLE, USER_SOURCE, cut_traffic, small_sample_warning, teach_traffic

TRAFFIC = [f"how do I reset the password of my own account number {i}?" for i in range(150)]
"""A benign kind of traffic the tiny guard's heads were not fitted on: it flags all of it at its thresholds."""
SAMPLE = [t for i, t in enumerate(TRAFFIC) if i % 3]
HELD_OUT = [t for i, t in enumerate(TRAFFIC) if not i % 3]
"""The user's sample (100 prompts) and more traffic of the same kind (50)."""
CHECKS = ["--domain-check", "1", "--harm-check", "1"]
"""The checks of the first test: a row of each domain and source (the harm rows hold jailbreaks of thousands of
characters, which the tiny model's tokenizer reads a token each)."""
POOLS = ["harmful", "toxic_text", "questions", "statements"]
ROWS_PER_POOL = 12
"""Bundled pools of short prompts and fit rows per pool in these tests (the release fits on every row of 13 pools)."""


def harm_scores(guard: SafetyGuard, prompts: list[str]) -> torch.Tensor:
    model, tokenizer, _ = tiny_guard("prompt_last")
    reads, _ = collect_prompt_features(model, tokenizer, prompts, guard.reads, progress=False)
    return guard(reads).head_scores["harm"]


def flag_rate(guard: SafetyGuard, prompts: list[str]) -> float:
    model, tokenizer, _ = tiny_guard("prompt_last")
    reads, _ = collect_prompt_features(model, tokenizer, prompts, guard.reads, progress=False)
    return float(guard(reads).flagged.double().mean())


@pytest.fixture
def guard_dir(tmp_path):
    path = tmp_path / "guard"
    two_headed_guard(target_fpr=0.1).save_pretrained(path)
    return path


def test_teach_writes_a_guard_whose_head_learnt_the_traffic(model_dir, guard_dir, tmp_path, capsys):
    sample = tmp_path / "traffic.jsonl"
    # a chat log, as hf-lsad screen reads one: the last user turn of each row's messages
    turns = ({"messages": [{"role": "user", "content": "hello"}, {"role": "user", "content": t}]} for t in SAMPLE)
    sample.write_text("".join(json.dumps(row) + "\n" for row in turns))
    out = tmp_path / "mine"
    before = SafetyGuard.from_pretrained(guard_dir)
    assert flag_rate(before, HELD_OUT) == 1.0  # the traffic the heads never saw: all of it flagged

    flags = ["--benign", str(sample), "--fit-fraction", "0.5", "--pools", *POOLS, "--rows-per-pool", str(ROWS_PER_POOL)]
    entry(["teach", "--guard", str(guard_dir), "--model", str(model_dir), *flags, *CHECKS, "--out", str(out)])
    printed = capsys.readouterr()
    assert "head 'harm' taught 50 prompts" in printed.out and "thresholds set on the other 50" in printed.out
    # what teaching did to ordinary chat (--chat-check, 500 rows by default), to the other benign domains
    # (--domain-check) and to the bundled harm (--harm-check), beside the guard it was taught from
    assert "bundled validation chat (500 rows): the new guard flags " in printed.out
    assert (
        "bundled validation benign domains (at most 1 rows of each): the new guard flags task prompts " in printed.out
    )
    assert (
        "bundled validation harm (at most 1 rows of each of 10 sources and pools): the new guard catches "
        in printed.out
    )
    assert printed.out.count(", the guard it came from ") == 2 and printed.out.count("the guard it came from") == 3
    # 100 prompts: told once, before the model loads, that the guard will move with the sample
    assert printed.err.count("bring about 1,000") == 1
    assert "warning: 100 prompts: the thresholds are set on the 50 held back" in printed.err
    # the fit prints nothing of its own: the command says when it starts and how long it took
    assert "fitting head 'harm' on 98 rows ..." in printed.err and "fitted head 'harm' in " in printed.err

    guard = SafetyGuard.from_pretrained(out)
    budget, head = guard.budget, guard.heads["harm"].config
    assert budget.heads == before.budget.heads and budget.shares == pytest.approx(before.budget.shares)
    assert budget.n_rows == 50 and budget.measured_fpr <= 0.1 and "traffic.jsonl" in budget.rows
    assert head.probe == before.heads["harm"].config.probe  # same reads and settings, fitted again
    assert USER_SOURCE not in head.sources and "advbench" in head.sources  # the user's rows are benign
    assert head.n_safe == 2 * ROWS_PER_POOL + 50 and head.n_unsafe == 2 * ROWS_PER_POOL
    # the head moved its scores on the traffic (not only the thresholds), and held-out traffic of the kind passes
    assert harm_scores(guard, HELD_OUT).mean() < harm_scores(before, HELD_OUT).mean()
    assert flag_rate(guard, HELD_OUT) <= 0.2
    assert SafetyGuard.from_pretrained(guard_dir).budget == before.budget  # --out: the source folder is kept
    assert "hf-lsad teach" in (out / "README.md").read_text()


def test_screen_advises_teaching_a_table_flagged_far_more_often_than_the_budget(model_dir, guard_dir, tmp_path, capsys):
    table = tmp_path / "traffic.jsonl"
    table.write_text("".join(json.dumps({"text": t}) + "\n" for t in SAMPLE))  # flagged all of it by the tiny guard
    turn = "You are a support bot."
    common = ["screen", str(table), "--model", str(model_dir), "--guard", str(guard_dir), "--column", "text"]
    entry([*common, "--out", str(tmp_path / "v.jsonl"), "--system", turn])
    err = capsys.readouterr().err
    assert "note: 100% of the rows scored were flagged, more than 2 times the 10% of benign traffic" in err
    # the teach command that reads the table as this screen did, ready to run
    advised = shlex.split(err.split("teach it about a thousand of them (")[1].split("; add --keep-bundled")[0])
    assert "; add --keep-bundled chat if it serves ordinary chat too; docs/heads.md" in err
    assert advised[:2] == ["hf-lsad", "teach"]
    _, args = parse(advised[1:])
    assert (args.guard, args.benign, args.column, args.system) == (str(guard_dir), str(table), "text", turn)
    assert (args.model, args.rows_per_pool, args.head) == (str(model_dir), 1000, "harm")
    # no note for a table flagged at most twice the budget, read without the template, or a guard it cannot teach
    plain = tmp_path / "plain.txt"
    plain.write_text("".join(t + "\n" for t in PROMPTS[:30]))
    entry(["screen", str(plain), "--model", str(model_dir), "--guard", str(guard_dir), "--out", str(tmp_path / "p")])
    printed = capsys.readouterr()
    assert "rows have a verdict" in printed.out and "note:" not in printed.err
    entry([*common, "--out", str(tmp_path / "raw.jsonl"), "--raw"])
    assert "note:" not in capsys.readouterr().err
    anomaly_only = tmp_path / "anomaly-only"
    fresh_guard("prompt_last").save_pretrained(anomaly_only)
    entry([*common[:4], "--guard", str(anomaly_only), "--column", "text", "--out", str(tmp_path / "a.jsonl")])
    assert "note:" not in capsys.readouterr().err


def test_teach_traffic_is_seeded_and_leaves_the_guard_as_it_was_on_error():
    model, tokenizer, _ = tiny_guard("prompt_last")
    kwargs = dict(fit_fraction=0.5, pools=POOLS, rows_per_pool=ROWS_PER_POOL, progress=False)
    first, second = two_headed_guard(target_fpr=0.1), two_headed_guard(target_fpr=0.1)
    with pytest.warns(SmallSampleWarning, match=r"^100 prompts: the thresholds are set on the 50 held back, of which"):
        a = teach_traffic(model, tokenizer, first, SAMPLE, **kwargs)
    b = teach_traffic(model, tokenizer, second, SAMPLE, **kwargs)
    assert a == b and a.rows == "the user's own benign prompts (50 held back; 50 more taught to head 'harm')"
    assert all(torch.equal(x, y) for x, y in zip(first.state_dict().values(), second.state_dict().values()))
    assert first.fingerprint.boundary is None  # the user's held-back prompts are kept only when asked
    kept = two_headed_guard(target_fpr=0.1)
    with pytest.warns(SmallSampleWarning):
        teach_traffic(model, tokenizer, kept, SAMPLE, keep_nearest=True, **kwargs)
    assert kept.fingerprint.boundary is not None and kept.fingerprint.boundary.n_rows == 50

    guard = two_headed_guard(target_fpr=0.1)
    head, budget = guard.heads["harm"], copy.deepcopy(guard.budget)
    with pytest.raises(ValueError, match="no supervised head named 'dosage'"):
        teach_traffic(model, tokenizer, guard, SAMPLE, head="dosage", **kwargs)
    with pytest.raises(ValueError, match=r"fit_fraction must be in \(0, 1\)"):
        teach_traffic(model, tokenizer, guard, SAMPLE, fit_fraction=1.0, progress=False)
    with pytest.raises(ValueError, match="need at least"):  # 20 held back cannot bound 10% with 0.95: before any pass
        teach_traffic(model, tokenizer, guard, SAMPLE[:40], confidence=0.95, **kwargs)
    with pytest.raises(ValueError, match="must be bundled pools"):
        teach_traffic(model, tokenizer, guard, SAMPLE, **{**kwargs, "pools": ["nonesuch"]})
    with pytest.raises(ValueError, match="empty"):
        teach_traffic(model, tokenizer, guard, ["fine", "  "], **kwargs)
    with pytest.raises(ValueError, match="reads the response"):
        teach_traffic(model, tokenizer, fresh_guard("response_last"), SAMPLE, **kwargs)
    assert guard.heads["harm"] is head and guard.budget == budget


def test_bundled_chat_flag_rates_reads_the_validation_chat_once_for_every_guard(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    strict, loose = two_headed_guard(target_fpr=0.05), two_headed_guard(target_fpr=0.5)
    chat = [p.text for p in sample_rows(release_rows("chat", "validation"), 60, seed=0)]  # the check's seeded draw
    reads, _ = collect_prompt_features(model, tokenizer, chat, strict.reads, progress=False)
    loose.fit_budget(reads, target_fpr=0.5, shares=[0.5, 0.5], rows="these chat rows")  # thresholds that pass some
    expected = [float(g(reads).flagged.double().mean()) for g in (strict, loose)]
    assert expected[0] != expected[1]  # the two guards differ on these rows, so which rate is whose is tested
    cache = tmp_path / "cache"
    rates = bundled_chat_flag_rates(model, tokenizer, [strict, loose], rows=60, cache_dir=cache, progress=False)
    assert rates == pytest.approx(expected, abs=1 / 60)  # batched otherwise: a row at a threshold may flip
    drawn = cache / CHAT_CACHE / "60-rows-seed-0"  # a folder per draw: a check of another size has its own
    assert sorted(p.name for p in drawn.iterdir()) == sorted(read_folder(r) for r in strict.reads)
    bundled_chat_flag_rates(model, tokenizer, [strict], rows=30, cache_dir=cache, progress=False)
    assert sorted(p.name for p in (cache / CHAT_CACHE).iterdir()) == ["30-rows-seed-0", "60-rows-seed-0"]
    # read back from the cache, not the model: activations changed there change the rates
    for folder in drawn.iterdir():
        store = load_activations(folder)
        save_activations(folder, store.activations * 0.0, store.records, store.hook, inputs=store.inputs)
    assert bundled_chat_flag_rates(model, tokenizer, [strict, loose], rows=60, cache_dir=cache, progress=False) != rates
    with pytest.raises(ValueError, match="rows must be a positive number of rows or None, got 0"):
        bundled_chat_flag_rates(model, tokenizer, [strict], rows=0, progress=False)
    with pytest.raises(ValueError, match="reads the response"):
        bundled_chat_flag_rates(model, tokenizer, [fresh_guard("response_last")], rows=60, progress=False)


@pytest.mark.parametrize(
    ("before", "after", "target", "warned"),
    [
        (0.046, 0.094, 0.05, True),  # a security team's questions taught alone (hf-lsad teach, 500 rows)
        (0.04, 0.055, 0.05, False),  # within the noise of a 500-row draw
        (0.0, 0.076, 0.05, True),
        (0.0, 0.075, 0.05, False),  # at 1.5 times the target: not above it
        (0.2, 0.29, 0.05, False),  # a guard that flagged much chat before: judged against what it flagged
        (0.2, 0.31, 0.05, True),
    ],
)
def test_a_taught_guard_that_flags_far_more_chat_is_warned_of(before, after, target, warned):
    warning = chat_shift_warning(before, after, target)
    assert bool(warning) is warned
    if warned:
        assert f"flags {after:.1%} of the bundled validation chat ({before:.1%} before)" in warning


def test_bundled_harm_catch_rates_reads_each_unsafe_sources_validation_rows_once_for_every_guard(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    strict, loose = two_headed_guard(target_fpr=0.1), two_headed_guard(target_fpr=0.1)
    reads, _ = collect_prompt_features(model, tokenizer, TRAFFIC, strict.reads, progress=False)
    loose.fit_budget(reads, target_fpr=0.05, shares=[0.5, 0.5], rows="password resets")  # thresholds raised
    unsafe = [p for pool in GUARD_POOLS if is_unsafe_pool(pool) for p in release_rows(pool, "validation")]
    # the check's draw (short rows): each source the evaluation holds out, then each other unsafe pool as one group
    drawn = {s: sample_rows([p for p in unsafe if p.source == s], 2, seed=7) for s in EVAL_SOURCES}
    drawn |= {pool: sample_rows(release_rows(pool, "validation"), 2, seed=7) for pool in HARM_CHECK_POOLS}
    groups = [*EVAL_SOURCES, *HARM_CHECK_POOLS]
    assert list(drawn) == groups and all(len(rows) == 2 for rows in drawn.values())
    texts = [p.text for rows in drawn.values() for p in rows]
    features, _ = collect_prompt_features(model, tokenizer, texts, strict.reads, batch_size=1, progress=False)
    expected = []
    for guard in (strict, loose):
        flags = guard(features).flagged.view(len(groups), 2).double().mean(dim=1)  # [groups]: 2 rows each
        expected.append(dict(zip(groups, flags.tolist())))
    assert expected[0] != expected[1]  # the two guards differ on these rows, so which rate is whose is tested
    cache = tmp_path / "cache"
    rates = bundled_harm_catch_rates(
        model, tokenizer, [strict, loose], rows_per_source=2, seed=7, cache_dir=cache, progress=False
    )
    assert [list(r) for r in rates] == [groups] * 2  # every source in the evaluation's order, then the pools
    for got, want in zip(rates, expected):  # batched otherwise: a row at a threshold may flip, one at most
        assert sum(abs(got[s] - want[s]) for s in groups) <= 0.5 + 1e-9
    folder = cache / HARM_CACHE / "2-per-group-seed-7"  # a folder per draw
    assert sorted(p.name for p in folder.iterdir()) == sorted(read_folder(r) for r in strict.reads)
    # read back from the cache, not the model: activations changed there change the rates
    for store_folder in folder.iterdir():
        store = load_activations(store_folder)
        save_activations(store_folder, store.activations * 0.0, store.records, store.hook, inputs=store.inputs)
    kwargs = dict(rows_per_source=2, seed=7, cache_dir=cache, progress=False)
    assert bundled_harm_catch_rates(model, tokenizer, [strict, loose], **kwargs) != rates
    # the CLI checks the draw's system turn before it loads a model, as it checks the fit rows'
    check_cache_turn(cache, None)
    with pytest.raises(ValueError, match="under the system turn the chat template's default, not"):
        check_cache_turn(cache, TURN)
    with pytest.raises(ValueError, match="rows_per_source must be a positive number of rows or None, got 0"):
        bundled_harm_catch_rates(model, tokenizer, [strict], rows_per_source=0, progress=False)
    with pytest.raises(ValueError, match="reads the response"):
        bundled_harm_catch_rates(model, tokenizer, [fresh_guard("response_last")], rows_per_source=1, progress=False)


@pytest.mark.parametrize(
    ("before", "after", "fallen"),
    [
        ({"donotanswer": 0.97, "advbench": 1.0}, {"donotanswer": 0.47, "advbench": 0.97}, ["donotanswer 97% to 47%"]),
        ({"donotanswer": 0.95, "advbench": 1.0}, {"donotanswer": 0.80, "advbench": 0.9}, []),  # shell tasks' 0.15
        ({"donotanswer": 0.5, "advbench": 1.0}, {"donotanswer": 0.3, "advbench": 0.79}, ["advbench 100% to 79%"]),
        ({"donotanswer": 0.5}, {"donotanswer": 0.7}, []),  # caught more: nothing to say
    ],
)
def test_a_guard_that_lets_through_far_more_of_a_source_is_warned_of(before, after, fallen):
    warning = harm_drop_warning(before, after)
    assert bool(warning) is bool(fallen)
    if fallen:
        assert f"lets through more of the bundled harm ({', '.join(fallen)})" in warning


def test_bundled_domain_flag_rates_reads_each_benign_domains_validation_rows_once_for_every_guard(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    strict, loose = two_headed_guard(target_fpr=0.1), two_headed_guard(target_fpr=0.1)
    drawn = {
        pool: sample_rows(release_rows(pool, "validation"), 3, seed=7) for pool in CHECK_DOMAINS
    }  # the check's draw
    texts = [p.text for rows in drawn.values() for p in rows]
    features, _ = collect_prompt_features(model, tokenizer, texts, strict.reads, batch_size=1, progress=False)
    loose.fit_budget(features, target_fpr=0.5, shares=[0.5, 0.5], rows="these rows")  # thresholds that pass some
    expected = []
    for guard in (strict, loose):
        flags = guard(features).flagged.view(len(CHECK_DOMAINS), 3).double().mean(dim=1)  # [domains]: 3 rows each
        expected.append(dict(zip(CHECK_DOMAINS, flags.tolist())))
    assert expected[0] != expected[1]  # the two guards differ on these rows, so which rate is whose is tested
    cache = tmp_path / "cache"
    kwargs = dict(rows_per_domain=3, seed=7, cache_dir=cache, progress=False)
    rates = bundled_domain_flag_rates(model, tokenizer, [strict, loose], **kwargs)
    assert [list(r) for r in rates] == [list(CHECK_DOMAINS)] * 2  # every domain beside chat, in the pools' order
    for got, want in zip(rates, expected):  # batched otherwise: a row at a threshold may flip, one at most
        assert sum(abs(got[pool] - want[pool]) for pool in CHECK_DOMAINS) <= 1 / 3 + 1e-9
    folder = cache / DOMAIN_CACHE / "3-per-domain-seed-7"  # a folder per draw
    assert sorted(p.name for p in folder.iterdir()) == sorted(read_folder(r) for r in strict.reads)
    # read back from the cache, not the model: activations changed there change the rates
    for store_folder in folder.iterdir():
        store = load_activations(store_folder)
        save_activations(store_folder, store.activations * 0.0, store.records, store.hook, inputs=store.inputs)
    assert bundled_domain_flag_rates(model, tokenizer, [strict, loose], **kwargs) != rates
    # the CLI checks the draw's system turn before it loads a model, as it checks the fit rows'
    check_cache_turn(cache, None)
    with pytest.raises(ValueError, match="under the system turn the chat template's default, not"):
        check_cache_turn(cache, TURN)
    with pytest.raises(ValueError, match="rows_per_domain must be a positive number of rows or None, got 0"):
        bundled_domain_flag_rates(model, tokenizer, [strict], rows_per_domain=0, progress=False)
    with pytest.raises(ValueError, match="reads the response"):
        bundled_domain_flag_rates(model, tokenizer, [fresh_guard("response_last")], rows_per_domain=1, progress=False)


@pytest.mark.parametrize(
    ("before", "after", "target", "risen"),
    [
        # a security team's questions taught (hf-lsad teach; every validation row of each domain)
        (
            {"safe": 0.019, "benign_ood": 0.007, "lookalike": 0.218, "statements": 0.025},
            {"safe": 0.084, "benign_ood": 0.052, "lookalike": 0.414, "statements": 0.333},
            0.05,
            ["task prompts 2% to 8%", "benign look-alikes 22% to 41%", "plain statements 2% to 33%"],
        ),
        ({"safe": 0.0}, {"safe": 0.075}, 0.05, []),  # at 1.5 times the target: not above it
        ({"lookalike": 0.3}, {"lookalike": 0.44}, 0.05, []),  # judged against what it flagged before
        ({"lookalike": 0.3}, {"lookalike": 0.46}, 0.05, ["benign look-alikes 30% to 46%"]),
        ({"safe": 0.02, "questions": 0.1}, {"safe": 0.0, "questions": 0.0}, 0.05, []),  # flags less: nothing to say
    ],
)
def test_a_guard_that_flags_far_more_of_another_benign_domain_is_warned_of(before, after, target, risen):
    warning = domain_shift_warning(before, after, target)
    assert bool(warning) is bool(risen)
    if risen:
        assert f"flags far more of other kinds of benign traffic ({', '.join(risen)})" in warning


def same_guard(a: SafetyGuard, b: SafetyGuard) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_teach_traffic_keeps_the_bundled_rows_in_a_cache(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    kwargs = dict(fit_fraction=0.5, rows_per_pool=ROWS_PER_POOL, progress=False)
    cache = tmp_path / "cache"
    plain, first, again, fewer, fewer_plain = (two_headed_guard(target_fpr=0.1) for _ in range(5))
    teach_traffic(model, tokenizer, plain, SAMPLE, pools=POOLS, **kwargs)
    teach_traffic(model, tokenizer, first, SAMPLE, pools=POOLS, cache_dir=cache, **kwargs)  # collects and writes
    reads = sorted(first.heads["harm"].reads)
    assert sorted(p.name for p in cache.iterdir()) == sorted(f"layer{layer}-{position}" for layer, position in reads)
    assert len(load_activations(cache / f"layer{reads[0][0]}-{reads[0][1]}").records) == len(POOLS) * ROWS_PER_POOL
    teach_traffic(model, tokenizer, again, SAMPLE, pools=POOLS, cache_dir=cache, **kwargs)  # reads
    assert same_guard(first, plain) and same_guard(again, plain)  # the cache changes nothing in the fit
    # a cache written for more pools serves a fit on fewer (its rows were batched with others: equal to round-off)
    teach_traffic(model, tokenizer, fewer, SAMPLE, pools=POOLS[:2], cache_dir=cache, **kwargs)
    teach_traffic(model, tokenizer, fewer_plain, SAMPLE, pools=POOLS[:2], **kwargs)
    assert torch.allclose(harm_scores(fewer, HELD_OUT), harm_scores(fewer_plain, HELD_OUT), atol=1e-4)

    # the fit reads the cache, not the model: activations changed in the cache change the head
    folder = cache / f"layer{reads[0][0]}-{reads[0][1]}"
    store = load_activations(folder)
    save_activations(folder, store.activations + 1.0, store.records, store.hook, inputs=store.inputs)
    changed = two_headed_guard(target_fpr=0.1)
    teach_traffic(model, tokenizer, changed, SAMPLE, pools=POOLS, cache_dir=cache, **kwargs)
    assert not torch.equal(
        changed.heads["harm"].state_dict()["probe.mean"], plain.heads["harm"].state_dict()["probe.mean"]
    )


def test_teach_traffic_refuses_a_cache_it_cannot_trust(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    kwargs = dict(fit_fraction=0.5, rows_per_pool=ROWS_PER_POOL, progress=False)
    cache = tmp_path / "cache"
    teach_traffic(
        model, tokenizer, two_headed_guard(target_fpr=0.1), SAMPLE, pools=POOLS[:2], cache_dir=cache, **kwargs
    )
    guard = two_headed_guard(target_fpr=0.1)
    head, budget = guard.heads["harm"], copy.deepcopy(guard.budget)
    with pytest.raises(ValueError, match="lacks 24 of the 48 bundled prompts"):
        teach_traffic(model, tokenizer, guard, SAMPLE, pools=POOLS, cache_dir=cache, **kwargs)

    layer, position = sorted(guard.heads["harm"].reads)[0]
    folder = cache / f"layer{layer}-{position}"
    store = load_activations(folder)
    records = [{**store.records[0], "digest": "0" * 16}, *store.records[1:]]
    save_activations(folder, store.activations, records, store.hook, inputs=store.inputs)
    with pytest.raises(ValueError, match="the text of 1 bundled prompts was different"):
        teach_traffic(model, tokenizer, guard, SAMPLE, pools=POOLS[:2], cache_dir=cache, **kwargs)

    other = dataclasses.replace(store.hook, position="prompt_last" if position == "prompt_mean" else "prompt_mean")
    save_activations(folder, store.activations, store.records, other, inputs=store.inputs)
    with pytest.raises(ValueError, match=f"holds activations of layer {layer} {other.position}"):
        teach_traffic(model, tokenizer, guard, SAMPLE, pools=POOLS[:2], cache_dir=cache, **kwargs)
    assert guard.heads["harm"] is head and guard.budget == budget


def test_a_sample_is_steady_from_a_thousand_prompts():
    assert STEADY_SAMPLE == 1000 and small_sample_warning(1000, 400, 11) == ""
    warning = small_sample_warning(300, 120, 2)
    assert warning.startswith("300 prompts: the thresholds are set on the 120 held back, of which at most 2 may be")
    assert "bring about 1,000" in warning


def test_cut_traffic_keeps_every_prompt_once():
    taught, held_back = cut_traffic(SAMPLE, 0.6, seed=3)
    assert len(taught) == 60 and len(held_back) == 40 and sorted(taught + held_back) == sorted(SAMPLE)
    assert cut_traffic(SAMPLE, 0.6, seed=3) == (taught, held_back) != cut_traffic(SAMPLE, 0.6, seed=4)
    with pytest.raises(ValueError, match="leave none"):
        cut_traffic(SAMPLE[:1], 0.6, seed=0)


@pytest.mark.parametrize(
    ("lines", "flags", "error"),
    [
        ([], [], "holds no prompts"),
        (SAMPLE, ["--head", "dosage"], "argument --head: the guard has no supervised head 'dosage'"),
        (SAMPLE, ["--fit-fraction", "1.5"], "argument --fit-fraction"),
        (SAMPLE[:1], [], "argument --fit-fraction: 1 prompts cut at 0.6 leave none"),
        (SAMPLE, ["--rows-per-pool", "0"], "argument --rows-per-pool"),
        (
            SAMPLE[:50],
            ["--confidence", "0.95"],
            "20 prompts held back for the thresholds: 20 held-out safe rows cannot",
        ),
        (SAMPLE, ["--pools", "nonesuch"], "argument --pools: ['nonesuch'] are not bundled pools"),
        (SAMPLE, ["--guard", "default"], "argument --out: needed"),
        (SAMPLE, ["--guard", "RESPONSE"], "reads the response"),
        (SAMPLE, ["--cache", "BENIGN"], "argument --cache: "),
        (SAMPLE, ["--max-batch-tokens", "0"], "argument --max-batch-tokens: 0 is not"),
        (SAMPLE, ["--max-batch-tokens", "lots"], "expected a number of tokens or 'none', got 'lots'"),
        (SAMPLE, ["--system", " "], "argument --system: empty"),
    ],
)
def test_teach_refuses_bad_input_before_loading_a_model(lines, flags, error, guard_dir, tmp_path, capsys):
    benign = tmp_path / "benign.txt"
    benign.write_text("".join(line + "\n" for line in lines))
    if "RESPONSE" in flags:
        fresh_guard("response_last").save_pretrained(tmp_path / "response-guard")
    flags = [str(tmp_path / "response-guard") if f == "RESPONSE" else f for f in flags]
    flags = [str(benign) if f == "BENIGN" else f for f in flags]
    with pytest.raises(SystemExit) as info:
        entry(["teach", "--guard", str(guard_dir), "--benign", str(benign), *flags])
    assert info.value.code == 2 and error in capsys.readouterr().err


@pytest.mark.parametrize("command", ["teach", "set-budget", "add-head", "collect"])
def test_the_token_budget_of_a_forward_pass_is_a_flag(command):
    required = {
        "teach": ["--guard", "default", "--benign", "b.txt"],
        "set-budget": ["--guard", "default", "--benign", "b.txt"],
        "add-head": ["--guard", "default", "--name", "n", "--unsafe", "u.txt"],
        "collect": ["--pool", "chat", "--out", "store"],
    }[command]
    default = None if command == "collect" else BATCH_TOKENS  # collect: batched as the bundled stores were made
    assert parse([command, *required])[1].max_batch_tokens == default
    assert parse([command, *required, "--max-batch-tokens", "none"])[1].max_batch_tokens is None
    assert parse([command, *required, "--max-batch-tokens", "2048"])[1].max_batch_tokens == 2048


@contextlib.contextmanager
def forward_passes(model, interrupt_at: int | None = None):
    """Count the forward passes of ``model`` (one for the opening every prompt shares, then one per batch),
    interrupting the ``interrupt_at``-th as Ctrl-C does."""
    passes: list[int] = []

    def count(*_):
        passes.append(1)
        if len(passes) == interrupt_at:
            raise KeyboardInterrupt

    handle = model.model.layers[0].register_forward_pre_hook(count)
    try:
        yield passes
    finally:
        handle.remove()


def fit_prompts():
    return [p for pool in POOLS for p in release_rows(pool, "fit")[:ROWS_PER_POOL]]


def test_a_cache_written_from_other_stores_with_cache_records_is_read_without_the_model(tmp_path):
    """A study writes teach's cache from the stores hf-lsad collect wrote; the records are the cache's own."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    prompts, reads = fit_prompts(), sorted(two_headed_guard().heads["harm"].reads)
    collected, inputs = collect_prompt_features(model, tokenizer, [p.text for p in prompts], reads, progress=False)
    cache = tmp_path / "cache"
    records = [cache_record(p) for p in prompts]
    for read in reads:
        marked = collected[read] + 1.0  # activations no forward pass gives: read back, they show the cache was read
        save_activations(cache / read_folder(read), marked, records, HookPoint.from_model(model, *read), inputs=inputs)
    with forward_passes(model) as passes:
        features = bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, progress=False)
    assert not passes
    assert all(torch.equal(features[read], collected[read] + 1.0) for read in reads)
    record = cache_record(prompts[0])
    assert set(record) == {"id", "digest", "source", "category"} and record["id"] == prompts[0].id
    changed = prompts[0]._replace(text=prompts[0].text + " (edited)")
    with pytest.raises(ValueError, match="different"):  # a store written when a prompt's text was other
        bundled_features(model, tokenizer, [changed, *prompts[1:]], reads, cache_dir=cache, progress=False)


def test_an_interrupted_collection_into_a_cache_resumes_where_it_stopped(tmp_path):
    """An hour of collection was lost to an interruption, cache or not: the cache was written at the end."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    prompts, reads = fit_prompts(), sorted(two_headed_guard().heads["harm"].reads)
    kwargs = dict(batch_size=4, progress=False)
    reference = bundled_features(model, tokenizer, prompts, reads, **kwargs)  # 12 batches, nothing kept
    cache = tmp_path / "cache"
    with forward_passes(model, interrupt_at=6), pytest.raises(KeyboardInterrupt):  # two parts of two batches kept
        bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, checkpoint_batches=2, **kwargs)
    assert len(list((cache / PARTIAL).glob("part-*"))) == 2 and not any(cache.glob("layer*"))
    with forward_passes(model) as passes:
        resumed = bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, checkpoint_batches=2, **kwargs)
    assert len(passes) == 1 + 12 - 4  # the shared opening, then the batches no part held, and those alone
    assert all(torch.equal(resumed[read], reference[read]) for read in reads)  # the same batches: bit for bit
    assert not (cache / PARTIAL).exists()
    uninterrupted = tmp_path / "uninterrupted"
    bundled_features(model, tokenizer, prompts, reads, cache_dir=uninterrupted, **kwargs)
    for read in reads:
        store, alone = load_activations(cache / read_folder(read)), load_activations(uninterrupted / read_folder(read))
        assert torch.equal(store.activations, alone.activations)
        assert store.records == alone.records and store.inputs == alone.inputs


def test_parts_left_by_a_run_stopped_after_its_stores_are_removed(tmp_path, monkeypatch):
    """A run stopped between writing its stores and removing its parts left them: a later collection of other reads
    was refused ("holds an interrupted collection of other reads"), and told to delete the whole cache."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    prompts, reads = fit_prompts(), sorted(two_headed_guard().heads["harm"].reads)
    cache = tmp_path / "cache"

    def stopped(self):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(_PartialCollection, "remove", stopped)
        bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, checkpoint_batches=2, batch_size=4)
    assert any((cache / PARTIAL).glob("part-*")) and all((cache / read_folder(read)).is_dir() for read in reads)
    other = (reads[0][0], "prompt_last" if reads[0][1] == "prompt_mean" else "prompt_mean")
    with forward_passes(model) as passes:
        features = bundled_features(model, tokenizer, prompts, [*reads, other], cache_dir=cache, progress=False)
    with forward_passes(model) as passes_alone:
        alone = bundled_features(model, tokenizer, prompts, [other], progress=False)
    assert len(passes) == len(passes_alone) and not (cache / PARTIAL).exists()  # the new read alone was collected
    assert torch.equal(features[other], alone[other])


def test_parts_of_a_run_that_did_not_finish_are_kept(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    prompts, reads = fit_prompts(), sorted(two_headed_guard().heads["harm"].reads)
    cache = tmp_path / "cache"
    bundled_features(model, tokenizer, prompts, reads[:1], cache_dir=cache, progress=False)
    with forward_passes(model, interrupt_at=4), pytest.raises(KeyboardInterrupt):
        bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, checkpoint_batches=1, batch_size=4)
    bundled_features(model, tokenizer, prompts, reads[:1], cache_dir=cache, progress=False)  # its store is there
    assert len(list((cache / PARTIAL).glob("part-*"))) == 2  # of reads[1:], whose stores are not


def test_parts_written_for_other_prompt_text_or_reads_are_refused(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    prompts, reads = fit_prompts(), sorted(two_headed_guard().heads["harm"].reads)
    cache = tmp_path / "cache"
    with forward_passes(model, interrupt_at=3), pytest.raises(KeyboardInterrupt):
        bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, checkpoint_batches=1, progress=False)
    edited = [p._replace(text=p.text + " (edited)") for p in prompts]
    with pytest.raises(ValueError, match=r"was written when the text of bundled prompt .* was different"):
        bundled_features(model, tokenizer, edited, reads, cache_dir=cache, progress=False)
    other = [(reads[0][0], "prompt_last" if reads[0][1] == "prompt_mean" else "prompt_mean")]
    with pytest.raises(ValueError, match="holds an interrupted collection of other reads"):
        bundled_features(model, tokenizer, prompts, other, cache_dir=cache, progress=False)
    with pytest.raises(ValueError, match="checkpoint_batches must be a positive integer"):
        bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, checkpoint_batches=0, progress=False)


TURN = "You are the support assistant of a small web shop."
"""A deployment's own system turn."""


def test_teach_under_a_system_turn_fits_and_sets_thresholds_under_it(model_dir, guard_dir, tmp_path, capsys):
    model, tokenizer, _ = tiny_guard("prompt_last")
    kwargs = dict(fit_fraction=0.5, pools=POOLS, rows_per_pool=ROWS_PER_POOL, progress=False)
    default, turned, cached = (two_headed_guard(target_fpr=0.1) for _ in range(3))
    teach_traffic(model, tokenizer, default, SAMPLE, **kwargs)
    budget = teach_traffic(model, tokenizer, turned, SAMPLE, system=TURN, **kwargs)
    assert turned.inputs.system == TURN and default.inputs.system is None  # what generate and screen check against
    assert repr(TURN) in budget.rows
    assert not torch.equal(  # the rows reached the head under the turn
        turned.heads["harm"].state_dict()["probe.mean"], default.heads["harm"].state_dict()["probe.mean"]
    )
    # the head's bundled rows were collected under the turn: a cache keeps them so, and a fit from it is the same
    cache = tmp_path / "cache"
    teach_traffic(model, tokenizer, cached, SAMPLE, system=TURN, cache_dir=cache, **kwargs)
    assert same_guard(cached, turned)
    assert {load_activations(folder).inputs.system for folder in cache.glob("layer*")} == {TURN}
    text = {p.id: p.text for pool in POOLS for p in release_rows(pool, "fit")}
    for read in cached.heads["harm"].reads:
        store = load_activations(cache / read_folder(read))
        texts = [text[record["id"]] for record in store.records]
        under, _ = collect_prompt_features(model, tokenizer, texts, [read], system=TURN, progress=False)
        assert torch.allclose(store.activations, under[read], atol=1e-5)

    sample, out = tmp_path / "traffic.txt", tmp_path / "mine"
    sample.write_text("".join(t + "\n" for t in SAMPLE))
    argv = ["teach", "--guard", str(guard_dir), "--model", str(model_dir), "--benign", str(sample), "--fit-fraction"]
    argv += ["0.5", "--pools", *POOLS, "--rows-per-pool", str(ROWS_PER_POOL), "--chat-check", "0"]
    argv += ["--domain-check", "0", "--harm-check", "0"]
    entry([*argv, "--system", TURN])
    entry([*argv, "--out", str(out)])
    assert "bundled validation" not in capsys.readouterr().out  # each check is skipped with 0 rows
    assert SafetyGuard.from_pretrained(guard_dir).inputs.system == TURN  # taught under the turn, in place
    assert repr(TURN) in (guard_dir / "README.md").read_text()
    assert SafetyGuard.from_pretrained(out).inputs.system is None  # taught again under the template's own turn
    capsys.readouterr()


def test_a_cache_of_the_bundled_rows_holds_one_system_turn(model_dir, guard_dir, tmp_path, capsys):
    model, tokenizer, _ = tiny_guard("prompt_last")
    kwargs = dict(fit_fraction=0.5, pools=POOLS[:2], rows_per_pool=ROWS_PER_POOL, progress=False)
    default_cache, turn_cache = tmp_path / "default", tmp_path / "turn"
    teach_traffic(model, tokenizer, two_headed_guard(target_fpr=0.1), SAMPLE, cache_dir=default_cache, **kwargs)
    teach_traffic(
        model, tokenizer, two_headed_guard(target_fpr=0.1), SAMPLE, cache_dir=turn_cache, system=TURN, **kwargs
    )
    guard = two_headed_guard(target_fpr=0.1)
    head, budget = guard.heads["harm"], copy.deepcopy(guard.budget)
    with pytest.raises(ValueError, match=f"under the system turn the chat template's default, not {TURN!r}"):
        teach_traffic(model, tokenizer, guard, SAMPLE, cache_dir=default_cache, system=TURN, **kwargs)
    with pytest.raises(ValueError, match=f"under the system turn {TURN!r}, not the chat template's default"):
        teach_traffic(model, tokenizer, guard, SAMPLE, cache_dir=turn_cache, **kwargs)
    with pytest.raises(ValueError, match="system must be None or a non-empty string"):
        teach_traffic(model, tokenizer, guard, SAMPLE, system="", **kwargs)
    assert guard.heads["harm"] is head and guard.budget == budget
    # the command line reads the turn from the cache's indexes and refuses before it loads a model
    benign = tmp_path / "benign.txt"
    benign.write_text("".join(t + "\n" for t in SAMPLE))
    tiny = ["--guard", str(guard_dir), "--model", str(model_dir)]
    rows = str(ROWS_PER_POOL)
    commands = [
        [
            "teach",
            *tiny,
            "--pools",
            *POOLS[:2],
            "--rows-per-pool",
            rows,
            "--fit-fraction",
            "0.4",
            "--benign",
            str(benign),
        ],
        ["add-head", *tiny, "--benign-per-pool", rows, "--name", "mine", "--unsafe", str(benign)],
        ["set-budget", *tiny, "--benign", str(benign)],  # its cache keeps the checks' draws
    ]
    for command in commands:
        for cache, system, stored in (
            (default_cache, ["--system", TURN], "the chat template's default"),
            (turn_cache, [], repr(TURN)),
        ):
            with pytest.raises(SystemExit) as info:
                entry([*command, "--out", str(tmp_path / "out"), "--cache", str(cache), *system])
            assert info.value.code == 2 and f"argument --cache: {cache}" in (err := capsys.readouterr().err)
            assert f"under the system turn {stored}, not" in err

    # the parts of an interrupted collection keep their turn too
    prompts, reads = fit_prompts(), sorted(guard.heads["harm"].reads)
    cache = tmp_path / "interrupted"
    with forward_passes(model, interrupt_at=3), pytest.raises(KeyboardInterrupt):
        bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, checkpoint_batches=1, progress=False)
    with pytest.raises(ValueError, match="under the system turn the chat template's default, not"):
        bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, system=TURN, progress=False)
    with forward_passes(model, interrupt_at=3), pytest.raises(KeyboardInterrupt):
        bundled_features(
            model, tokenizer, prompts, reads, cache_dir=tmp_path / "turned", checkpoint_batches=1, system=TURN
        )
    resumed = bundled_features(model, tokenizer, prompts, reads, cache_dir=tmp_path / "turned", system=TURN)
    alone = bundled_features(model, tokenizer, prompts, reads, system=TURN, progress=False)
    assert all(torch.allclose(resumed[read], alone[read], atol=1e-5) for read in reads)
    assert load_activations(tmp_path / "turned" / read_folder(reads[0])).inputs.system == TURN


def test_teach_keeps_bundled_pools_within_the_budget_beside_the_held_back_prompts(
    model_dir, guard_dir, tmp_path, capsys
):
    sample, out = tmp_path / "traffic.txt", tmp_path / "mine"
    sample.write_text("".join(t + "\n" for t in SAMPLE))
    flags = ["--benign", str(sample), "--fit-fraction", "0.5", "--pools", *POOLS, "--rows-per-pool", str(ROWS_PER_POOL)]
    checks = ["--chat-check", "0", "--domain-check", "0", "--harm-check", "0"]
    kept = ["--keep-bundled", "statements", "--cache", str(tmp_path / "cache")]
    entry(["teach", "--guard", str(guard_dir), "--model", str(model_dir), *flags, *checks, *kept, "--out", str(out)])
    printed = capsys.readouterr().out
    statements = len(release_rows("statements", "validation"))
    assert (
        f"head 'harm' taught 50 prompts of {sample}; thresholds set on the other 50, beside the bundled validation "
        f"rows of statements ({statements:,}), each kind kept within the budget" in printed
    )
    assert (
        f"of the {50 + statements} held-back prompts and kept rows (target 10%, each kind of rows within it)" in printed
    )
    budget = SafetyGuard.from_pretrained(out).budget
    assert budget.n_rows == 50 + statements and f"validation rows of statements ({statements:,})" in budget.rows
    card = (out / "README.md").read_text()
    assert "thresholds set on the other 50, beside the bundled validation rows of statements" in card
    assert sorted(p.name for p in (tmp_path / "cache" / KEPT_CACHE).iterdir()) == ["statements"]


@pytest.mark.parametrize(
    ("command", "risen", "advice"),
    [
        (
            "teach",
            ["safe", "lookalike", "statements"],
            "keep them within the budget too (--keep-bundled safe statements)",
        ),
        ("set-budget", ["benign_ood"], "keep them within the budget too (--keep-bundled benign_ood) or bring a sample"),
        ("teach", ["lookalike"], "if the deployment also serves these, bring a sample that holds them too"),
        ("add-head", ["safe"], "bring prompts of these kinds as --safe"),
    ],
)
def test_the_domain_warning_offers_to_keep_the_kinds_it_can_within_the_budget(command, risen, advice):
    assert advice in domain_advice(command, risen)

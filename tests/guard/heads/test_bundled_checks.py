"""What a changed guard does to the bundled traffic it was not changed for (:mod:`hf_lsad.guard.heads.bundled_checks`):
the chat, benign domains and harm read once for every guard, kept in a cache, and the warnings."""

from __future__ import annotations

import pytest
from tiny import SHOP_TURN, TRAFFIC, fresh_guard, tiny_guard, two_headed_guard

from hf_lsad.capture.collect import collect_prompt_features
from hf_lsad.data.pools import CHECK_DOMAINS, EVAL_SOURCES, GUARD_POOLS, HARM_CHECK_POOLS, is_unsafe_pool
from hf_lsad.data.store import load_activations, save_activations
from hf_lsad.guard.heads.bundled import (
    CHAT_CACHE,
    DOMAIN_CACHE,
    HARM_CACHE,
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
        check_cache_turn(cache, SHOP_TURN)
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
        check_cache_turn(cache, SHOP_TURN)
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

"""``hf-lsad teach`` and :func:`teach_traffic`: a head taught part of the user's traffic, thresholds on the rest."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from tiny import (
    HELD_OUT,
    PROMPTS,
    ROWS_PER_POOL,
    SAMPLE,
    SHOP_TURN,
    SHORT_POOLS,
    TRAFFIC,
    fresh_guard,
    held_by_another_run,
    tiny_guard,
    tiny_head_rows,
    two_headed_guard,
)

from hf_lsad.capture.collect import collect_prompt_features
from hf_lsad.cli.commands import domain_advice
from hf_lsad.cli.main import entry, parse
from hf_lsad.core.batching import BATCH_TOKENS
from hf_lsad.data.store import load_activations, save_activations
from hf_lsad.errors import ReteachWarning, SmallSampleWarning, ThresholdsResetWarning
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.heads.bundled import (
    KEPT_CACHE,
    read_folder,
    release_rows,
)
from hf_lsad.guard.heads.training import (
    STEADY_SAMPLE,
    USER_SOURCE,
    cut_traffic,
    fit_head,
    reteach_warning,
    small_sample_warning,
    teach_traffic,
    thresholds_reset_warning,
)

CHECKS = ["--domain-check", "1", "--harm-check", "1"]
"""The checks of the first test: a row of each domain and source (the harm rows hold jailbreaks of thousands of
characters, which the tiny model's tokenizer reads a token each)."""

POOL_FLAGS = ["--pools", *SHORT_POOLS, "--rows-per-pool", str(ROWS_PER_POOL)]
"""The bundled pools a command-line teach of these tests fits on: the short ones, a few rows each."""


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

    flags = ["--benign", str(sample), "--fit-fraction", "0.5", *POOL_FLAGS]
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
    kwargs = dict(fit_fraction=0.5, pools=SHORT_POOLS, rows_per_pool=ROWS_PER_POOL, progress=False)
    first, second = two_headed_guard(target_fpr=0.1), two_headed_guard(target_fpr=0.1)
    with pytest.warns(SmallSampleWarning, match=r"^100 prompts: the thresholds are set on the 50 held back, of which"):
        a = teach_traffic(model, tokenizer, first, SAMPLE, **kwargs)
    b = teach_traffic(model, tokenizer, second, SAMPLE, **kwargs)
    assert a == b and a.rows == "the user's own benign prompts (50 held back; 50 more taught to head 'harm')"
    # a head added later resets these thresholds: the advice is to teach again, not to set them on the whole sample
    assert "teach it again on the same sample" in thresholds_reset_warning(a, "mine")
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
    # a head added from the user's own examples (add_head names their source after the head) is not taught: it
    # would be fitted again on the bundled pools without them
    reads, labels, groups = tiny_head_rows()
    added = fit_head("dosage", reads, labels, ["dosage" if g == "stealing" else g for g in groups], head.config.probe)
    with_added = copy.deepcopy(guard)
    with_added.add_head(added)
    with pytest.raises(ValueError, match="head 'dosage' was added from your own unsafe examples, which the guard"):
        teach_traffic(model, tokenizer, with_added, SAMPLE, head="dosage", **kwargs)
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


def same_guard(a: SafetyGuard, b: SafetyGuard) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_teach_traffic_keeps_the_bundled_rows_in_a_cache(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    kwargs = dict(fit_fraction=0.5, rows_per_pool=ROWS_PER_POOL, progress=False)
    cache = tmp_path / "cache"
    plain, first, again, fewer, fewer_plain = (two_headed_guard(target_fpr=0.1) for _ in range(5))
    teach_traffic(model, tokenizer, plain, SAMPLE, pools=SHORT_POOLS, **kwargs)
    teach_traffic(model, tokenizer, first, SAMPLE, pools=SHORT_POOLS, cache_dir=cache, **kwargs)  # collects and writes
    reads = sorted(first.heads["harm"].reads)
    assert sorted(p.name for p in cache.iterdir()) == sorted(f"layer{layer}-{position}" for layer, position in reads)
    records = load_activations(cache / f"layer{reads[0][0]}-{reads[0][1]}").records
    assert len(records) == len(SHORT_POOLS) * ROWS_PER_POOL
    teach_traffic(model, tokenizer, again, SAMPLE, pools=SHORT_POOLS, cache_dir=cache, **kwargs)  # reads
    assert same_guard(first, plain) and same_guard(again, plain)  # the cache changes nothing in the fit
    # a cache written for more pools serves a fit on fewer (its rows were batched with others: equal to round-off)
    teach_traffic(model, tokenizer, fewer, SAMPLE, pools=SHORT_POOLS[:2], cache_dir=cache, **kwargs)
    teach_traffic(model, tokenizer, fewer_plain, SAMPLE, pools=SHORT_POOLS[:2], **kwargs)
    assert torch.allclose(harm_scores(fewer, HELD_OUT), harm_scores(fewer_plain, HELD_OUT), atol=1e-4)

    # the fit reads the cache, not the model: activations changed in the cache change the head
    folder = cache / f"layer{reads[0][0]}-{reads[0][1]}"
    store = load_activations(folder)
    save_activations(folder, store.activations + 1.0, store.records, store.hook, inputs=store.inputs)
    changed = two_headed_guard(target_fpr=0.1)
    teach_traffic(model, tokenizer, changed, SAMPLE, pools=SHORT_POOLS, cache_dir=cache, **kwargs)
    assert not torch.equal(
        changed.heads["harm"].state_dict()["probe.mean"], plain.heads["harm"].state_dict()["probe.mean"]
    )


def test_teach_traffic_refuses_a_cache_it_cannot_trust(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    kwargs = dict(fit_fraction=0.5, rows_per_pool=ROWS_PER_POOL, progress=False)
    cache = tmp_path / "cache"
    teach_traffic(
        model, tokenizer, two_headed_guard(target_fpr=0.1), SAMPLE, pools=SHORT_POOLS[:2], cache_dir=cache, **kwargs
    )
    guard = two_headed_guard(target_fpr=0.1)
    head, budget = guard.heads["harm"], copy.deepcopy(guard.budget)
    with pytest.raises(ValueError, match="lacks 24 of the 48 bundled prompts"):
        teach_traffic(model, tokenizer, guard, SAMPLE, pools=SHORT_POOLS, cache_dir=cache, **kwargs)

    layer, position = sorted(guard.heads["harm"].reads)[0]
    folder = cache / f"layer{layer}-{position}"
    store = load_activations(folder)
    records = [{**store.records[0], "digest": "0" * 16}, *store.records[1:]]
    save_activations(folder, store.activations, records, store.hook, inputs=store.inputs)
    with pytest.raises(ValueError, match="the text of 1 bundled prompts was different"):
        teach_traffic(model, tokenizer, guard, SAMPLE, pools=SHORT_POOLS[:2], cache_dir=cache, **kwargs)

    other = dataclasses.replace(store.hook, position="prompt_last" if position == "prompt_mean" else "prompt_mean")
    save_activations(folder, store.activations, store.records, other, inputs=store.inputs)
    with pytest.raises(ValueError, match=f"holds activations of layer {layer} {other.position}"):
        teach_traffic(model, tokenizer, guard, SAMPLE, pools=SHORT_POOLS[:2], cache_dir=cache, **kwargs)
    assert guard.heads["harm"] is head and guard.budget == budget


TAUGHT_ROWS = "the user's own benign prompts, a.txt (50 held back; 50 more taught to head 'harm')"
"""The rows of a budget :func:`teach_traffic` set, teaching head ``harm``."""


def test_teaching_a_taught_head_again_says_it_keeps_only_what_the_new_sample_holds():
    model, tokenizer, _ = tiny_guard("prompt_last")
    kwargs = dict(fit_fraction=0.5, pools=SHORT_POOLS[:2], rows_per_pool=ROWS_PER_POOL, progress=False)
    guard = two_headed_guard(target_fpr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        teach_traffic(model, tokenizer, guard, SAMPLE, **kwargs)
        assert not [w for w in caught if issubclass(w.category, ReteachWarning)]  # a head not taught before
        teach_traffic(model, tokenizer, guard, TRAFFIC, **kwargs)
    (reteach,) = [w for w in caught if issubclass(w.category, ReteachWarning)]
    assert not [w for w in caught if issubclass(w.category, ThresholdsResetWarning)]  # teach's own thresholds
    taught = "the user's own benign prompts (50 held back; 50 more taught to head 'harm')"
    assert str(reteach.message).startswith(f"head 'harm' was taught before ({taught}); it is fitted again on the")
    assert reteach.filename == __file__  # attributed to the caller's line
    assert reteach_warning(dataclasses.replace(guard.budget, rows=TAUGHT_ROWS), "other") == ""  # another head
    # thresholds set again since on other rows: the budget no longer says the head was taught
    assert reteach_warning(dataclasses.replace(guard.budget, rows="validation chat"), "harm") == ""
    assert reteach_warning(None, "harm") == ""


def test_teach_says_before_the_model_loads_that_a_taught_head_keeps_only_what_the_new_sample_holds(
    model_dir, tmp_path, capsys
):
    guard = two_headed_guard(target_fpr=0.1)
    guard.budget = dataclasses.replace(guard.budget, rows=TAUGHT_ROWS)
    taught, sample = tmp_path / "taught", tmp_path / "traffic.txt"
    guard.save_pretrained(taught)
    sample.write_text("".join(t + "\n" for t in TRAFFIC))
    flags = ["--pools", *SHORT_POOLS[:2], "--rows-per-pool", str(ROWS_PER_POOL), "--benign", str(sample)]
    checks = ["--chat-check", "0", "--domain-check", "0", "--harm-check", "0"]
    entry(["teach", "--guard", str(taught), "--model", str(model_dir), *flags, *checks, "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert f"warning: head 'harm' was taught before ({TAUGHT_ROWS}); it is fitted again" in err
    assert err.count("was taught before") == 1 and "ReteachWarning" not in err  # the API's warning is not repeated
    assert err.index("was taught before") < err.index("fitting head 'harm'")  # before the model's forward passes


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


def test_teach_under_a_system_turn_fits_and_sets_thresholds_under_it(model_dir, guard_dir, tmp_path, capsys):
    model, tokenizer, _ = tiny_guard("prompt_last")
    kwargs = dict(fit_fraction=0.5, pools=SHORT_POOLS, rows_per_pool=ROWS_PER_POOL, progress=False)
    default, turned, cached = (two_headed_guard(target_fpr=0.1) for _ in range(3))
    teach_traffic(model, tokenizer, default, SAMPLE, **kwargs)
    budget = teach_traffic(model, tokenizer, turned, SAMPLE, system=SHOP_TURN, **kwargs)
    assert turned.inputs.system == SHOP_TURN and default.inputs.system is None  # what generate and screen check against
    assert repr(SHOP_TURN) in budget.rows
    assert not torch.equal(  # the rows reached the head under the turn
        turned.heads["harm"].state_dict()["probe.mean"], default.heads["harm"].state_dict()["probe.mean"]
    )
    # the head's bundled rows were collected under the turn: a cache keeps them so, and a fit from it is the same
    cache = tmp_path / "cache"
    teach_traffic(model, tokenizer, cached, SAMPLE, system=SHOP_TURN, cache_dir=cache, **kwargs)
    assert same_guard(cached, turned)
    assert {load_activations(folder).inputs.system for folder in cache.glob("layer*")} == {SHOP_TURN}
    text = {p.id: p.text for pool in SHORT_POOLS for p in release_rows(pool, "fit")}
    for read in cached.heads["harm"].reads:
        store = load_activations(cache / read_folder(read))
        texts = [text[record["id"]] for record in store.records]
        under, _ = collect_prompt_features(model, tokenizer, texts, [read], system=SHOP_TURN, progress=False)
        assert torch.allclose(store.activations, under[read], atol=1e-5)

    sample, out = tmp_path / "traffic.txt", tmp_path / "mine"
    sample.write_text("".join(t + "\n" for t in SAMPLE))
    argv = ["teach", "--guard", str(guard_dir), "--model", str(model_dir), "--benign", str(sample), "--fit-fraction"]
    argv += ["0.5", *POOL_FLAGS, "--chat-check", "0"]
    argv += ["--domain-check", "0", "--harm-check", "0"]
    entry([*argv, "--system", SHOP_TURN])
    entry([*argv, "--out", str(out)])
    assert "bundled validation" not in capsys.readouterr().out  # each check is skipped with 0 rows
    assert SafetyGuard.from_pretrained(guard_dir).inputs.system == SHOP_TURN  # taught under the turn, in place
    assert repr(SHOP_TURN) in (guard_dir / "README.md").read_text()
    assert SafetyGuard.from_pretrained(out).inputs.system is None  # taught again under the template's own turn
    capsys.readouterr()


def test_a_cache_of_the_bundled_rows_holds_one_system_turn(model_dir, guard_dir, tmp_path, capsys):
    model, tokenizer, _ = tiny_guard("prompt_last")
    kwargs = dict(fit_fraction=0.5, pools=SHORT_POOLS[:2], rows_per_pool=ROWS_PER_POOL, progress=False)
    default_cache, turn_cache = tmp_path / "default", tmp_path / "turn"
    teach_traffic(model, tokenizer, two_headed_guard(target_fpr=0.1), SAMPLE, cache_dir=default_cache, **kwargs)
    teach_traffic(
        model, tokenizer, two_headed_guard(target_fpr=0.1), SAMPLE, cache_dir=turn_cache, system=SHOP_TURN, **kwargs
    )
    guard = two_headed_guard(target_fpr=0.1)
    head, budget = guard.heads["harm"], copy.deepcopy(guard.budget)
    with pytest.raises(ValueError, match=f"under the system turn the chat template's default, not {SHOP_TURN!r}"):
        teach_traffic(model, tokenizer, guard, SAMPLE, cache_dir=default_cache, system=SHOP_TURN, **kwargs)
    with pytest.raises(ValueError, match=f"under the system turn {SHOP_TURN!r}, not the chat template's default"):
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
            *SHORT_POOLS[:2],
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
            (default_cache, ["--system", SHOP_TURN], "the chat template's default"),
            (turn_cache, [], repr(SHOP_TURN)),
        ):
            with pytest.raises(SystemExit) as info:
                entry([*command, "--out", str(tmp_path / "out"), "--cache", str(cache), *system])
            assert info.value.code == 2 and f"argument --cache: {cache}" in (err := capsys.readouterr().err)
            assert f"under the system turn {stored}, not" in err
        with held_by_another_run(turn_cache), pytest.raises(SystemExit) as info:
            entry([*command, "--out", str(tmp_path / "out"), "--cache", str(turn_cache), "--system", SHOP_TURN])
        assert info.value.code == 2
        assert f"argument --cache: {turn_cache} is in use by another run" in capsys.readouterr().err


def test_teach_keeps_bundled_pools_within_the_budget_beside_the_held_back_prompts(
    model_dir, guard_dir, tmp_path, capsys
):
    sample, out = tmp_path / "traffic.txt", tmp_path / "mine"
    sample.write_text("".join(t + "\n" for t in SAMPLE))
    flags = ["--benign", str(sample), "--fit-fraction", "0.5", *POOL_FLAGS]
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


def test_an_interrupted_teach_without_a_cache_says_that_what_it_collected_was_not_kept(model_dir, guard_dir, tmp_path):
    sample = tmp_path / "traffic.txt"
    sample.write_text("".join(t + "\n" for t in SAMPLE))
    # as at a terminal, Ctrl-C raises KeyboardInterrupt even if this suite runs where SIGINT is ignored (in the
    # background of a shell), which a child inherits and Python then leaves ignored
    ctrl_c = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)"
    start = f"{ctrl_c}; from hf_lsad.cli.main import entry; entry(sys.argv[1:])"
    argv = [sys.executable, "-c", start, "teach", "--guard", str(guard_dir), "--model", str(model_dir)]
    argv += ["--benign", str(sample), *POOL_FLAGS, *CHECKS, "--out", str(tmp_path / "mine")]
    log = tmp_path / "log"
    with log.open("w") as out:  # a file, not a pipe, which a run's progress bars could fill
        process = subprocess.Popen(argv, stdout=out, stderr=out, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None and "collect" not in log.read_text():
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)  # Ctrl-C as the bundled rows go through the model
    assert process.wait(timeout=120) == 130, log.read_text()
    assert "collected so far were not kept: pass --cache DIR" in log.read_text()

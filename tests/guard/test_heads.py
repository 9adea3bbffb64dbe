"""A guard with named heads: the budget they share, their reports, their folder, and the errors around them."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
import warnings
from dataclasses import replace

import pytest
import torch
from tiny import (
    HEAD_PROBES,
    HEAD_READS,
    PROBE_KINDS,
    PROMPTS,
    UNSAFE_PROMPTS,
    fresh_guard,
    tiny_guard,
    tiny_head,
    tiny_head_rows,
    two_headed_guard,
)

from hf_lsad.capture.collect import collect_prompt_features, encode_prompts
from hf_lsad.capture.recorder import read_prompts
from hf_lsad.core.integrity import canonical_json
from hf_lsad.core.prompt_inputs import template_opening
from hf_lsad.core.prompt_tokens import fixed_openings
from hf_lsad.errors import GuardFormatError
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.heads import MLPProbe, ProbeConfig, SupervisedHead, SupervisedHeadConfig, balanced_weights
from hf_lsad.guard.threshold import allowed_flags, union_flag_rate
from hf_lsad.guard.types import BudgetConfig


def reads_of(guard: SafetyGuard, prompts: list[str]) -> dict:
    model, tokenizer, _ = tiny_guard("prompt_last")
    return collect_prompt_features(model, tokenizer, prompts, guard.reads, progress=False)[0]


def test_the_heads_share_one_budget_on_the_rows_it_was_set_on():
    guard = two_headed_guard(target_fpr=0.25)
    budget = guard.budget
    assert budget.heads == ["anomaly", "harm"] and budget.shares == pytest.approx([0.5, 0.5])
    output = guard(reads_of(guard, PROMPTS))
    assert float(output.flagged.float().mean()) == pytest.approx(budget.measured_fpr) and budget.measured_fpr <= 0.25
    scores = torch.stack([output.head_scores[name] for name in guard.head_names], 1)
    assert union_flag_rate(scores, budget.thresholds) == pytest.approx(budget.measured_fpr)
    assert guard.threshold == budget.thresholds[0]  # the anomaly head's threshold is the budget's


@pytest.mark.parametrize("kind", PROBE_KINDS)
def test_the_supervised_head_catches_its_kind_of_harm_and_says_so(kind):
    guard = two_headed_guard(kind=kind)
    reports = guard.reports(reads_of(guard, UNSAFE_PROMPTS[:8]))
    assert all(r.flagged and "harm" in r.decided_by and r.reading == "known" for r in reports)
    for report in reports:
        assert [head.name for head in report.heads] == ["anomaly", "harm"]
        assert report.heads[1].score > report.heads[1].threshold
        assert "FLAGGED by" in report.describe() and "(known)" in report.describe()


def same_features(got, expected) -> bool:
    """The same features in the same order, with values equal up to batched float arithmetic."""
    return [f.feature for f in got] == [f.feature for f in expected] and all(
        a.contribution == pytest.approx(b.contribution, rel=1e-4, abs=1e-6) for a, b in zip(got, expected)
    )


@pytest.mark.parametrize(
    ("anomaly", "harm", "decided", "reading"),
    [
        (-1e9, 2.0, ("anomaly",), "novel"),
        (1e9, -1.0, ("harm",), "known"),
        (-1e9, -1.0, ("anomaly", "harm"), "known"),
        (1e9, 2.0, (), None),
    ],
)
def test_which_head_decided_and_the_reading(anomaly, harm, decided, reading):
    guard = two_headed_guard()
    budget = copy.deepcopy(guard.budget)
    budget.thresholds = [anomaly, harm]
    guard.set_budget(budget)
    reads = reads_of(guard, PROMPTS[:3])
    for row, report in enumerate(guard.reports(reads, explain=True, top_k=4)):
        assert report.decided_by == decided and report.reading == reading and report.flagged == bool(decided)
        one_row = {read: values[row : row + 1] for read, values in reads.items()}
        if decided[:1] == ("harm",):  # the head that decided is explained: dimensions of its reads, largest first
            assert same_features(report.features, guard.heads["harm"].explain(one_row, top_k=4)[0])
            contributions = [f.contribution for f in report.features]
            assert contributions == sorted(contributions, reverse=True)
            assert all(0 <= f.feature < len(HEAD_READS) * guard.config.hook.hidden_size for f in report.features)
        else:  # the anomaly head decided (first in order), or none did: its SAE features
            assert same_features(report.features, guard.explain(one_row[guard.reads[0]], top_k=4)[0])


def test_a_head_explanation_sums_to_its_logit():
    head = tiny_head()
    reads = reads_of(two_headed_guard(), PROMPTS[:2])
    (terms,) = head.explain({r: v[:1] for r, v in reads.items()}, top_k=None)
    logit = sum(t.contribution for t in terms) + float(head.probe.bias)
    assert torch.sigmoid(torch.tensor(logit)).item() == pytest.approx(
        head({r: v[:1] for r, v in reads.items()}).item(), abs=1e-4
    )


@pytest.mark.parametrize("kind", PROBE_KINDS)
def test_a_head_explanation_is_input_times_gradient_of_its_logit(kind):
    head = tiny_head(kind)
    reads = reads_of(two_headed_guard(kind=kind), PROMPTS[:1] + UNSAFE_PROMPTS[:1])
    standard = head.probe.standardise(head.probe.features(reads)).requires_grad_(True)
    with torch.enable_grad():
        (gradient,) = torch.autograd.grad(head.probe.logit(standard).sum(), standard)
    for row, terms in enumerate(head.explain(reads, top_k=None)):
        expected = (standard[row] * gradient[row]).detach()
        got = torch.zeros_like(expected)
        got[[t.feature for t in terms]] = torch.tensor([t.contribution for t in terms])
        assert torch.allclose(got, expected, atol=1e-6)


def prompt_tokens(prompts: list[str], reads, padding_side: str = "right", tokenizer=None):
    """The reads of ``prompts`` on the tiny model, and every token's output (:class:`PromptTokens`)."""
    model, tiny_tokenizer, _ = tiny_guard("prompt_last")
    tokenizer = tokenizer or tiny_tokenizer
    inputs = encode_prompts(tokenizer, prompts, padding_side=padding_side)
    reader = read_prompts(model, reads, inputs["input_ids"], inputs["attention_mask"], keep_tokens=True)
    return reader.features(reads), reader.tokens(template_opening(tokenizer))


@pytest.mark.parametrize("kind", PROBE_KINDS)
def test_a_token_contribution_is_the_logit_the_head_loses_without_that_token(kind):
    head = tiny_head(kind)
    probe = head.probe
    reads, tokens = prompt_tokens(UNSAFE_PROMPTS[:1] + PROMPTS[:2], head.reads)

    def logit(values: dict) -> float:
        return float(probe.logit(probe.standardise(probe.features(values)))[0])

    for row, named in enumerate(head.explain_tokens(tokens, top_k=None)):
        real = tokens.mask[row].nonzero().flatten().tolist()  # the row's real tokens, past the right padding
        assert sorted(t.position for t in named) == list(range(int(tokens.fixed[row]), len(real)))  # all it moves
        assert [t.token_id for t in named] == [int(tokens.input_ids[row, real[t.position]]) for t in named]
        contributions = [t.contribution for t in named]
        assert contributions == sorted(contributions, reverse=True)
        full = logit({read: values[row : row + 1] for read, values in reads.items()})
        for t in named:
            kept = tokens.mask[row].clone()
            kept[real[t.position]] = False
            without = {
                (layer, position): tokens.hidden[layer][row][kept].mean(0, keepdim=True)
                if position == "prompt_mean"
                else reads[(layer, position)][row : row + 1]  # the last token's read is kept as it is
                for layer, position in head.reads
            }
            assert t.contribution == pytest.approx(full - logit(without), abs=1e-4)


def test_the_tokens_every_prompt_opens_with_are_not_named():
    """In a causal model the stream at the chat template's opening (a system turn, the user turn's header) is the
    same in every prompt, and the first token holds the attention sink: neither says why a prompt scored as it did."""
    head = tiny_head()
    _, tokenizer, _ = tiny_guard("prompt_last")
    assert template_opening(tokenizer) == (tokenizer.convert_tokens_to_ids("<|user|>"),)
    with_system = copy.deepcopy(tokenizer)
    with_system.chat_template = "<|system|>be kind<|end|>" + tokenizer.chat_template
    opening = template_opening(with_system)
    assert "".join(with_system.convert_ids_to_tokens(list(opening))) == "<|system|>be kind<|end|><|user|>"
    for padding_side in ("left", "right"):
        _, tokens = prompt_tokens(UNSAFE_PROMPTS[:2], head.reads, padding_side, tokenizer=with_system)
        assert tokens.fixed.tolist() == [len(opening)] * 2
        for named in head.explain_tokens(tokens, top_k=None):
            assert min(t.position for t in named) == len(opening)  # counted from the row's first real token
    raw = fixed_openings(torch.tensor([[5, 6, 7], [0, 8, 9]]), torch.tensor([[1, 1, 1], [0, 1, 1]]), opening=(5, 6))
    assert raw.tolist() == [2, 1]  # a row without the opening: its first token alone


def test_a_head_that_reads_no_prompt_mean_names_no_token():
    from hf_lsad.guard.heads.training import fit_head

    last_only = [read for read in HEAD_READS if read[1] == "prompt_last"]
    reads, tokens = prompt_tokens(PROMPTS + UNSAFE_PROMPTS, last_only)
    labels = torch.tensor([0] * len(PROMPTS) + [1] * len(UNSAFE_PROMPTS))
    head = fit_head(
        "harm",
        reads,
        labels,
        ["benign"] * len(PROMPTS) + ["stealing"] * len(UNSAFE_PROMPTS),
        ProbeConfig(reads=last_only),
    )
    assert head.explain_tokens(tokens.rows(torch.arange(2))) == [(), ()]
    with pytest.raises(KeyError, match="whose token outputs were not kept"):
        tiny_head().explain_tokens(tokens.rows(torch.arange(2)))


def test_reports_name_the_tokens_of_the_supervised_head_that_decided():
    guard = two_headed_guard()
    budget = copy.deepcopy(guard.budget)
    budget.thresholds[0] = 1e9  # the anomaly head flags nothing: the supervised head decides the unsafe rows
    guard.set_budget(budget)
    prompts = PROMPTS[:2] + UNSAFE_PROMPTS[:2]
    reads, tokens = prompt_tokens(prompts, guard.reads)
    reports = guard.reports(reads, explain=True, top_k=3, tokens=tokens)
    assert [r.explained_head for r in reports] == [r.decided_by[0] if r.decided_by else "anomaly" for r in reports]
    assert {r.explained_head for r in reports} == {"anomaly", "harm"}
    for row, report in enumerate(reports):
        if report.explained_head == "anomaly":
            assert report.tokens is None  # the anomaly head reads one token
        else:
            assert report.tokens == guard.heads["harm"].explain_tokens(tokens.rows(torch.tensor([row])), top_k=3)[0]
    assert all(r.tokens is None for r in guard.reports(reads, explain=True))  # no tokens given: none named
    assert all(r.tokens is None and r.features is None for r in guard.reports(reads, tokens=tokens))  # not asked
    broken = {read: values.clone() for read, values in reads.items()}
    broken[guard.reads[0]][2] = float("nan")
    with pytest.warns(RuntimeWarning, match="NaN or inf"):
        failed = guard.reports(broken, explain=True, top_k=3, tokens=tokens)
    assert failed[2].error is not None and failed[2].tokens is None
    assert [r.tokens for r in failed[:2] + failed[3:]] == [r.tokens for r in reports[:2] + reports[3:]]
    with pytest.raises(ValueError, match="tokens of 2 prompts for 4 rows"):
        guard.reports(reads, explain=True, tokens=tokens.rows(torch.arange(2)))


def test_an_mlp_head_is_not_a_logistic_head_in_disguise():
    logistic, mlp = tiny_head("logistic"), tiny_head("mlp")
    assert type(mlp.probe).__name__ == "MLPProbe" and mlp.probe.hidden_weight.shape == (8, logistic.probe.width)
    reads = reads_of(two_headed_guard(), PROMPTS[:4] + UNSAFE_PROMPTS[:4])
    standard = mlp.probe.standardise(mlp.probe.features(reads))
    local = mlp.probe.local_weights(standard)  # the linear piece each row falls on
    assert not torch.allclose(local[0], local[-1])
    with pytest.raises(ValueError, match="kind must be"):
        ProbeConfig(kind="svm")


def test_an_mlp_of_several_fits_averages_their_logits():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(120, 6, generator=generator)
    labels = (features[:, 0] + 0.5 * features[:, 1] ** 2 > 0.5).long()
    reads = [(1, "prompt_last")]
    config = ProbeConfig(reads=reads, kind="mlp", mlp_units=4, seed=3, mlp_members=3, max_iter=50)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # too few epochs to converge: the average, not the fit, is tested
        mean = MLPProbe(config, 6).fit(features, labels)
        singles = [MLPProbe(replace(config, seed=3 + i, mlp_members=1), 6).fit(features, labels) for i in range(3)]
    assert mean.hidden_weight.shape == (12, 6) and config.label == "mlp 4 x 3 fits"
    assert torch.equal(mean.hidden_weight[4:8], singles[1].hidden_weight)
    standard = mean.standardise(features)
    expected = torch.stack([single.logit(standard) for single in singles]).mean(0)
    assert torch.allclose(mean.logit(standard), expected, atol=1e-5)
    assert not torch.allclose(singles[0].logit(standard), singles[1].logit(standard))


@pytest.mark.parametrize("kind", PROBE_KINDS)
def test_save_and_load_round_trip_bit_exact(tmp_path, kind):
    guard = two_headed_guard(kind=kind)
    guard.save_pretrained(tmp_path / "g")
    loaded = SafetyGuard.from_pretrained(tmp_path / "g")
    assert loaded.head_names == guard.head_names and loaded.budget == guard.budget
    assert loaded.heads["harm"].config == guard.heads["harm"].config
    for name, tensor in guard.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    reads = reads_of(guard, PROMPTS[:4] + UNSAFE_PROMPTS[:4])
    assert guard.reports(reads) == loaded.reports(reads)
    assert (tmp_path / "g" / "heads" / "harm.safetensors").is_file()


def test_a_budget_with_confidence_flags_fewer_rows_and_is_kept_on_disk(tmp_path):
    guard = two_headed_guard()
    reads = reads_of(guard, PROMPTS)
    plain = guard.fit_budget(reads, target_fpr=0.25, shares=[0.5, 0.5])
    bounded = guard.fit_budget(reads, target_fpr=0.25, shares=[0.5, 0.5], confidence=0.9)
    assert plain.confidence is None and bounded.confidence == 0.9
    assert round(bounded.measured_fpr * 96) <= allowed_flags(96, 0.25, 0.9) < round(plain.measured_fpr * 96)
    assert float(guard(reads).flagged.float().mean()) == pytest.approx(bounded.measured_fpr)
    guard.save_pretrained(tmp_path / "g")
    assert SafetyGuard.from_pretrained(tmp_path / "g").budget == bounded


def test_a_head_written_before_probe_kinds_loads_as_logistic(tmp_path):
    guard = two_headed_guard()
    guard.save_pretrained(tmp_path / "g")

    def as_written_before(config):  # the head's probe settings and their integrity record without the new fields
        for probe in (config["heads"][0]["probe"], config["integrity"]["settings"]["heads"][0]["probe"]):
            for key in ("kind", "mlp_units", "mlp_alpha", "seed"):
                probe.pop(key)
        record = config["integrity"]
        record["settings_sha256"] = hashlib.sha256(canonical_json(record["settings"]).encode()).hexdigest()

    edit_config(tmp_path / "g", as_written_before)
    loaded = SafetyGuard.from_pretrained(tmp_path / "g")
    assert loaded.heads["harm"].config == guard.heads["harm"].config
    reads = reads_of(guard, PROMPTS[:2] + UNSAFE_PROMPTS[:2])
    assert loaded.reports(reads) == guard.reports(reads)


def test_an_mlp_head_written_before_mlp_members_loads_as_one_fit(tmp_path):
    guard = two_headed_guard(kind="mlp")
    guard.save_pretrained(tmp_path / "g")

    def as_written_before(config):  # the head's probe settings and their integrity record without the field
        for probe in (config["heads"][0]["probe"], config["integrity"]["settings"]["heads"][0]["probe"]):
            probe.pop("mlp_members")
        record = config["integrity"]
        record["settings_sha256"] = hashlib.sha256(canonical_json(record["settings"]).encode()).hexdigest()

    edit_config(tmp_path / "g", as_written_before)
    loaded = SafetyGuard.from_pretrained(tmp_path / "g")
    assert loaded.heads["harm"].config == guard.heads["harm"].config
    reads = reads_of(guard, PROMPTS[:2] + UNSAFE_PROMPTS[:2])
    assert loaded.reports(reads) == guard.reports(reads)


def test_a_two_headed_folder_written_before_confidence_loads_with_the_quantile_rule(tmp_path):
    guard = two_headed_guard()
    guard.save_pretrained(tmp_path / "g")

    def as_written_before(config):  # the budget and its integrity record without the field
        config["budget"].pop("confidence")
        record = config["integrity"]
        record["settings"]["budget"].pop("confidence")
        record["settings_sha256"] = hashlib.sha256(canonical_json(record["settings"]).encode()).hexdigest()

    edit_config(tmp_path / "g", as_written_before)
    loaded = SafetyGuard.from_pretrained(tmp_path / "g")
    assert loaded.budget.confidence is None and loaded.budget.thresholds == guard.budget.thresholds


def test_a_single_head_guard_folder_has_no_heads_and_scores_a_tensor(tmp_path):
    guard = fresh_guard("prompt_last")
    guard.save_pretrained(tmp_path / "g")
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    assert "heads" not in config and "budget" not in config
    loaded = SafetyGuard.from_pretrained(tmp_path / "g")
    assert loaded.head_names == ["anomaly"] and loaded.budget is None
    x = torch.randn(3, guard.config.hook.hidden_size)
    assert loaded.reports(x)[0].heads == () and loaded.reports(x)[0].reading is None


# --- bad input ---------------------------------------------------------------------------------------------------


def head_of(width: int, reads=HEAD_READS, name: str = "other") -> SupervisedHead:
    return SupervisedHead(
        SupervisedHeadConfig(name=name, probe=ProbeConfig(reads=reads), hidden_size=width, n_safe=1, n_unsafe=1)
    )


def test_a_head_that_does_not_fit_the_model_is_refused():
    guard = two_headed_guard()
    width = guard.config.hook.hidden_size
    with pytest.raises(ValueError, match="reads width"):
        guard.add_head(head_of(width + 1))
    with pytest.raises(ValueError, match="reads layers"):
        guard.add_head(head_of(width, reads=[(99, "prompt_mean")]))
    with pytest.raises(ValueError, match="already has a head named 'harm'"):
        guard.add_head(head_of(width, name="harm"))
    with pytest.raises(ValueError, match="named 'harm': 'Harm' differs from it only in case"):
        guard.add_head(head_of(width, name="Harm"))  # heads/Harm.safetensors is heads/harm.safetensors on macOS
    with pytest.raises(ValueError, match="names the paper's head"):
        head_of(width, name="anomaly")
    with pytest.raises(ValueError, match="a head name"):
        head_of(width, name="../escape")
    with pytest.raises(ValueError, match="Add heads to a prompt_last guard"):
        fresh_guard("response_last").add_head(head_of(width))


def test_scoring_needs_every_read_and_a_budget_for_every_head():
    guard = two_headed_guard()
    reads = reads_of(guard, PROMPTS[:2])
    with pytest.raises(ValueError, match="pass a mapping"):
        guard(reads[guard.reads[0]])
    with pytest.raises(ValueError, match="missing"):
        guard({guard.reads[0]: reads[guard.reads[0]]})
    with pytest.raises(ValueError, match="different numbers of rows"):
        guard({**reads, HEAD_READS[0]: reads[HEAD_READS[0]][:1]})
    with pytest.raises(TypeError, match="mapping"):
        guard([1, 2])
    guard.add_head(head_of(guard.config.hook.hidden_size))
    with pytest.raises(RuntimeError, match="fit_budget"):
        guard(reads)
    with pytest.raises(ValueError, match="positive share"):
        guard.fit_budget(reads, shares=[0.5, 0.5])


def test_a_nan_in_any_read_fails_closed_for_that_row_only():
    guard = two_headed_guard()
    reads = {read: values.clone() for read, values in reads_of(guard, PROMPTS[:3]).items()}
    reads[HEAD_READS[0]][1, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reports = guard.reports(reads)
    assert any("fail closed" in str(w.message) for w in caught)
    assert reports[1].flagged and reports[1].error is not None and math.isnan(reports[1].score)
    clean = guard.reports({read: values[[0, 2]] for read, values in reads.items()})
    assert [reports[0], reports[2]] == clean


def edit_config(folder, edit):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def case_twin(folder):
    """A second head whose name differs from the first's only in case, with weights of its own (on Linux)."""
    shutil.copy(folder / "heads" / "harm.safetensors", folder / "heads" / "HARM.safetensors")
    edit_config(folder, lambda c: c["heads"].append({**c["heads"][0], "name": "HARM"}))


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (lambda folder: (folder / "heads" / "harm.safetensors").unlink(), "has no weights"),
        (lambda folder: edit_config(folder, lambda c: c["heads"].append(c["heads"][0])), "share a name"),
        (lambda folder: case_twin(folder), "share a name"),
        (lambda folder: edit_config(folder, lambda c: c.pop("budget")), "come together"),
        (lambda folder: edit_config(folder, lambda c: c["budget"]["heads"].reverse()), "must be distinct and start"),
        (lambda folder: edit_config(folder, lambda c: c["heads"][0].update(hidden_size=7)), "shape"),
        (lambda folder: edit_config(folder, lambda c: c["heads"][0].update(name="x/y")), "a head name"),
        (lambda folder: edit_config(folder, lambda c: c["heads"][0]["probe"].update(kind="svm")), "kind"),
        (lambda folder: edit_config(folder, lambda c: c["heads"][0].update(balance="by hand")), "balance"),
    ],
)
@pytest.mark.parametrize("kind", PROBE_KINDS)
def test_a_broken_head_in_a_guard_folder_is_a_format_error(tmp_path, edit, error, kind):
    two_headed_guard(kind=kind).save_pretrained(tmp_path / "g")
    edit(tmp_path / "g")
    with pytest.raises(GuardFormatError, match=error):
        SafetyGuard.from_pretrained(tmp_path / "g")


def test_an_mlp_head_whose_weights_are_not_its_width_is_a_format_error(tmp_path):
    two_headed_guard(kind="mlp").save_pretrained(tmp_path / "g")
    edit_config(tmp_path / "g", lambda c: c["heads"][0]["probe"].update(mlp_units=9))
    with pytest.raises(GuardFormatError, match="shape"):
        SafetyGuard.from_pretrained(tmp_path / "g")


def test_a_head_that_names_its_kind_must_hold_every_setting(tmp_path):
    two_headed_guard(kind="mlp").save_pretrained(tmp_path / "g")
    edit_config(tmp_path / "g", lambda c: c["heads"][0]["probe"].pop("mlp_units"))
    with pytest.raises(GuardFormatError, match="missing config key"):
        SafetyGuard.from_pretrained(tmp_path / "g")


def test_an_edited_budget_is_caught_by_the_integrity_record(tmp_path):
    two_headed_guard().save_pretrained(tmp_path / "g")
    edit_config(tmp_path / "g", lambda c: c["budget"]["thresholds"].__setitem__(1, 0.999))
    with pytest.raises(GuardFormatError, match="budget"):
        SafetyGuard.from_pretrained(tmp_path / "g")


def test_a_budget_must_cover_the_heads_and_split_one_whole():
    with pytest.raises(ValueError, match="sum to 1"):
        BudgetConfig(["anomaly", "h"], [0.5, 0.6], [1.0, 0.5], target_fpr=0.05, measured_fpr=0.05, n_rows=10)
    with pytest.raises(ValueError, match="2 heads, 1 shares"):
        BudgetConfig(["anomaly", "h"], [1.0], [1.0, 0.5], target_fpr=0.05, measured_fpr=0.05, n_rows=10)


@pytest.mark.parametrize("kind", PROBE_KINDS)
def test_weights_of_your_own_fit_the_head_with_them_and_the_head_says_so(tmp_path, kind):
    from hf_lsad.guard.heads.training import fit_head

    reads, labels, groups = tiny_head_rows()
    config = ProbeConfig(reads=HEAD_READS, **HEAD_PROBES[kind])
    by_source = fit_head("harm", reads, labels, groups, config)
    given = fit_head("harm", reads, labels, groups, config, weights=balanced_weights(groups, labels))
    assert (by_source.config.balance, given.config.balance) == ("source", "given")
    for name, tensor in by_source.state_dict().items():  # the same weights fit the same head
        assert torch.equal(tensor, given.state_dict()[name]), name
    tilted = balanced_weights(groups, labels)
    tilted[labels == 1] *= 4.0  # the unsafe rows weigh more: the head leans to flagging
    leaning = fit_head("harm", reads, labels, groups, config, weights=tilted)
    assert (leaning.logit(reads) - by_source.logit(reads)).mean() > 0

    guard = two_headed_guard(kind=kind)
    guard.heads["harm"].config = replace(guard.heads["harm"].config, balance="given")
    guard.save_pretrained(tmp_path / "g")
    assert SafetyGuard.from_pretrained(tmp_path / "g").heads["harm"].config.balance == "given"


@pytest.mark.parametrize(
    ("weights", "error"),
    [
        (lambda labels: torch.ones(len(labels) - 1), "one weight per row"),
        (lambda labels: torch.full((len(labels),), float("nan")), "finite and non-negative"),
        (lambda labels: -torch.ones(len(labels)), "finite and non-negative"),
        (lambda labels: (labels == 0).double(), "the unsafe rows' weights sum to 0"),
        (lambda labels: (labels == 1).double(), "the safe rows' weights sum to 0"),
        (lambda labels: [1.0] * len(labels), "must be a tensor"),
    ],
)
def test_weights_that_cannot_fit_a_head_are_refused(weights, error):
    from hf_lsad.guard.heads.training import fit_head

    reads, labels, groups = tiny_head_rows()
    with pytest.raises((ValueError, TypeError), match=error):
        fit_head("harm", reads, labels, groups, ProbeConfig(reads=HEAD_READS), weights=weights(labels))


def test_a_head_fitted_your_own_way_is_added_with_its_share_and_a_failure_leaves_the_guard_as_it_was():
    from hf_lsad.guard.heads.training import add_fitted_head

    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = two_headed_guard()
    head = copy.deepcopy(tiny_head())
    head.config = replace(head.config, name="mine")
    budget = add_fitted_head(model, tokenizer, guard, head, share=0.2, threshold_rows=120, progress=False)
    assert guard.head_names == ["anomaly", "harm", "mine"] and guard.budget is budget
    assert budget.shares == pytest.approx([0.4, 0.4, 0.2]) and budget.n_rows == 120 and budget.rows == "validation chat"
    assert 0.0 < budget.measured_fpr <= budget.target_fpr == 0.25  # the guard's own target is kept

    before = two_headed_guard()
    other = copy.deepcopy(tiny_head())
    other.config = replace(other.config, name="other")
    with pytest.raises(ValueError, match="share must be in"):
        add_fitted_head(model, tokenizer, before, other, share=1.0)
    with pytest.raises(ValueError):  # fails inside the threshold fit: the head is taken out again
        add_fitted_head(model, tokenizer, before, other, threshold_rows=120, max_batch_tokens=-1, progress=False)
    assert before.head_names == ["anomaly", "harm"] and before.budget.shares == pytest.approx([0.5, 0.5])


@pytest.mark.parametrize(
    ("rows", "advice"),
    [
        ("validation chat", None),  # the released guard's: set on that chat again
        ("validation chat, under the system turn 'You are a bank.'", None),
        ("the user's own benign prompts, traffic.txt", "hf-lsad set-budget --benign YOUR_SAMPLE"),  # set-budget
        ("traffic.txt, and the bundled validation rows of chat (1,338), each kind within the budget", "set-budget"),
        ("validation chat, and the bundled validation rows of statements (201), each kind within the budget", "set-b"),
        # teach: its head was fitted on part of the sample, so the whole sample must not set the thresholds
        ("the user's own benign prompts (40 held back; 60 more taught to head 'harm')", "teach it again on the same"),
    ],
)
def test_adding_a_head_says_when_it_sets_thresholds_set_on_other_rows_again_on_chat(rows, advice):
    from hf_lsad.errors import ThresholdsResetWarning
    from hf_lsad.guard.heads.training import add_fitted_head

    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = two_headed_guard()
    guard.budget = replace(guard.budget, rows=rows)
    head = copy.deepcopy(tiny_head())
    head.config = replace(head.config, name="mine")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        add_fitted_head(model, tokenizer, guard, head, threshold_rows=120, progress=False)
    reset = [w for w in caught if issubclass(w.category, ThresholdsResetWarning)]
    assert len(reset) == int(advice is not None)
    if advice is not None:
        message = str(reset[0].message)
        assert f"the guard's thresholds had been set on {rows}; with head 'mine' added" in message
        assert advice in message and ("set-budget --benign" in message) != advice.startswith("teach")
        assert reset[0].filename == __file__  # attributed to the caller's line

"""Explanations: the SAE features behind a score, exact for L1/L2, and ``hf-lsad explain``."""

from __future__ import annotations

import argparse
import copy
import io

import pytest
import torch
from tiny import LAYER, MIXED_BATCH, PROMPTS, UNSAFE_PROMPTS, tiny_guard, two_headed_guard

from hf_lsad.capture.collect import collect_activations, encode_prompts
from hf_lsad.cli.explain import explain_command
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.data.store import ActivationStore, save_activations
from hf_lsad.detectors import FreqMaskConfig
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard.fitting import fit_guard


def guard_with(metric: str, use_mask: bool = True, scope: str = "global"):
    model, tokenizer, base = tiny_guard("prompt_last")
    activations = collect_activations(
        model, tokenizer, PROMPTS, layer=LAYER, position="prompt_last", progress=False
    ).activations
    config = FreqMaskConfig(
        kmeans=KMeansConfig(n_clusters=3), mask_size=16, score_metric=metric, use_mask=use_mask, mask_scope=scope
    )
    guard = fit_guard(activations, base.config.hook, "freqmask-km", config, base.sae, progress=False).guard
    return model, tokenizer, guard, activations


@pytest.mark.parametrize(
    "metric,use_mask,scope",
    [
        ("l1", True, "global"),
        ("l2", True, "global"),
        ("l1", True, "local"),
        ("l2", False, "global"),
        ("mahalanobis", True, "global"),
    ],
)
def test_contributions_sum_to_the_score(metric, use_mask, scope):
    _, _, guard, activations = guard_with(metric, use_mask, scope)
    rows = activations[:20] + 0.5 * torch.randn(20, activations.shape[1], generator=torch.Generator().manual_seed(0))
    scores = guard(rows).scores
    explained = guard.explain(rows, top_k=None)
    for score, features in zip(scores.tolist(), explained):
        assert sum(f.contribution for f in features) == pytest.approx(score, abs=1e-4)
        contributions = [f.contribution for f in features]
        assert contributions == sorted(contributions, reverse=True)
        assert len(features) == (16 if use_mask else guard.sae.config.d_sae)
    if metric != "mahalanobis":
        assert all(f.contribution >= 0 for features in explained for f in features)


def test_features_carry_the_code_and_the_cluster_centroid():
    _, _, guard, activations = guard_with("l1")
    rows = activations[:5]
    with torch.no_grad():
        codes = guard.sae.encode(rows)
    clusters = guard(rows).clusters
    for r, features in enumerate(guard.explain(rows, top_k=4)):
        assert len(features) == 4
        for f in features:
            assert f.activation == pytest.approx(float(codes[r, f.feature]), abs=1e-6)
            assert f.typical == pytest.approx(float(guard.detector.centroids[clusters[r], f.feature]), abs=1e-6)
            assert f.contribution == pytest.approx(abs(f.activation - f.typical), abs=1e-5)


def test_reports_carry_explanations_only_when_asked():
    model, tokenizer, guard = tiny_guard("prompt_last")
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    assert all(r.features is None for r in guarded.screen(MIXED_BATCH))
    screened = guarded.screen(MIXED_BATCH, explain=True, top_k=3)
    generated = guarded.generate(
        **encode_prompts(tokenizer, MIXED_BATCH), max_new_tokens=2, do_sample=False, explain=True, explain_top_k=3
    )
    assert generated.shape[0] == 3
    for a, b in zip(screened, guarded.last_safety):
        assert len(a.features) == 3 and [f.feature for f in a.features] == [f.feature for f in b.features]


def test_explain_needs_sae_features():
    from hf_lsad.detectors import detector_class

    model, tokenizer, base = tiny_guard("prompt_last")
    activations = collect_activations(
        model, tokenizer, PROMPTS, layer=LAYER, position="prompt_last", progress=False
    ).activations
    method = detector_class("mahalanobis")
    guard = fit_guard(activations, base.config.hook, "mahalanobis", method.config_class(), None, progress=False).guard
    with pytest.raises(NotImplementedError, match="does not score SAE features"):
        guard.explain(activations[:2])


def saved_model_guard_and_store(tmp_path):
    """The tiny model (its folder is returned), its prompt_last guard under ``guard/`` and a store of PROMPTS under
    ``store/``."""
    model, tokenizer, guard = tiny_guard("prompt_last")
    model_dir = tmp_path / "tiny-llama"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    guard.save_pretrained(tmp_path / "guard")
    activations = collect_activations(
        model, tokenizer, PROMPTS, layer=LAYER, position="prompt_last", progress=False
    ).activations
    records = [{"id": f"p{i}", "text": p} for i, p in enumerate(PROMPTS)]
    save_activations(tmp_path / "store", activations, records, HookPoint.from_model(model, LAYER, "prompt_last"))
    return model_dir


def test_explain_command_prints_features_and_top_prompts(tmp_path):
    model_dir = saved_model_guard_and_store(tmp_path)
    out = io.StringIO()
    args = argparse.Namespace(
        guard=str(tmp_path / "guard"),
        activations=str(tmp_path / "store"),
        model=str(model_dir),
        top_k=3,
        examples=2,
        prompts=["hello there", "question 7: what is 7 plus 0?"],
    )
    explain_command(args, out=out)
    text = out.getvalue()
    assert text.count("prompt: ") == 2 and "contribution" in text
    assert "question" in text or "weather" in text  # store prompts are shown by their text
    store = ActivationStore(tmp_path / "store")
    assert len(store) == len(PROMPTS)


def save_harm_deciding_guard(path) -> None:
    """The tiny two-headed guard with an anomaly head that flags nothing: the harm head decides the unsafe prompts."""
    guard = two_headed_guard()
    budget = copy.deepcopy(guard.budget)
    budget.thresholds[0] = 1e9
    guard.set_budget(budget)
    guard.save_pretrained(path)


def test_generate_explain_prints_the_words_behind_a_supervised_verdict(tmp_path, capsys):
    from hf_lsad.cli.main import main

    model_dir = saved_model_guard_and_store(tmp_path)
    save_harm_deciding_guard(tmp_path / "two-heads")
    prompts = [UNSAFE_PROMPTS[0], PROMPTS[0]]
    argv = ["generate", "--model", str(model_dir), "--guard", str(tmp_path / "two-heads"), "--max-new-tokens", "2"]
    main([*argv, "--explain", "2", *prompts])
    blocks = capsys.readouterr().out.split("prompt:   ")[1:]
    assert "FLAGGED by harm" in blocks[0] and "FLAGGED" not in blocks[1]
    (why,) = [line for line in blocks[0].splitlines() if line.startswith("why:")]
    assert why.startswith("why:      harm: '") and why.count("'") == 4 and "why:" not in blocks[1]
    main([*argv, *prompts])
    assert "why:" not in capsys.readouterr().out  # only when asked


def test_explain_command_names_the_tokens_when_a_supervised_head_decided(tmp_path):
    """The harm head's features are dimensions of its reads, not SAE features: they were printed as SAE features,
    beside store prompts of unrelated features and a sum against the anomaly head's score."""
    model_dir = saved_model_guard_and_store(tmp_path)
    save_harm_deciding_guard(tmp_path / "two-heads")
    out = io.StringIO()
    prompts = [UNSAFE_PROMPTS[0], *PROMPTS[:3]]
    args = argparse.Namespace(
        guard=str(tmp_path / "two-heads"),
        activations=str(tmp_path / "store"),
        model=str(model_dir),
        top_k=3,
        examples=1,
        prompts=prompts,
    )
    explain_command(args, out=out)
    blocks = out.getvalue().split("prompt: ")[1:]
    assert len(blocks) == len(prompts)
    by_harm = [block for block in blocks if "FLAGGED by harm" in block]
    assert by_harm and len(by_harm) < len(blocks)
    for block in blocks:
        lines = block.splitlines()
        if block in by_harm:
            assert "the prompt tokens that raise the harm head's logit most" in lines[2]
            assert len(lines) == 3 + 3 and all("(token " in line for line in lines[3:])
            assert "top prompts in the store" not in block and "SAE features" not in block
        else:
            assert "the SAE features that add most to the anomaly head's score" in lines[2]
            assert "top prompts in the store" in lines[3]


def test_explain_command_without_a_store_lists_the_features_alone(tmp_path, capsys):
    from hf_lsad.cli.main import main

    model_dir = saved_model_guard_and_store(tmp_path)
    main(["explain", "--guard", str(tmp_path / "guard"), "--model", str(model_dir), "--top-k", "2", "hello there"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].endswith("head's score:") and lines[3].split() == [
        "feature",
        "activation",
        "typical",
        "contribution",
    ]
    assert len(lines) == 4 + 2 + 1  # two features, no store prompts under them, and their sum


def test_explain_subcommand(tmp_path, capsys):
    from hf_lsad.cli.main import main

    model_dir = saved_model_guard_and_store(tmp_path)
    main(
        [
            "explain",
            "--guard",
            str(tmp_path / "guard"),
            "--activations",
            str(tmp_path / "store"),
            "--model",
            str(model_dir),
            "--top-k",
            "2",
            "hello there",
        ]
    )
    out = capsys.readouterr().out
    assert "prompt: 'hello there'" in out and out.count("\n  ") >= 3


def test_explain_command_reports_a_row_it_could_not_score(tmp_path):
    """A NaN activation fails closed (flagged, not scored); explain says so instead of listing features."""
    model_dir = saved_model_guard_and_store(tmp_path)
    from transformers import AutoModelForCausalLM

    broken = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        broken.model.layers[0].mlp.down_proj.weight.fill_(float("nan"))  # every later residual is NaN
    broken.save_pretrained(model_dir)
    out = io.StringIO()
    args = argparse.Namespace(
        guard=str(tmp_path / "guard"),
        activations=str(tmp_path / "store"),
        model=str(model_dir),
        top_k=3,
        examples=2,
        prompts=["hello there"],
    )
    with pytest.warns(RuntimeWarning, match="NaN or inf"):
        explain_command(args, out=out)
    text = out.getvalue()
    assert "prompt: 'hello there'" in text and "not scored" in text and "contribution" not in text

"""hf-lsad's warnings point at the user's line, whatever path inside hf-lsad, torch or transformers raised them."""

from __future__ import annotations

import copy
import warnings

import torch
from tiny import LAYER, PROMPTS, tiny_guard

from hf_lsad import GuardedModelForCausalLM, encode_prompts
from hf_lsad.capture.collect import collect_activations
from hf_lsad.detectors import FreqMaskConfig
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.errors import DegenerateFitWarning
from hf_lsad.guard.fitting import fit_guard


def caught(category: type[Warning], call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        call()
    found = [record for record in records if issubclass(record.category, category)]
    assert found, f"no {category.__name__} was raised"
    return found


def test_a_fit_warning_points_past_the_no_grad_wrapper():
    model, tokenizer, guard = tiny_guard("prompt_last")
    few = collect_activations(model, tokenizer, PROMPTS[:12], layer=LAYER, position="prompt_last", progress=False)
    config = FreqMaskConfig(kmeans=KMeansConfig(n_clusters=3), mask_size=16)

    def fit() -> None:
        fit_guard(few.activations, guard.config.hook, "freqmask-km", config, guard.sae, progress=False)

    for record in caught(DegenerateFitWarning, fit):  # fit_rows runs under torch's no_grad decorator
        assert record.filename == __file__, record.filename


def test_a_fail_closed_row_warns_at_the_call_that_scored_it():
    model, tokenizer, guard = tiny_guard("prompt_last")
    nan = torch.full((2, guard.config.hook.hidden_size), float("nan"))
    (record,) = caught(RuntimeWarning, lambda: guard.reports(nan))  # through nn.Module calls
    assert record.filename == __file__ and "fail closed" in str(record.message)

    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.layers[0].mlp.down_proj.weight.fill_(float("nan"))
    guarded = GuardedModelForCausalLM(broken, guard, tokenizer=tokenizer)
    inputs = encode_prompts(tokenizer, ["hello there"])

    def generate() -> None:  # the verdict comes from the guard's logits processor, inside transformers' generate
        guarded.generate(**inputs, max_new_tokens=2, do_sample=False, on_flag="stop")

    for record in caught(RuntimeWarning, generate):
        assert record.filename == __file__, record.filename

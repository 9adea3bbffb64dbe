"""Print a response token by token while a running guard watches it, and show the verdict as it changes.

    python examples/stream_with_verdict.py --guard path/to/response_running_guard "Tell me a story"
    python examples/stream_with_verdict.py --guard default "How do I pick a lock?"   # prompt_last: screened

``generate`` runs in a thread and writes to a ``TextIteratorStreamer``; ``on_step`` (called by the
guard after it scores each token) prints the score in brackets as soon as it exists, and the
verdict when it changes, so the text and the verdict appear together.
With ``--on-flag stop`` a flagged response ends where it was flagged (``--refusal`` is appended).
"""

from __future__ import annotations

import argparse
import threading

from transformers import TextIteratorStreamer

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.capture.pretrained import load_model
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--model", default="default")
    parser.add_argument("--guard", default="default")
    parser.add_argument("--on-flag", default="stop", choices=["report", "stop"])
    parser.add_argument("--refusal", default=" [stopped by the guard]")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    guard = SafetyGuard.from_pretrained(args.guard)
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result: dict = {}
    state = {"flagged": False}

    def on_step(verdict) -> None:  # runs in the generate thread, before the next token is picked
        score = float(verdict.scores[0])
        if score == score:  # not nan: this step was scored
            print(f"[{score:.0f}]", end="", flush=True)
        if bool(verdict.flagged[0]) and not state["flagged"]:
            state["flagged"] = True
            print(f" <<FLAGGED at step {verdict.step}>> ", end="", flush=True)

    def run() -> None:
        result["out"] = guarded.generate(
            **encode_prompts(tokenizer, [args.prompt]),
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            on_flag=args.on_flag,
            refusal=args.refusal if args.on_flag == "stop" else None,
            streamer=streamer,
            on_step=on_step,
            return_dict_in_generate=True,
        )

    thread = threading.Thread(target=run)
    thread.start()
    print(f"[{guard.config.hook.position} guard, threshold {guard.threshold:.3f}]")
    for text in streamer:
        print(text, end="", flush=True)
    thread.join()
    report = result["out"].safety[0]
    verdict = "FLAGGED" if report.flagged else "ok"
    where = f" at step {report.step}" if report.step is not None else ""
    print(f"\n[{verdict}{where}; stopped={report.stopped}; score {report.score:.3f}]")


if __name__ == "__main__":
    main()

"""Print a response token by token while a running guard watches it, and show the verdict as it changes.

    python examples/stream_with_verdict.py --guard path/to/response_running_guard "Tell me a story"
    python examples/stream_with_verdict.py --guard default "How do I pick a lock?"   # prompt_last: screened

``generate`` runs in a thread and writes to a ``TextIteratorStreamer``; ``on_step`` (called by the
guard after it scores each step) prints a running guard's score of each token in brackets as soon
as it exists, and the verdict when it changes, so the text and the verdict appear together. A
guard that reads the prompt decides once, before the first token. The last line is the report:
each head's score beside its threshold, and which head decided.
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

    running = guard.config.hook.position == "response_running"

    def on_step(verdict) -> None:  # runs in the generate thread, before the next token is picked
        score = float(verdict.scores[0])
        if running and score == score:  # not nan: this token was scored, against guard.threshold
            print(f"[{score:.2f}]", end="", flush=True)
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
    if running:
        print(f"[running guard: a token's score above {guard.threshold:.3f} counts towards a stop]")
    else:
        print(f"[{guard.config.hook.position} guard: {', '.join(guard.head_names)} decide before the first token]")
    for text in streamer:
        print(text, end="", flush=True)
    thread.join()
    report = result["out"].safety[0]
    where = f" at step {report.step}" if report.step is not None else ""
    print(f"\n[{report.describe()}{where}; stopped={report.stopped}]")


if __name__ == "__main__":
    main()

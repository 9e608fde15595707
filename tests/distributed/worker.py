"""One rank of a distributed test run (started N times by `pymlxc.launch.run_local`): loads the
model named on the command line split as asked, runs the calls, and prints what it got as one
`RESULT <json>` line (every rank prints its own, so a test can check that all ranks agree).

    python tests/distributed/worker.py MODEL MODE [--tokens N] [--die-rank R] [--batch] [--load-only]

MODE is tensor, pipeline or none (one process, the reference).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import conftest  # noqa: E402,F401 - the checkout's module names

import pymlxc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("mode", choices=["tensor", "pipeline", "none"])
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--die-rank", type=int, default=None, help="this rank exits hard after loading")
    ap.add_argument("--stop-rank", type=int, default=None, help="this rank stops itself (SIGSTOP) after loading")
    ap.add_argument("--batch", action="store_true", help="also run batch_generate and classify")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--load-only", action="store_true", help="report the load's MLX peak memory and stop")
    ap.add_argument("--long-prompt", type=int, default=0, help="a prompt of about this many tokens instead")
    a = ap.parse_args()
    distributed = None if a.mode == "none" else a.mode
    out: dict[str, object] = {}
    pymlxc.core.reset_peak_memory()
    # A prompt past context_len is refused (ContextLengthError): the long prompt gets room for itself.
    context_len = max(256, 2 * a.long_prompt)
    with pymlxc.load_model(a.model, distributed=distributed, context_len=context_len) as model:
        out["load_peak"] = pymlxc.core.get_peak_memory()
        out["load_active"] = pymlxc.core.get_active_memory()
        rank = pymlxc.core.distributed.init().rank() if distributed else 0
        out["rank"] = rank
        out["prompt_cache"] = model.prompt_cache.enabled
        if a.load_only:
            print("RESULT " + json.dumps(out), flush=True)
            return
        if a.die_rank is not None and rank == a.die_rank:
            os._exit(7)
        if a.stop_rank is not None and rank == a.stop_rank:
            os.kill(os.getpid(), signal.SIGSTOP)
        started = time.monotonic()
        try:
            prompt = "Hello there, general"
            if a.long_prompt:  # about two tokens a word
                prompt = " ".join(f"w{i % 97}" for i in range(a.long_prompt // 2))
            tokens = list(model.generate(prompt, max_tokens=a.tokens, temperature=a.temperature))
            out["prompt_tokens"] = len(model.encode(prompt))
        except Exception as exc:  # the killed-rank case: the survivors report how they ended
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["after_s"] = time.monotonic() - started
            print("RESULT " + json.dumps(out), flush=True)
            sys.exit(3)
        out["ids"] = [t.id for t in tokens]
        out["logits"] = [r.logits for r in model.classify(["Hello there", "a b c d"], return_logits=True)]
        if a.batch:
            batch = model.batch_generate(["one two", "three four five"], max_tokens=4)
            out["batch"] = [r.text if r.error is None else "error: " + r.error for r in batch]
            out["chat"] = "".join(t.text for t in model.chat([{"role": "user", "content": "hi"}], max_tokens=4))
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

"""A stand-in worker that misbehaves on purpose, to test the client's handling of failures fast.

Run as `fake_worker.py MODE [bridge args...]`. It answers the handshake and `load` like the real
one, then on the first generate-like request: `die` writes to stderr and exits 3 after two
tokens; `hang` sends one token and goes silent; `error` answers with an error line; `protocol`
announces protocol version 999 at the handshake.
"""
from __future__ import annotations

import json
import sys
import time


def send(**message: object) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    mode = sys.argv[1]
    send(type="hello", protocol=999 if mode == "protocol" else 1, pid=0)
    info = {
        "architecture": "fake",
        "vocab_size": 10,
        "num_layers": 1,
        "hidden_size": 4,
        "quant_bits": 0,
        "quant_group": 0,
    }
    for line in sys.stdin:
        request = json.loads(line)
        rid, cmd = request.get("id"), request.get("cmd")
        if cmd == "load":
            send(type="result", id=rid, cmd="load", model_type="fake", info=info, eos_token_ids=[0])
        elif cmd == "quit":
            send(type="result", id=rid, cmd="quit")
            return
        elif cmd == "cancel":
            send(type="result", id=rid, cmd="cancel", active=False)
        elif mode == "die":
            send(type="token", id=rid, token_id=1, token="a")
            send(type="token", id=rid, token_id=2, token="b")
            print("fake worker: RESOURCE EXHAUSTED, out of memory", file=sys.stderr, flush=True)
            sys.exit(3)
        elif mode == "hang":
            send(type="token", id=rid, token_id=1, token="a")
            time.sleep(3600)
        elif mode == "error":
            send(type="error", id=rid, cmd=cmd, error="failed", message="ValueError: fake failure")


if __name__ == "__main__":
    main()

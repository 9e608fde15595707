#!/usr/bin/env bash
# Drive the pymlxc bridge worker from a shell with jq: load, stream a generation, quit.
# Usage: generate.sh MODEL_DIR [PROMPT] [MAX_TOKENS]    (needs jq; the worker's Python is $PYTHON)
# The requests are piped in at once: the worker answers them in order, and `quit` waits its turn.
set -euo pipefail
model=${1:?usage: generate.sh MODEL_DIR [PROMPT] [MAX_TOKENS]}
prompt=${2:-Hello}
max_tokens=${3:-16}
bridge_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

requests() {
  jq -nc --arg path "$model" '{cmd: "load", id: "load", path: $path}'
  jq -nc --arg prompt "$prompt" --argjson n "$max_tokens" '{cmd: "generate", id: "gen", prompt: $prompt, max_tokens: $n}'
  jq -nc '{cmd: "quit", id: "quit"}'
}

requests | "${PYTHON:-python3}" "$bridge_dir" | while IFS= read -r line; do
  case "$(jq -r .type <<<"$line")" in
    hello)
      protocol=$(jq .protocol <<<"$line")
      # generate is the same in versions 1 to 5 (3 adds done.tail; 4 refuses a prompt past the context;
      # 5 ends batch_generate rows at the context)
      case "$protocol" in 1|2|3|4|5) ;; *) echo "worker speaks protocol $protocol, this script 1 to 5" >&2; exit 1 ;; esac ;;
    error)
      jq -r '"\(.cmd // "request") failed: \(.message) [\(.error)]"' <<<"$line" >&2
      exit 1 ;;
    token) jq -j .token <<<"$line" ;;
    done) jq -j '.tail // ""' <<<"$line"; echo ;;
  esac
done

#!/usr/bin/env node
// Drive the pymlxc bridge worker from Node: handshake, load, stream a generation, quit.
// Usage: node generate.mjs MODEL_DIR [PROMPT] [MAX_TOKENS]
// The worker's Python is $PYTHON (default python3); it needs mlx-lm, not pymlxc.
import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const PROTOCOLS = [1, 2, 3, 4, 5]; // what this script uses (generate) is the same in all (3 adds done.tail; 4 refuses a prompt past the context; 5 ends batch rows at the context)
const [model, prompt = "Hello", maxTokens = "16"] = process.argv.slice(2);
if (!model) {
  console.error("usage: node generate.mjs MODEL_DIR [PROMPT] [MAX_TOKENS]");
  process.exit(2);
}

const bridgeDir = join(dirname(fileURLToPath(import.meta.url)), "..");
const worker = spawn(process.env.PYTHON || "python3", [bridgeDir], { stdio: ["pipe", "pipe", "inherit"] });
const send = (msg) => worker.stdin.write(JSON.stringify(msg) + "\n");
const fail = (why) => {
  console.error(`error: ${why}`);
  worker.kill();
  process.exit(1);
};
worker.on("exit", (code) => code !== 0 && fail(`worker exited with code ${code}`));

// Every reply is one JSON object per line; route them by type.
for await (const line of createInterface({ input: worker.stdout })) {
  const msg = JSON.parse(line);
  if (msg.type === "hello") {
    if (!PROTOCOLS.includes(msg.protocol)) fail(`worker speaks protocol ${msg.protocol}, this script ${PROTOCOLS.join(' or ')}`);
    send({ cmd: "load", id: "load", path: model });
  } else if (msg.type === "error") {
    fail(`${msg.cmd ?? "request"} failed: ${msg.message} [${msg.error}]`);
  } else if (msg.type === "result" && msg.cmd === "load") {
    send({ cmd: "generate", id: "gen", prompt, max_tokens: Number(maxTokens) });
  } else if (msg.type === "token") {
    process.stdout.write(msg.token);
  } else if (msg.type === "done") {
    process.stdout.write((msg.tail ?? "") + "\n");
    console.error(`[${msg.finish_reason}: ${msg.generation_tokens} tokens, ${msg.generation_tps.toFixed(1)} tok/s]`);
    send({ cmd: "quit", id: "quit" });
  } else if (msg.type === "result" && msg.cmd === "quit") {
    break;
  }
}

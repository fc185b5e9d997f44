#!/usr/bin/env python3
"""A small tool-calling agent: the kind of harness fleetrl trains through, unchanged.

It talks to any OpenAI-compatible endpoint with the official ``openai`` client
(``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` from the environment, as every client reads
them) and acts in a Docker sandbox named by the ``FLEETRL_SANDBOX_*`` variables
(docs/guides/external-harness.md), so ``harness = "external"`` runs it as it is:

    argv = ["python", "examples/harnesses/tool_agent.py"]

The loop: send the conversation with ``tools`` (``read_file``; ``run`` too with
``--tools read_file,run``); run every tool call of the answer in the sandbox (``docker
exec`` as the sandbox user, in the work dir, each under ``timeout -s KILL``); append the
assistant message as returned (its ``tool_calls``) and one ``tool`` message per call;
repeat. The first answer without a tool call is the final answer: it is written,
stripped, into ``answer.txt`` in the work dir, where the task's evaluator reads it. After
``FLEETRL_MAX_TURNS`` calls (``--max-turns``) without a final answer it stops and writes
nothing.

Tools (the same text fleetrl's tool-lookup family expects, harness/synthetic_tools.py):

* ``read_file(path)``: the file's text, or ``error: cannot read PATH``;
* ``run(command)``: ``bash -c COMMAND``'s stdout and stderr, then ``[exit N]`` when
  non-zero.

Exit status: 0 when the loop ended by its own rules (answer or turn limit), non-zero
when the endpoint or Docker failed (fleetrl counts that as a failed attempt, not a
reward).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import openai

# Minimal schemas: a tiny model reads every byte of them in every prompt.
READ_FILE = {
    "type": "function",
    "function": {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
}
RUN = {
    "type": "function",
    "function": {"name": "run", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}},
}
TOOLS = {"read_file": READ_FILE, "run": RUN}
DOCKER_FAILED = (125, 126, 127)  # docker exec's own failures (daemon error, cannot run)
OUTPUT_CAP = 4096


class Sandbox:
    """``docker exec`` into the sandbox as its user, in its work dir."""

    def __init__(self, container: str, user: str, workdir: str, timeout_s: float) -> None:
        self.prefix = ["docker", "exec", "-i", "-u", user, "-w", workdir, container]
        self.timeout_s = timeout_s

    def exec(self, argv: list[str], stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
        done = subprocess.run([*self.prefix, "timeout", "-s", "KILL", str(int(self.timeout_s)), *argv],
                              input=stdin, capture_output=True, timeout=self.timeout_s + 30, check=False)
        if done.returncode in DOCKER_FAILED:
            raise RuntimeError(f"docker exec failed ({done.returncode}): {done.stderr.decode(errors='replace')}")
        return done

    def read_file(self, path: str) -> str:
        done = self.exec(["cat", "--", path])
        if done.returncode != 0:
            return f"error: cannot read {path}"
        return done.stdout.decode(errors="replace")[:OUTPUT_CAP]

    def run(self, command: str) -> str:
        done = self.exec(["bash", "-c", command])
        text = (done.stdout + done.stderr).decode(errors="replace")[-OUTPUT_CAP:]
        return text if done.returncode == 0 else f"{text}[exit {done.returncode}]"

    def write(self, path: str, text: str) -> None:
        done = self.exec(["sh", "-c", 'cat > "$1"', "sh", path], stdin=text.encode())
        if done.returncode != 0:
            raise RuntimeError(f"writing {path} failed: {done.stderr.decode(errors='replace')}")


def call_tool(sandbox: Sandbox, name: str, arguments: str, allowed: set[str]) -> str:
    if name not in allowed:
        return f"error: unknown tool {name}"
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    if not isinstance(args, dict):
        return "error: arguments are not an object"
    if name == "read_file":
        path = args.get("path")
        return sandbox.read_file(path) if isinstance(path, str) else "error: read_file needs a path"
    command = args.get("command")
    return sandbox.run(command) if isinstance(command, str) else "error: run needs a command"


def main(argv: list[str] | None = None) -> int:
    env = os.environ
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", default="read_file", help="comma-separated: read_file, run")
    parser.add_argument("--max-turns", type=int, default=int(env.get("FLEETRL_MAX_TURNS", "3")))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--tool-timeout", type=float, default=10.0, help="seconds per tool call in the sandbox")
    parser.add_argument("--answer-file", default="answer.txt")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.tools.split(",") if n.strip()]
    unknown = [n for n in names if n not in TOOLS]
    if unknown or not names:
        parser.error(f"--tools: unknown {unknown} (known: {sorted(TOOLS)})")

    sandbox = Sandbox(env["FLEETRL_SANDBOX_CONTAINER"], env["FLEETRL_SANDBOX_USER"],
                      env["FLEETRL_SANDBOX_WORKDIR"], args.tool_timeout)
    with open(env["FLEETRL_PROMPT_FILE"], encoding="utf-8") as fh:
        request = fh.read()
    client = openai.OpenAI(max_retries=0, timeout=120)
    model = env.get("FLEETRL_MODEL", "default")
    tools = [TOOLS[n] for n in names]
    messages: list[dict] = [{"role": "user", "content": request}]
    for turn in range(args.max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                               max_tokens=args.max_tokens, temperature=args.temperature,
                                               top_p=args.top_p)
        message = reply.choices[0].message
        if not message.tool_calls:
            sandbox.write(args.answer_file, (message.content or "").strip())
            print(f"answered after {turn + 1} call(s)", file=sys.stderr)
            return 0
        messages.append({"role": "assistant", "content": message.content, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls]})
        for c in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": call_tool(sandbox, c.function.name, c.function.arguments, set(names))})
    print(f"no answer within {args.max_turns} calls", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

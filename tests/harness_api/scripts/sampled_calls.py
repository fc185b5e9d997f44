"""An external harness in miniature for the sampling-contract tests: chat calls with the
official openai client (OPENAI_BASE_URL / OPENAI_API_KEY from the environment) at the
temperature and top_p given on the command line; prints each response's
x-fleetrl-sampling-overridden header (or "-") and the status of a refused call."""

import json
import sys

import openai

temperature, top_p, calls, seed = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
client = openai.OpenAI(max_retries=0, timeout=60)
msgs = [{"role": "user", "content": "write a function that adds two numbers"}]
out = []
for i in range(calls):
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=msgs, max_tokens=24, temperature=temperature, top_p=top_p, seed=seed + i)
    except openai.BadRequestError as exc:
        out.append({"status": exc.status_code, "param": exc.body.get("param") if isinstance(exc.body, dict) else None})
        continue
    answer = raw.parse().choices[0].message.content
    out.append({"status": 200, "overridden": raw.headers.get("x-fleetrl-sampling-overridden", "-")})
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and now another one"}]
print(json.dumps(out))

"""An external harness in miniature: two chat calls with the official openai client
(configured only by OPENAI_BASE_URL / OPENAI_API_KEY), the second extending the first;
then the number of tokens of each answer written into the sandbox as ``answer.txt``
(a first line "N1 N2", then the two answers), with docker exec, as the sandbox user, in
its work dir."""

import os
import subprocess

import openai

client = openai.OpenAI(max_retries=0, timeout=60)
model = os.environ["FLEETRL_MODEL"]
msgs = [{"role": "user", "content": open(os.environ["FLEETRL_PROMPT_FILE"]).read()}]
first = client.chat.completions.create(model=model, messages=msgs, max_tokens=9)
msgs += [{"role": "assistant", "content": first.choices[0].message.content},
         {"role": "user", "content": "go on"}]
second = client.chat.completions.create(model=model, messages=msgs, max_tokens=6)
text = (f"{first.usage.completion_tokens} {second.usage.completion_tokens}\n"
        f"{first.choices[0].message.content}\n{second.choices[0].message.content}\n")
subprocess.run(["docker", "exec", "-i", "-u", os.environ["FLEETRL_SANDBOX_USER"], "-w",
                os.environ["FLEETRL_SANDBOX_WORKDIR"], os.environ["FLEETRL_SANDBOX_CONTAINER"],
                "sh", "-c", "cat > answer.txt"], input=text.encode(errors="replace"), check=True, timeout=30)

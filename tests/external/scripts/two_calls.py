"""An external harness in miniature: two chat calls with the official openai client
(configured only by OPENAI_BASE_URL / OPENAI_API_KEY), then the answers written into the
sandbox with docker exec, as the sandbox user, in its work dir."""

import os, subprocess
import openai
client = openai.OpenAI(max_retries=0, timeout=30)  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
model = os.environ["FLEETRL_MODEL"]
msgs = [{"role": "user", "content": open(os.environ["FLEETRL_PROMPT_FILE"]).read()}]
first = client.chat.completions.create(model=model, messages=msgs, max_tokens=32)
msgs += [{"role": "assistant", "content": first.choices[0].message.content},
         {"role": "user", "content": "and the second part?"}]
second = client.chat.completions.create(model=model, messages=msgs, max_tokens=32)
text = first.choices[0].message.content + "|" + second.choices[0].message.content
# act in the sandbox: write the answer there, as the sandbox user, in the work dir
subprocess.run(["docker", "exec", "-i", "-u", os.environ["FLEETRL_SANDBOX_USER"], "-w",
                os.environ["FLEETRL_SANDBOX_WORKDIR"], os.environ["FLEETRL_SANDBOX_CONTAINER"],
                "sh", "-c", "cat > answer.txt"], input=text.encode(), check=True, timeout=30)

"""The smallest agent program: one model call, the reply on stdout (run by prorl's `command` family).

It asks the job's model gateway (OPENAI_BASE_URL) the task in PRORL_TASK with a
system prompt that sets the answer format, and prints the reply. The job
judges the last line of stdout with the math family's verifier, so the reward
asks for a correct final answer on the reply's last line. Standard library
only: it runs on the sandbox's system python3. Temperature and max_tokens are
the job's (the request leaves them unset).
"""

import json
import os
import urllib.request

SYSTEM = "Answer the question. End your reply with a line that holds only the final answer."

body = {
    "model": "prorl",
    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": os.environ["PRORL_TASK"]}],
}
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
    data=json.dumps(body).encode(),
    headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
)
with urllib.request.urlopen(request, timeout=600) as response:
    reply = json.load(response)["choices"][0]["message"]["content"] or ""
print(reply)

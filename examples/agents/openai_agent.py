"""A whole agent on the official openai SDK: it runs bash until it calls `finish`.

    python openai_agent.py "How many lines does /etc/passwd have?"
    python openai_agent.py --task-file task.md
    python openai_agent.py --max-turns 5 --task-file task.md

The SDK takes the endpoint and key from OPENAI_BASE_URL and OPENAI_API_KEY, as
a job sets them; in a sandbox run it with /opt/agents/bin/python, which has the
SDK. Its answer is the last line on stdout; the commands it runs go to stderr.
"""

import json
import subprocess
import sys
from pathlib import Path

from openai import OpenAI


def tool(name: str, description: str, argument: str) -> dict:
    parameters = {"type": "object", "properties": {argument: {"type": "string"}}, "required": [argument]}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOLS = [tool("bash", "Run a bash command, get its output.", "command"), tool("finish", "Give the answer.", "answer")]


def bash(command: str) -> str:
    print(f"$ {command}", file=sys.stderr)
    try:
        done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "timed out after 60 s"
    return f"exit status {done.returncode}\n{done.stdout}{done.stderr}"[-10_000:]


args, turns = sys.argv[1:], 50
if args[:1] == ["--max-turns"] and len(args) > 1:
    turns, args = int(args[1]), args[2:]
if not args:
    sys.exit(__doc__)
task = Path(args[1]).read_text() if args[0] == "--task-file" else " ".join(args)
client = OpenAI()
messages = [
    {"role": "system", "content": "Solve the task with the bash tool, then call finish with your answer."},
    {"role": "user", "content": task},
]
for _ in range(turns):
    message = client.chat.completions.create(model="prorl", messages=messages, tools=TOOLS).choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
        messages.append({"role": "user", "content": "Call a tool: bash to run a command, finish to answer."})
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments or "{}")
        if call.function.name == "finish":
            print(arguments.get("answer", ""))
            sys.exit(0)
        output = bash(arguments.get("command", "")) if call.function.name == "bash" else "no such tool"
        messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
sys.exit(f"no answer after {turns} model turns")

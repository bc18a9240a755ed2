"""The training and held-out tasks: easy arithmetic a 135M model can learn to answer.

Each task is judged by prorl's math verifier (math-verify). Two ways to pose it:

- `answer_task`: the `command` family runs answer_agent.py (one model call, the reply
  on stdout) and the math verifier judges the reply's last line: the reward asks
  for a correct final answer, on its own line at the end (a format the model
  meets now and then at the start, so a GRPO group has rewards to compare).
- `tool_task`: the `math` family's own agent, which must answer with a
  well-formed `<tool_call>` to `finish`: the tool-call format SmolLM2-135M
  almost never writes unprompted (measured, not trained on, by default).
"""

from __future__ import annotations

import random
from pathlib import Path

from examples.grpo.rollouts import Task

AGENT = Path(__file__).with_name("answer_agent.py")
AGENT_PATH = "/tmp/answer_agent.py"


def arithmetic(count: int, *, seed: int, top: int = 9, exclude: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """`count` distinct (question, answer) pairs: sums and differences of numbers from 1 to `top`."""
    rng = random.Random(seed)
    found: dict[str, str] = {}
    while len(found) < count:
        a, b = rng.randint(1, top), rng.randint(1, top)
        if rng.random() < 0.5:
            question, answer = f"What is {a} + {b}?", a + b
        else:
            a, b = max(a, b), min(a, b)
            question, answer = f"What is {a} - {b}?", a - b
        if question not in exclude:
            found[question] = str(answer)
    return list(found.items())


def answer_task(task_id: str, question: str, answer: str, *, agent_source: str | None = None) -> Task:
    source = AGENT.read_text() if agent_source is None else agent_source
    instance = {
        "program": {"argv": ["python3", AGENT_PATH], "files": {AGENT_PATH: source}, "timeout_s": 300},
        "verifier": "math",
        "task": {"question": question, "answer": answer},
        "submission": "last_line",
    }
    return Task(task_id, "command", instance)


def tool_task(task_id: str, question: str, answer: str) -> Task:
    return Task(task_id, "math", {"question": question, "answer": answer})


def splits(train: int, held_out: int, *, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Training tasks and held-out tasks (no question in both), as answer tasks."""
    source = AGENT.read_text()
    train_pairs = arithmetic(train, seed=seed)
    eval_pairs = arithmetic(held_out, seed=seed + 1, exclude=frozenset(q for q, _ in train_pairs))
    return (
        [answer_task(f"train-{i}", q, a, agent_source=source) for i, (q, a) in enumerate(train_pairs)],
        [answer_task(f"eval-{i}", q, a, agent_source=source) for i, (q, a) in enumerate(eval_pairs)],
    )

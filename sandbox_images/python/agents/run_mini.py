#!/opt/agents/bin/python
"""Run mini-swe-agent headless on one task against the job's model endpoint.

    /opt/agents/run_mini.py --workdir /testbed --task-file /tmp/task.md
    /opt/agents/run_mini.py --workdir /testbed "Fix the bug in parse() ..."

The model is `prorl` on the OpenAI-compatible endpoint of $OPENAI_BASE_URL
(key $OPENAI_API_KEY), reached through litellm as `openai/prorl`. The agent is
mini-swe-agent's own DefaultAgent with its own prompts (config mini.yaml, the
one `mini` uses), a LocalEnvironment running each bash action in a fresh
subshell in --workdir, and one `bash` tool sent with every request (no
streaming). It finishes when a command's output starts with the line
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT: the rest of that output is its
submission.

Exit status: 0 when the agent submitted; 1 when it stopped otherwise (step
limit, repeated format errors, the endpoint failing after retries); 2 on bad
usage. Stdout gets the agent's final message: the submission, or when it is
empty the agent's last text. The whole trajectory (every message, with the
raw responses) is saved as JSON to --trajectory.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

# Before mini-swe-agent and litellm are imported, as they read these then:
# no banner, no first-run setup, no fetching of litellm's cost map or tokenizers
# (a sandbox has no network), a model without a known price costs nothing
# instead of stopping the run, and a failing endpoint is tried 3 times, not 10.
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_CONFIGURED", "true")
os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "3")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")
if not os.access(Path.home(), os.W_OK):
    # mini-swe-agent creates its config folder on import (~/.config/mini-swe-agent).
    os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", os.path.join(tempfile.gettempdir(), "mini-swe-agent"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", nargs="?", help="the task text (or use --task-file)")
    parser.add_argument("--task-file", type=Path, help="read the task from this file ('-': stdin)")
    parser.add_argument("--workdir", type=Path, default=Path.cwd(), help="where commands run (default: the cwd)")
    parser.add_argument("--model", default="prorl", help="the model name the endpoint serves (default: prorl)")
    parser.add_argument(
        "--base-url", default=None, help="the endpoint, .../v1 (default: $OPENAI_BASE_URL or $OPENAI_API_BASE)"
    )
    parser.add_argument("--step-limit", type=int, default=0, help="stop after this many model calls (0: no limit)")
    parser.add_argument("--command-timeout", type=int, default=60, help="seconds a bash action may run (default: 60)")
    parser.add_argument(
        "--trajectory",
        type=Path,
        default=Path(tempfile.gettempdir()) / "run_mini.traj.json",
        help="where to save the trajectory (default: %(default)s; keep it out of the repository)",
    )
    args = parser.parse_args(argv)
    if (args.task is None) == (args.task_file is None):
        parser.error("give the task either as an argument or with --task-file")
    return args


def read_task(args: argparse.Namespace) -> str:
    if args.task_file is None:
        return args.task
    if str(args.task_file) == "-":
        return sys.stdin.read()
    return args.task_file.read_text(encoding="utf-8")


def final_message(messages: list[dict], submission: str) -> str:
    """The submission, or the model's last text (a reply rejected for its format is kept only as raw response)."""
    if submission.strip():
        return submission
    for message in reversed(messages):
        if message.get("role") == "assistant":
            text = message.get("content")
        else:
            response = message.get("extra", {}).get("response")
            choices = response.get("choices") if isinstance(response, dict) else None
            text = choices[0].get("message", {}).get("content") if choices else None
        if isinstance(text, str) and text.strip():
            return text
    return ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    task = read_task(args)
    base_url = args.base_url or os.environ.get("OPENAI_BASE_URL") or os.environ.get("OPENAI_API_BASE")
    if not base_url:
        print("run_mini: no endpoint: set OPENAI_BASE_URL (or pass --base-url)", file=sys.stderr)
        return 2
    if not args.workdir.is_dir():
        print(f"run_mini: no such directory: {args.workdir}", file=sys.stderr)
        return 2

    import litellm
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import builtin_config_dir
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    litellm.suppress_debug_info = True  # its "Provider List" banner on every unpriced call
    config = yaml.safe_load((builtin_config_dir / "mini.yaml").read_text(encoding="utf-8"))
    model_config = config.get("model", {})
    model_config["model_kwargs"] = {
        **model_config.get("model_kwargs", {}),
        "api_base": base_url,
        "api_key": os.environ.get("OPENAI_API_KEY") or "none",
    }
    model = LitellmModel(model_name=f"openai/{args.model}", cost_tracking="ignore_errors", **model_config)
    env = LocalEnvironment(
        cwd=str(args.workdir.resolve()),
        timeout=args.command_timeout,
        env=config.get("environment", {}).get("env", {}),  # PAGER=cat and the like
    )
    # mini.yaml's prompts and limits; not its `mode` (confirm or yolo), a setting of `mini`'s interactive agent.
    agent_config = {key: value for key, value in config["agent"].items() if key != "mode"}
    agent_config |= {"step_limit": args.step_limit, "cost_limit": 0, "output_path": args.trajectory}
    agent = DefaultAgent(model, env, **agent_config)

    try:
        result = agent.run(task)
    except Exception as error:  # the agent saved its trajectory with the error as its exit message
        result = {"exit_status": type(error).__name__, "submission": ""}
        print(f"run_mini: {type(error).__name__}: {error}", file=sys.stderr)
    status = result.get("exit_status", "")
    print(final_message(agent.messages, result.get("submission", "")))
    print(
        f"run_mini: exit_status={status} model_calls={agent.n_calls} trajectory={args.trajectory}",
        file=sys.stderr,
    )
    return 0 if status == "Submitted" else 1


if __name__ == "__main__":
    sys.exit(main())

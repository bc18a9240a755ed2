"""The trainer's sampling over an agent program's (gateway/sampling.py): the job's sampling is the
ceiling and the default of every call, whatever the program writes."""

from __future__ import annotations

from prorl_server.gateway import sampling as clamping
from prorl_server.gateway.sampling import clamp
from prorl_server.jobs import validation
from prorl_server.llm.base import Sampling

JOB = Sampling(max_tokens=512, temperature=1.0, stop=("</answer>",), chat_template_kwargs={"enable_thinking": False})


def hostile() -> Sampling:
    """What a program asked in issue 30's run: every field at an extreme."""
    return Sampling(
        max_tokens=2**62,
        temperature=2.0,
        top_p=0.01,
        stop=("</answer>", *(f"s{i}" for i in range(10_000))),
        seed=123,
        chat_template_kwargs={
            "enable_thinking": False,
            "chat_template": "{{ 'pwned' }}",
            "bos_token": "<evil>",
            "add_generation_prompt": False,
        },
    )


def test_the_jobs_sampling_is_the_ceiling_and_the_default() -> None:
    used, changed = clamp(hostile(), JOB)
    assert used.max_tokens == 512
    assert (used.temperature, used.top_p, used.seed) == (1.0, None, None)
    assert used.chat_template_kwargs == {"enable_thinking": False}
    assert used.stop[0] == "</answer>" and len(used.stop) == clamping.MAX_STOP_STRINGS
    assert changed["max_tokens"] == [2**62, 512]
    assert changed["temperature"] == [2.0, 1.0] and changed["top_p"] == [0.01, None] and changed["seed"] == [123, None]
    assert changed["stop"] == {"asked": 10_001, "dropped": 10_000 - 15, "kept": 16}
    assert changed["chat_template_kwargs"] == {"dropped": ["add_generation_prompt", "bos_token", "chat_template"]}


def test_a_job_that_lets_its_program_choose_gets_its_temperature_top_p_and_seed_only() -> None:
    used, changed = clamp(hostile(), JOB, program_sampling=True)
    assert (used.temperature, used.top_p, used.seed) == (2.0, 0.01, 123)
    assert used.max_tokens == 512 and used.chat_template_kwargs == {"enable_thinking": False}
    assert set(changed) == {"max_tokens", "stop", "chat_template_kwargs"}


def test_a_call_within_the_jobs_bounds_is_left_alone() -> None:
    asked = Sampling(
        max_tokens=100, temperature=1.0, stop=("</answer>", "STOP"), chat_template_kwargs={"enable_thinking": False}
    )
    used, changed = clamp(asked, JOB)
    assert changed == {}
    assert used.max_tokens == 100 and used.stop == ("</answer>", "STOP")


def test_stop_strings_are_bounded_as_submit_bounds_them() -> None:
    assert (clamping.MAX_STOP_STRINGS, clamping.MAX_STOP_CHARS) == (
        validation.MAX_STOP_STRINGS,
        validation.MAX_STOP_CHARS,
    )
    used, changed = clamp(Sampling(max_tokens=1, temperature=1.0, stop=("", "x" * 257, "ok")), JOB)
    assert used.stop == ("</answer>", "ok") and changed["stop"] == {"asked": 3, "dropped": 2, "kept": 2}

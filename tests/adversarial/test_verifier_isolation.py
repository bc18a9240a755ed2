"""Answers that make their check slow, against the checker processes: each costs only itself.

`\\boxed{9^{9^{8}}}` keeps sympy computing for minutes. Here it runs in a real pool of checker
processes (prorl_server/verifiers/checker_pool.py) of its own, and: its process is killed
at the time limit (the process is gone, not a thread left running), the check fails as the
job's own `verification_timeout`, the event loop keeps turning meanwhile, a right answer
queued behind hostile ones gets its own full time and scores, a cancelled check takes its
process with it, and a crashed process is replaced. The limits each process runs under
(address space, priority) are read from /proc.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from prorl_server.agents.base import classify
from prorl_server.config import VerifierSettings
from prorl_server.errors import InfrastructureError
from prorl_server.verifiers.checker_pool import CheckerPool, VerificationFailed
from prorl_server.verifiers.checker_worker import NICENESS
from tests.helpers import assert_eventually

HOSTILE = "\\boxed{9^{9^{8}}}"
# Long enough for a right answer's check on a loaded machine (milliseconds when idle).
LIMIT_S = 5.0


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[CheckerPool]:
    checkers = CheckerPool(VerifierSettings(processes=2, time_limit_s=LIMIT_S, memory_limit_mib=1024))
    yield checkers
    pids = [*checkers.pids, checkers.template_pid or 0]
    await checkers.close()
    assert not [pid for pid in pids if alive(pid)]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def check_math(pool: CheckerPool, answer: str) -> bool:
    correct, _ = await pool.check("math", {"gold": "42", "answer": answer})
    return bool(correct)


@pytest.mark.slow  # each waits out a hostile check's {LIMIT_S}s and a fresh process's start
async def test_a_hostile_answer_is_killed_at_its_limit_and_fails_its_own_job(pool: CheckerPool) -> None:
    assert await check_math(pool, "42")
    (pid,) = pool.pids
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0.01)

    counter = asyncio.create_task(count_turns())
    try:
        with pytest.raises(VerificationFailed) as failed:
            await check_math(pool, HOSTILE)
    finally:
        counter.cancel()
    assert failed.value.reason == "verification_timeout" and f"{LIMIT_S:g}s" in failed.value.message
    info = classify(failed.value)
    assert (info.infrastructure, info.reason) == (False, "verification_timeout")  # the policy's, not masked
    assert turns > 10, "the event loop stood still while the hostile answer was checked"
    await assert_eventually(lambda: not alive(pid), message=f"checker {pid} still runs after its kill")
    assert pool.killed == 1 and pool.pids == []
    assert await check_math(pool, "42")  # a fresh process took the slot


@pytest.mark.slow  # each waits out a hostile check's {LIMIT_S}s and a fresh process's start
async def test_right_answers_behind_hostile_ones_get_their_own_time(pool: CheckerPool) -> None:
    answers = [HOSTILE, HOSTILE, HOSTILE, "42", "41", "42"]  # 3 hostile ones first, 2 processes
    results = await asyncio.gather(*(check_math(pool, answer) for answer in answers), return_exceptions=True)
    for result in results[:3]:
        assert isinstance(result, VerificationFailed) and result.reason == "verification_timeout", result
    assert results[3:] == [True, False, True]
    assert pool.killed == 3


@pytest.mark.slow  # each waits out a hostile check's {LIMIT_S}s and a fresh process's start
async def test_a_cancelled_check_takes_its_process_with_it(pool: CheckerPool) -> None:
    assert await check_math(pool, "42")
    (pid,) = pool.pids
    task = asyncio.create_task(check_math(pool, HOSTILE))
    await assert_eventually(lambda: not pool.pids, message="the check did not take the idle process")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_eventually(lambda: not alive(pid), message=f"checker {pid} still runs after its job was cancelled")
    assert await check_math(pool, "42")


@pytest.mark.slow  # each waits out a hostile check's {LIMIT_S}s and a fresh process's start
async def test_a_crashed_checker_fails_only_its_check_and_is_replaced(pool: CheckerPool) -> None:
    assert await check_math(pool, "42")
    (pid,) = pool.pids
    task = asyncio.create_task(check_math(pool, HOSTILE))
    await assert_eventually(lambda: not pool.pids, message="the check did not take the idle process")
    os.kill(pid, signal.SIGSEGV)
    with pytest.raises(VerificationFailed) as failed:
        await task
    assert failed.value.reason == "verification_crashed"
    assert await check_math(pool, "42")


async def test_checker_processes_run_under_a_memory_limit_and_a_lower_priority(pool: CheckerPool) -> None:
    assert await check_math(pool, "42")
    (pid,) = pool.pids
    address_space, nice, parent = process_limits(pid)
    assert address_space == [str(1024 << 20)] * 2  # soft and hard, in bytes
    assert nice == os.nice(0) + NICENESS
    # a fork of the pool's template process, itself this process's child
    assert parent == pool.template_pid and process_limits(parent)[2] == os.getpid()


def process_limits(pid: int) -> tuple[list[str], int, int]:
    """A process's RLIMIT_AS (soft, hard), niceness and parent, from /proc."""
    limits = Path(f"/proc/{pid}/limits").read_text().splitlines()
    address_space = next(line for line in limits if line.startswith("Max address space")).split()[3:5]
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # fields[0] is stat's field 3
    return address_space, int(fields[16]), int(fields[1])


async def test_a_checker_that_died_idle_is_replaced_without_blaming_the_next_answer(pool: CheckerPool) -> None:
    assert await check_math(pool, "42")
    (pid,) = pool.pids
    os.kill(pid, signal.SIGKILL)
    await assert_eventually(lambda: not alive(pid), message=f"checker {pid} still runs after SIGKILL")
    assert await check_math(pool, "42")  # a right answer, in a fresh process, still scores
    assert pool.killed == 0


def parent_of(pid: int) -> int:
    return process_limits(pid)[2]


async def test_a_killed_checkers_replacement_is_a_fork_of_the_loaded_template(pool: CheckerPool) -> None:
    """The replacement imports nothing: it is forked from the one template process, which
    imported the checks once (the pool starts no second one)."""
    assert await check_math(pool, "42")
    (first,) = pool.pids
    template = pool.template_pid
    assert template is not None and parent_of(first) == template and parent_of(template) == os.getpid()
    task = asyncio.create_task(check_math(pool, HOSTILE))
    await assert_eventually(lambda: not pool.pids, message="the check did not take the idle process")
    os.kill(first, signal.SIGKILL)  # killed mid-check, as at a time limit
    with pytest.raises(VerificationFailed):
        await task
    await assert_eventually(lambda: not alive(first), message=f"checker {first} still runs after SIGKILL")
    assert await check_math(pool, "42")
    (second,) = pool.pids
    assert second != first and parent_of(second) == template
    assert (pool.templates_started, pool.forks) == (1, 2)


async def test_checkers_die_with_their_template_and_the_check_is_not_blamed_on_the_answer(pool: CheckerPool) -> None:
    """The template killed (not the answer's doing) mid-check: its checker dies with it, the
    check is an infrastructure failure, and the next check gets a new template."""
    assert await check_math(pool, "42")
    (checker,) = pool.pids
    template = pool.template_pid
    assert template is not None
    task = asyncio.create_task(check_math(pool, HOSTILE))
    await assert_eventually(lambda: not pool.pids, message="the check did not take the idle process")
    os.kill(template, signal.SIGKILL)
    with pytest.raises(InfrastructureError) as failed:
        await task
    assert not isinstance(failed.value, VerificationFailed)
    info = classify(failed.value)
    assert info.infrastructure, info
    await assert_eventually(lambda: not alive(checker), message=f"checker {checker} outlived its template")
    assert await check_math(pool, "42")
    assert pool.templates_started == 2 and pool.template_pid not in (None, template)

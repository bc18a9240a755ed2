"""SWE-bench's grading: from a test log (or a status map) to per-test outcomes and a resolution.

`statuses_from_log`, `tests_report` and `resolution_status` follow
swebench 5.0.2's `get_logs_eval`, `get_eval_tests_report` and
`get_resolution_status` (swebench/harness/grading.py, MIT licence): the same
markers and failure signatures, the same fall-back to the whole log, the same
check of the recorded exit status, the same rules per test (PASSED and XFAIL
pass; for PASS_TO_PASS a SKIPPED test is kept; a FAIL_TO_PASS test that is
skipped or absent fails; truncated parametrised ids matched by prefix).
tests/unit/verifiers/test_swebench_semantics.py checks each against swebench's own.

A log is what the code under test printed, among other things: a patch can
print a PASSED line for any test. `cross_check` is how a judge that also has
outcomes from a channel the code under test cannot write (the judging
harness's reporter) uses the official parser without trusting it: a test
passes only when both say so, and a selected test the log calls passing but
the trusted channel does not is an anomaly (a forged line: the run scores 0 as
`tampered`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from prorl_server.verifiers.swebench.parsers import ERROR, FAILED, PARSERS, PASSED, SKIPPED, XFAIL, StatusMap
from prorl_server.verifiers.swebench.specs import END_TEST_OUTPUT, START_TEST_OUTPUT, TEST_EXIT_CODE

APPLY_PATCH_FAIL = ">>>>> Patch Apply Failed"
RESET_FAILED = ">>>>> Reset Failed"
TESTS_ERROR = ">>>>> Tests Errored"
TESTS_TIMEOUT = ">>>>> Tests Timed Out"
FULL, PARTIAL, NO = "RESOLVED_FULL", "RESOLVED_PARTIAL", "RESOLVED_NO"
F2P, P2P, F2F, P2F = "FAIL_TO_PASS", "PASS_TO_PASS", "FAIL_TO_FAIL", "PASS_TO_FAIL"
EvalType = Literal["pass_and_fail", "fail_only"]
Report = dict[str, dict[str, list[str]]]

# Evidence that a test runner ran at all (swebench's SUITE_RAN), for a log without results.
_SUITE_RAN = re.compile(
    r"Executed [1-9]\d* of \d+"
    r"|TOTAL: [1-9]\d* (?:SUCCESS|FAILED)"
    r"|[1-9]\d* passing"
    r"|Tests:\s+[1-9]\d*"
    r"|Test Suites:\s+(?:\d+ \w+, )*[1-9]\d* total"
    r"|^# tests [1-9]\d*"
    r"|[1-9]\d* specs?, \d+ failures?"
    r"|': ok$",
    re.M,
)
_EXIT_CODE = re.compile(rf"{re.escape(TEST_EXIT_CODE)}:\s*(-?\d+)")
_PASSING = (PASSED, XFAIL)


def statuses_from_log(log: str, parser: str) -> tuple[StatusMap, bool]:
    """(status map, whether the log is a valid test run), as swebench's get_logs_eval."""
    parse = PARSERS[parser]
    if any(code in log for code in (APPLY_PATCH_FAIL, RESET_FAILED, TESTS_ERROR, TESTS_TIMEOUT)):
        return {}, False
    if not (START_TEST_OUTPUT in log and END_TEST_OUTPUT in log):
        return {}, False
    status_map = parse(log.split(START_TEST_OUTPUT)[1].split(END_TEST_OUTPUT)[0])
    if not status_map:
        status_map = parse(log)
    if not status_map and not _SUITE_RAN.search(log):
        return {}, False
    match = _EXIT_CODE.search(log)
    exit_code = int(match.group(1)) if match else None
    if (
        exit_code not in (None, 0)
        and status_map
        and not any(status in (FAILED, ERROR) for status in status_map.values())
    ):
        return {}, False
    return status_map, True


def _resolve_case(case: str, status_map: Mapping[str, str]) -> str | None:
    if case in status_map:
        return case
    if case.count("[") > case.count("]"):  # an id truncated inside its parameters
        matches = [key for key in status_map if key.startswith(case)]
        if matches and len({status_map[key] in _PASSING for key in matches}) == 1:
            return matches[0]
    return None


def status_of(case: str, status_map: Mapping[str, str]) -> str | None:
    """A selected test's status in a status map, found as swebench finds it (None: absent)."""
    key = _resolve_case(case, status_map)
    return status_map[key] if key is not None else None


def test_passed(case: str, status_map: Mapping[str, str]) -> bool:
    key = _resolve_case(case, status_map)
    return key is not None and status_map[key] in _PASSING


def test_maintained(case: str, status_map: Mapping[str, str]) -> bool:
    key = _resolve_case(case, status_map)
    return test_passed(case, status_map) or (key is not None and status_map[key] == SKIPPED)


def test_failed(case: str, status_map: Mapping[str, str]) -> bool:
    key = _resolve_case(case, status_map)
    return key is None or status_map[key] in (FAILED, ERROR, SKIPPED)


def tests_report(
    status_map: Mapping[str, str],
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    eval_type: EvalType = "pass_and_fail",
) -> Report:
    """Each selected test as a success or a failure, as swebench's get_eval_tests_report
    (without calculate_to_fail: FAIL_TO_FAIL and PASS_TO_FAIL stay empty)."""

    def fail_only(case: str) -> bool | None:
        return not (case in status_map and status_map[case] == FAILED)

    def pass_and_fail(case: str) -> bool | None:
        if test_passed(case, status_map):
            return True
        return False if test_failed(case, status_map) else None

    def maintained(case: str) -> bool | None:
        if test_maintained(case, status_map):
            return True
        return False if test_failed(case, status_map) else None

    f2p_check = pass_and_fail if eval_type == "pass_and_fail" else fail_only
    p2p_check = maintained if eval_type == "pass_and_fail" else fail_only

    def split(cases: Iterable[str], check: object) -> dict[str, list[str]]:
        assert callable(check)
        outcome: dict[str, list[str]] = {"success": [], "failure": []}
        for case in cases:
            verdict = check(case)
            if verdict is not None:
                outcome["success" if verdict else "failure"].append(case)
        return outcome

    empty: dict[str, list[str]] = {"success": [], "failure": []}
    return {
        F2P: split(fail_to_pass, f2p_check),
        P2P: split(pass_to_pass, p2p_check),
        F2F: dict(empty),
        P2F: dict(empty),
    }


def resolution_status(report: Report) -> str:
    """RESOLVED_FULL, RESOLVED_PARTIAL or RESOLVED_NO, as swebench's get_resolution_status."""

    def rate(kind: str) -> float:
        total = len(report[kind]["success"]) + len(report[kind]["failure"])
        return 1 if total == 0 else len(report[kind]["success"]) / total

    f2p, p2p = rate(F2P), rate(P2P)
    if f2p == 1 and p2p == 1:
        return FULL
    if 0 < f2p < 1 and p2p == 1:
        return PARTIAL
    return NO


def _rank(status: str | None, strict: bool = False) -> int:
    if strict and status == PASSED:
        return 3
    return 2 if status in _PASSING else 1 if status == SKIPPED else 0


def cross_check(
    trusted: Mapping[str, str], logged: Mapping[str, str], tests: Iterable[str], *, strict: bool = False
) -> tuple[StatusMap, list[str]]:
    """Combine the outcomes a trusted channel reported with the log's, for the selected tests.

    Returns the status map to grade with and the anomalies. Where the log says
    better of a selected test than the trusted channel (PASSED or XFAIL over
    SKIPPED over anything else; `strict`: PASSED over XFAIL too) that is an
    anomaly, a forged line, and the trusted status is kept (nothing, when the
    channel reported none). Elsewhere the log's status stands, so an honest run
    grades exactly as swebench grades its log."""
    combined: StatusMap = dict(logged)
    anomalies: list[str] = []
    for test in tests:
        key = _resolve_case(test, logged)
        logged_status = logged[key] if key is not None else None
        trusted_key = _resolve_case(test, trusted)
        trusted_status = trusted[trusted_key] if trusted_key is not None else None
        if key is None or _rank(logged_status, strict) <= _rank(trusted_status, strict):
            continue
        anomalies.append(
            f"the log says {logged_status} for {test}, the test run reported {trusted_status or 'nothing'}"
        )
        if trusted_status is None:
            del combined[key]
        else:
            combined[key] = trusted_status
    return combined, anomalies


def strict_report(status_map: Mapping[str, str], fail_to_pass: Sequence[str], pass_to_pass: Sequence[str]) -> Report:
    """Each selected test a success only if it PASSED: an XFAIL, an XPASS or a skip is a
    failure, in FAIL_TO_PASS and PASS_TO_PASS alike, whoever triggered it. (swebench's
    tests_report counts XFAIL as a pass and keeps a skipped PASS_TO_PASS test, so code
    under test that calls pytest.xfail() or pytest.skip() would resolve there.)"""

    def split(cases: Iterable[str]) -> dict[str, list[str]]:
        outcome: dict[str, list[str]] = {"success": [], "failure": []}
        for case in cases:
            outcome["success" if status_of(case, status_map) == PASSED else "failure"].append(case)
        return outcome

    return {
        F2P: split(fail_to_pass),
        P2P: split(pass_to_pass),
        F2F: {"success": [], "failure": []},
        P2F: {"success": [], "failure": []},
    }

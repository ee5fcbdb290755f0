"""Code reward: run the completion's program against the row's tests (GRPO on programming tasks).

In the config::

    reward_fn: megarl.reward.coding.code_reward_fn
    reward:
      timeout_seconds: 60          # the whole call, waiting for a free slot included
      kwargs: {time_limit_s: 2, memory_mb: 1024}

Each dataset row carries a ``tests`` column (a JSON string of it works too) in one of the common forms:

* standard input / output (APPS, TACO, the ``ground_truth`` of verl's code rewards):
  ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``, or a list of ``{"input": ..., "output": ...}``
  (DeepCoder, LiveCodeBench's stdin tests);
* a function call (APPS's call-based problems, LeetCode style): the same with ``"fn_name": "add"``, each
  input the list of arguments (or its JSON text) and each output the expected return value (a top-level
  function, or a method of ``Solution``);
* assertions (MBPP's ``test_list``; HumanEval as ``[test + "\\ncheck(" + entry_point + ")"]``):
  ``{"asserts": ["assert add(1, 2) == 3", ...]}`` or the bare list.

The program is the completion's last fenced code block (```` ```python ```` or a plain fence). Each test
runs it in a fresh Python process (``python -I``) in a temporary directory of its own, with the test's
input on standard input, a CPU-time limit, an address-space limit, a bound on the bytes it may write and a
near-empty environment; its whole process group is killed at the wall-clock limit. Output is compared line
by line with trailing whitespace ignored, numbers within ``float_tolerance``.

The reward is 1.0 when every test passes, else 0.0 (tests stop at the first failure); ``partial: true``
gives the fraction passed. The outcome (``rollout/reward/<outcome>`` in the step's stats) says how it was
decided: ``correct``, ``incorrect`` (wrong output or a failed assertion), ``runtime_error`` (it raised,
ran out of memory or wrote too much), ``time_limit``, ``syntax_error``, ``no_answer`` (no code block) and
``bad_reference`` (the row's tests are missing or unreadable). A failure's ``feedback`` says how it failed
(the first failing test's input and output, error or assertion), for a multi-turn workflow to quote back
(:mod:`megarl.workflow.multi_turn`). At most :data:`MAX_PROGRAMS` programs run at once per process.

These limits stop runaway programs, not hostile ones: the programs run as the trainer's user, with its
network. For code you do not trust, run it in a sandbox (SandboxFusion, a container per call) from an
``async def`` reward of your own that posts to it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import weakref
from dataclasses import dataclass
from typing import Any

from megarl.reward.base import ScoredReward
from megarl.utils.logging import LogEvery

MAX_PROGRAMS = max(2, os.cpu_count() or 2)
"""Programs one process runs at once; the others wait (waiting does not count against a test's limits)."""

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

_LIMITED = """\
import resource, runpy, sys
memory, cpu, written = map(int, sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (written, written))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.argv = ["solution.py"]
runpy.run_path("solution.py", run_name="__main__")
"""
"""Runs ``solution.py`` under the limits (inherited by anything it starts). Python ignores SIGXFSZ, so a
write past the byte bound raises ``OSError`` in the program."""

_CALL = """

def _megarl_call():
    import json
    name = {fn_name!r}
    fn = globals()[name] if name in globals() else getattr(globals()["Solution"](), name)
    got = fn(*json.loads({args!r}))
    got = json.loads(json.dumps(got))
    expected = json.loads({expected!r})
    assert got == expected or [got] == expected, f"returned {{got!r:.200}}, expected {{expected!r:.200}}"

_megarl_call()
"""
"""Appended to the program for a call-based test: APPS wraps the expected value in a list, so both count."""

logger = logging.getLogger(__name__)
_EXAMPLES = LogEvery(logger, 60.0)
"""One example a minute of each way programs fail, in ``trainer.log``: what a runaway count of
``runtime_error`` or ``incorrect`` means is usually plain from one (a prompt printed by ``input()``, a
missing import)."""

_SLOTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Limits:
    """What one test's process may use."""

    time_limit_s: float = 2.0
    """CPU seconds."""
    memory_mb: int = 1024
    """Address space, MiB (a program past it gets ``MemoryError``)."""
    max_output_kb: int = 1024
    """Bytes it may write to any file, standard output included, KiB."""

    def __post_init__(self) -> None:
        bad = {name: value for name, value in vars(self).items() if not value > 0}
        if bad:
            raise ValueError(f"code_reward_fn: {bad} must be > 0 (reward.kwargs)")

    @property
    def wall_clock_s(self) -> float:
        """When a program that sleeps or waits is stopped: three times its CPU seconds plus two, as a
        program on a busy machine (a server decoding beside it) gets only a share of a core."""
        return 3 * self.time_limit_s + 2


@dataclass(frozen=True)
class Test:
    """One test: the program (the solution, plus a call or assertions) and what it must print."""

    program: str
    stdin: str = ""
    expected: str | None = None
    """Standard output to match; None: passing is exiting with status 0."""
    shown: str = ""
    """The test as feedback names it: its input, its assertion or its call."""


async def code_reward_fn(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    *,
    tests: Any = None,
    time_limit_s: float = 2.0,
    memory_mb: int = 1024,
    max_output_kb: int = 1024,
    partial: bool = False,
    max_tests: int | None = None,
    float_tolerance: float = 1e-6,
    python: str | None = None,
    **row: Any,
) -> ScoredReward:
    """1.0 when the completion's program passes every one of the row's ``tests`` (see the module doc);
    ``partial``: the fraction passed. ``max_tests``: run only the first so many; ``python``: the interpreter
    that runs the programs (default: the trainer's)."""
    limits = Limits(time_limit_s, memory_mb, max_output_kb)  # bad values refused before any completion is read
    code = extract_code(completions)
    if code is None:
        return ScoredReward(0.0, "no_answer", "the answer holds no ```python code block")
    try:
        compile(code, "solution.py", "exec")
    except SyntaxError as e:
        return ScoredReward(0.0, "syntax_error", f"SyntaxError: {e.msg} (line {e.lineno})")
    except (ValueError, RecursionError, MemoryError) as e:
        return ScoredReward(0.0, "syntax_error", f"{type(e).__name__}: {e}")
    cases = parse_tests(tests, code)
    if not cases:
        return ScoredReward(0.0, "bad_reference")
    cases = cases[:max_tests] if max_tests else cases
    passed, first_failure = 0, None
    for case in cases:
        outcome, feedback = await run_test(case, limits, float_tolerance, python or sys.executable)
        if outcome == "correct":
            passed += 1
            continue
        first_failure = first_failure or (outcome, feedback)
        if not partial:
            break
    if first_failure is None:
        return ScoredReward(1.0, "correct")
    return ScoredReward(passed / len(cases) if partial else 0.0, *first_failure)


def extract_code(completion: str) -> str | None:
    """The last fenced code block's contents (```` ```python ````, ```` ```py ```` or a bare fence), or None."""
    blocks = _FENCE.findall(completion)
    return blocks[-1].rstrip() if blocks else None


def parse_tests(tests: Any, code: str) -> list[Test]:
    """The row's ``tests`` in any of the module doc's forms as :class:`Test` s of ``code`` ([] when unreadable)."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            return []
    if isinstance(tests, list) and tests and all(isinstance(t, dict) for t in tests):
        if not all("input" in t and "output" in t and t.get("testtype", "stdin") == "stdin" for t in tests):
            return []  # LiveCodeBench's "functional" tests need the function's name: the fn_name form
        tests = {"inputs": [t["input"] for t in tests], "outputs": [t["output"] for t in tests]}
    if isinstance(tests, list):
        tests = {"asserts": tests}
    if not isinstance(tests, dict):
        return []
    if tests.get("asserts") is not None:  # a dataset of mixed forms holds None for another form's keys
        asserts = tests["asserts"]
        if not isinstance(asserts, list) or not all(isinstance(a, str) for a in asserts):
            return []
        return [Test(f"{code}\n\n{check}\n", shown=check.strip()) for check in asserts]
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        return []
    if fn_name := tests.get("fn_name"):
        return [
            Test(
                code + _CALL.format(fn_name=fn_name, args=_arguments(i), expected=json.dumps(o)),
                shown=f"{fn_name}(*{_arguments(i)})",
            )
            for i, o in zip(inputs, outputs)
        ]
    return [Test(code, _text(i), _text(o), f"the input {_text(i)!r:.100}") for i, o in zip(inputs, outputs)]


def _arguments(value: Any) -> str:
    """A call's arguments as JSON text: datasets store the list parsed or as its text (a return value
    that is text is a string, not JSON)."""
    return value if isinstance(value, str) else json.dumps(value)


def _text(value: Any) -> str:
    """A test's input or output as text (some datasets store the lines as a list)."""
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


async def run_test(test: Test, limits: Limits, float_tolerance: float, python: str) -> tuple[str, str]:
    """Run one test in its own process and directory: its outcome (``correct``, ``incorrect``,
    ``runtime_error`` or ``time_limit``) and, for a failure, feedback saying how it failed."""
    async with _slot():
        workdir = tempfile.mkdtemp(prefix="megarl-code-")
        try:
            returncode, stdout, stderr = await _run(test, limits, python, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    if returncode is None or returncode == -signal.SIGXCPU:
        return _failed("time_limit", f"on {test.shown} it ran past the time limit ({limits.time_limit_s:g} s)")
    if returncode != 0:
        error = _last_line(stderr) or f"exit status {returncode}"
        if test.expected is None and error.startswith("AssertionError"):
            return _failed("incorrect", f"{test.shown} failed" + error.removeprefix("AssertionError"))
        return _failed("runtime_error", f"on {test.shown}: {error}")
    if test.expected is None or same_output(stdout, test.expected, float_tolerance):
        return "correct", ""
    return _failed("incorrect", f"on {test.shown} it printed {stdout!r:.150}, expected {test.expected!r:.150}")


def _failed(outcome: str, feedback: str) -> tuple[str, str]:
    _EXAMPLES(outcome, logging.INFO, "code reward, an example of %s (one a minute): %.400s", outcome, feedback)
    return outcome, feedback


def _slot() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    if loop not in _SLOTS:
        _SLOTS[loop] = asyncio.Semaphore(MAX_PROGRAMS)
    return _SLOTS[loop]


async def _run(test: Test, limits: Limits, python: str, workdir: str) -> tuple[int | None, str, str]:
    """``(exit status or None when killed at the wall-clock limit, stdout, stderr)`` of the test's program."""
    paths = {name: os.path.join(workdir, name) for name in ("solution.py", "stdin", "stdout", "stderr")}
    with open(paths["solution.py"], "w") as f:
        f.write(test.program)
    with open(paths["stdin"], "w") as f:
        f.write(test.stdin)
    limit_args = [str(limits.memory_mb << 20), str(math.ceil(limits.time_limit_s)), str(limits.max_output_kb << 10)]
    command = [python, "-I", "-X", "utf8", "-c", _LIMITED, *limit_args]
    with open(paths["stdin"], "rb") as stdin, open(paths["stdout"], "wb") as out, open(paths["stderr"], "wb") as err:
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=stdin,
            stdout=out,
            stderr=err,
            cwd=workdir,
            env=_environment(workdir),
            start_new_session=True,
        )
    try:
        returncode = await asyncio.wait_for(proc.wait(), limits.wall_clock_s)
    except TimeoutError:
        returncode = None
    finally:
        _kill_group(proc.pid)  # whatever it started, too
        await proc.wait()
    return returncode, _read(paths["stdout"]), _read(paths["stderr"])


def _environment(workdir: str) -> dict[str, str]:
    return {
        "PATH": os.defpath,
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        **{f"{lib}_NUM_THREADS": "1" for lib in ("OMP", "OPENBLAS", "MKL")},
    }


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def same_output(got: str, expected: str, float_tolerance: float = 1e-6) -> bool:
    """Whether a program's output matches the expected: line by line, trailing whitespace and trailing
    empty lines ignored; failing that, token by token with numbers equal within ``float_tolerance``
    (absolute, or relative to the expected value)."""
    if _lines(got) == _lines(expected):
        return True
    got_tokens, expected_tokens = got.split(), expected.split()
    return len(got_tokens) == len(expected_tokens) and all(
        _same_token(g, e, float_tolerance) for g, e in zip(got_tokens, expected_tokens)
    )


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _same_token(got: str, expected: str, tolerance: float) -> bool:
    if got == expected:
        return True
    try:
        g, e = float(got), float(expected)
    except ValueError:
        return False
    return math.isfinite(g) and math.isfinite(e) and abs(g - e) <= tolerance * max(1.0, abs(e))

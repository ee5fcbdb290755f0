"""``tests/durations.py`` reads pytest's durations report into seconds per test file."""

from __future__ import annotations

from tests.durations import per_file

REPORT = """============================= slowest durations ==============================
201.15s call     tests/train/test_plugins_e2e.py::test_user_workflow_reward_and_loss_from_one_file_each
78.65s setup    tests/rollout/test_vllm_integration.py::test_multi_turn_reflection_end_to_end
24.15s call     tests/rollout/test_vllm_integration.py::test_pause_interrupts_and_resume_continues_aligned
0.50s teardown tests/rollout/test_vllm_integration.py::test_grouped_rollout[a::b]
(12 durations < 0.005s hidden.)
"""


def test_a_files_setups_calls_and_teardowns_are_summed():
    assert per_file(REPORT) == {
        "tests/rollout/test_vllm_integration.py": 103.3,
        "tests/train/test_plugins_e2e.py": 201.2,
    }

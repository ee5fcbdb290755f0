"""Evaluator frequency, greedy pass@1 and sampled pass@k through a real rollout client on a fake server."""

from __future__ import annotations

import itertools
import math

import pytest

from megarl.api import ModelRequest, concat_padded_tensors, make_trajectory
from megarl.api.io_struct import GenerationHyperparameters
from megarl.config.run import EvaluatorConfig
from megarl.run.evaluator import Evaluator, evaluation_gconfig, pass_at_1, pass_at_k
from megarl.workflow import workflow_context
from tests.rollout.conftest import make_engine, start_fake_servers


def evaluate_steps(evaluator: Evaluator, steps: range, steps_per_epoch: int = 100) -> list[int]:
    done = []
    for step in steps:
        fn = lambda step=step: {"eval/pass@1": step / 10}
        if evaluator.maybe_evaluate(fn, step // steps_per_epoch, step % steps_per_epoch, step) is not None:
            done.append(step)
    return done


def test_evaluates_every_n_steps_and_returns_the_stats():
    evaluator = Evaluator(EvaluatorConfig(freq_steps=2))
    assert evaluate_steps(evaluator, range(6)) == [1, 3, 5]
    assert evaluator.maybe_evaluate(lambda: {"eval/pass@1": 0.5}, 0, 6, 6, force=True) == {"eval/pass@1": 0.5}


def test_evaluating_runs_beside_the_block_and_due_is_decided_first():
    import threading

    evaluator = Evaluator(EvaluatorConfig(freq_steps=2))
    started, saved = threading.Event(), threading.Event()

    def fn():
        started.set()
        assert saved.wait(10), "the block (a save) ran after the evaluation, not beside it"
        return {"eval/pass@1": 0.25}

    with evaluator.evaluating(fn, 0, 0, 0) as stats:  # not due: nothing runs
        assert not started.wait(0.5)
    assert stats() is None
    with evaluator.evaluating(fn, 0, 1, 1) as stats:
        assert started.wait(10)
        saved.set()
    assert stats() == {"eval/pass@1": 0.25}
    with evaluator.evaluating(fn, 0, 2, 2) as stats:
        pass

    def failing():
        raise RuntimeError("server gone")

    with evaluator.evaluating(failing, 0, 3, 3) as stats:
        pass
    with pytest.raises(RuntimeError, match="server gone"):  # the failure reaches whoever asks for the result
        stats()


def test_evaluates_at_the_end_of_each_epoch():
    evaluator = Evaluator(EvaluatorConfig(freq_epochs=1), steps_per_epoch=4)
    assert evaluate_steps(evaluator, range(12), steps_per_epoch=4) == [3, 7, 11]


def test_unset_frequencies_never_evaluate_and_state_round_trips():
    assert evaluate_steps(Evaluator(EvaluatorConfig()), range(20)) == []
    evaluator = Evaluator(EvaluatorConfig(freq_steps=3))
    evaluate_steps(evaluator, range(2))
    resumed = Evaluator(EvaluatorConfig(freq_steps=3))
    resumed.load_state_dict(evaluator.state_dict())
    assert evaluate_steps(resumed, range(2, 6)) == [2, 5]


class ScoredWorkflow:
    """One greedy generation per item; the reward is the item's ``reward`` (None rejects the episode)."""

    def __init__(self, greedy: bool = True):
        self.gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=4, greedy=greedy)
        self.saw_eval: list[bool] = []

    async def arun_episode(self, engine, data):
        self.saw_eval.append(workflow_context.get().is_eval)
        if data["reward"] is None:
            return None
        resp = await engine.agenerate(ModelRequest(input_ids=[11, 12, 13], gconfig=self.gconfig))
        out = (resp.output_tokens, resp.output_logprobs, resp.output_versions)
        return make_trajectory(resp.input_tokens, *out, data["reward"])


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    (server,) = start_fake_servers(1, token_delay=0.001, log_dir=tmp_path_factory.mktemp("server"))
    engine = make_engine([server.address], batch_size=2)
    yield engine
    engine.destroy()
    server.stop(timeout=5)


def test_pass_at_1_counts_rewards_above_half_over_returned_sequences(rollout):
    items = [{"reward": r} for r in (1.0, 0.0, 0.7, None, 0.2)]  # the rejected one does not count
    workflow = ScoredWorkflow()
    stats = pass_at_1(rollout, items, workflow)
    assert stats == {"eval/pass@1": 0.5, "eval/n_samples": 4.0, "eval/reward": pytest.approx(1.9 / 4)}
    assert workflow.saw_eval == [True] * 5  # evaluation episodes, outside the staleness budget


def test_pass_at_1_takes_the_first_max_samples_items(rollout):
    items = [{"reward": r} for r in (1.0, 0.0, 0.7, 1.0)]
    stats = pass_at_1(rollout, items, ScoredWorkflow(), max_samples=3)
    assert stats == {"eval/pass@1": pytest.approx(2 / 3), "eval/n_samples": 3.0, "eval/reward": pytest.approx(1.7 / 3)}


def test_pass_at_1_with_every_episode_rejected_is_zero(rollout, caplog):
    stats = pass_at_1(rollout, [{"reward": None}] * 2, ScoredWorkflow())
    assert stats == {"eval/pass@1": 0.0, "eval/n_samples": 0.0, "eval/reward": 0.0}
    assert "no sequences" in caplog.text


def test_pass_at_1_warns_about_a_sampling_workflow(rollout, caplog):
    pass_at_1(rollout, [{"reward": 1.0}], ScoredWorkflow(greedy=False))
    assert "not greedy pass@1" in caplog.text


class SampledWorkflow:
    """``n_samples`` generations per item; sample i's reward is ``data["rewards"][i]``."""

    def __init__(self, n_samples: int):
        self.gconfig = GenerationHyperparameters(n_samples=n_samples, max_new_tokens=2, greedy=False)

    async def arun_episode(self, engine, data):
        rows = []
        for reward in data["rewards"]:
            resp = await engine.agenerate(ModelRequest(input_ids=[11, 12], gconfig=self.gconfig.new(n_samples=1)))
            rows.append(
                make_trajectory(
                    resp.input_tokens, resp.output_tokens, resp.output_logprobs, resp.output_versions, reward
                )
            )
        return concat_padded_tensors(rows)


def reference_pass_at_k(solved: list[list[bool]], k: int) -> float:
    """Every k-subset of each item's sequences counted: the share holding a solved one, averaged over items."""
    shares = [sum(any(subset) for subset in itertools.combinations(row, k)) / math.comb(len(row), k) for row in solved]
    return sum(shares) / len(shares)


def test_pass_at_k_of_sampled_sequences_matches_counting_every_subset(rollout):
    rewards = [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0] * 6, [1.0, 1.0, 0.0, 1.0, 0.0, 0.0], [1.0] * 6]
    stats = pass_at_k(rollout, [{"rewards": r} for r in rewards], SampledWorkflow(6), 6)
    solved = [[r > 0.5 for r in row] for row in rewards]
    assert set(stats) == {"eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/pass@6", "eval/n_samples", "eval/reward"}
    for k in (1, 2, 4, 6):
        assert stats[f"eval/pass@{k}"] == pytest.approx(reference_pass_at_k(solved, k), abs=1e-12), k
    assert stats["eval/pass@6"] == 0.75 and stats["eval/n_samples"] == 24.0


def test_pass_at_k_without_n_sequences_per_item_gives_pass_at_1_and_says_why(rollout, caplog):
    stats = pass_at_k(rollout, [{"rewards": [1.0, 0.0]}, {"rewards": [1.0]}], SampledWorkflow(2), 2)
    assert stats == {"eval/pass@1": pytest.approx(2 / 3), "eval/n_samples": 3.0, "eval/reward": pytest.approx(2 / 3)}
    assert "3 sequences came back, not 2 per item" in caplog.text


def test_the_evaluations_sampling_follows_the_evaluator_config():
    gconfig = GenerationHyperparameters(n_samples=8, temperature=0.7)
    greedy = evaluation_gconfig(EvaluatorConfig(), gconfig)
    assert (greedy.n_samples, greedy.greedy) == (1, True)
    sampled = evaluation_gconfig(EvaluatorConfig(n_samples=4), gconfig)
    assert (sampled.n_samples, sampled.greedy, sampled.temperature) == (4, False, 0.7)
    hotter = evaluation_gconfig(EvaluatorConfig(n_samples=1, temperature=1.0), gconfig)
    assert (hotter.n_samples, hotter.greedy, hotter.temperature) == (1, False, 1.0)

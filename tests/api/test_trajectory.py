"""The trajectory tensor-dict helpers and the request/response contract."""

from __future__ import annotations

import pytest
import torch

from megarl.api import (
    ModelRequest,
    ModelResponse,
    build_trajectory,
    concat_padded_tensors,
    make_trajectory,
    oldest_version,
)
from megarl.api.io_struct import GenerationHyperparameters


def test_make_trajectory_layout():
    traj = make_trajectory([1, 2, 3], [7, 8], [-0.5, -0.25], [4, 5], reward=1.0)
    assert traj["input_ids"].tolist() == [[1, 2, 3, 7, 8]] and traj["input_ids"].dtype == torch.int32
    assert traj["attention_mask"].dtype == torch.bool and traj["attention_mask"].all()
    assert traj["loss_mask"].tolist() == [[0, 0, 0, 1, 1]]
    assert traj["logprobs"].tolist() == [[0.0, 0.0, 0.0, -0.5, -0.25]]
    assert traj["versions"].tolist() == [[-1, -1, -1, 4, 5]]
    assert traj["rewards"].tolist() == [1.0] and traj["rewards"].shape == (1,)


def test_misaligned_inputs_are_rejected():
    with pytest.raises(ValueError, match="2 output tokens but 1 logprobs"):
        make_trajectory([1], [7, 8], [-0.5], [0, 0], reward=0.0)
    with pytest.raises(ValueError, match="lengths differ"):
        build_trajectory([1, 2], [0], [0.0, 0.0], [-1, -1], reward=0.0)
    resp = ModelResponse(input_tokens=[1], output_tokens=[2, 3], output_logprobs=[-1.0], output_versions=[0, 0])
    with pytest.raises(ValueError, match="misaligned"):
        resp.check_aligned()


def test_concat_pads_right_with_key_specific_values():
    a = make_trajectory([1, 2], [3], [-0.1], [0], reward=0.0)
    b = make_trajectory([1], [4, 5, 6], [-0.1, -0.2, -0.3], [1, 1, 2], reward=1.0)
    out = concat_padded_tensors([a, b])
    assert out["input_ids"].tolist() == [[1, 2, 3, 0], [1, 4, 5, 6]]
    assert out["attention_mask"].tolist() == [[True, True, True, False], [True] * 4]
    assert out["loss_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 1, 1]]
    assert out["versions"].tolist() == [[-1, -1, 0, -1], [-1, 1, 1, 2]]
    assert out["rewards"].tolist() == [0.0, 1.0]
    assert oldest_version(out) == 0 and oldest_version(b) == 1


def test_concat_lists_and_key_mismatch():
    a = make_trajectory([1], [2], [-0.1], [0], reward=0.0) | {"tags": ["x"]}
    b = make_trajectory([1], [2], [-0.1], [0], reward=0.0) | {"tags": ["y"]}
    assert concat_padded_tensors([a, b])["tags"] == ["x", "y"]
    with pytest.raises(ValueError, match="keys"):
        concat_padded_tensors([a, make_trajectory([1], [2], [-0.1], [0], reward=0.0)])
    assert concat_padded_tensors([]) == {}


def test_request_copy_is_independent():
    req = ModelRequest(input_ids=[1, 2], gconfig=GenerationHyperparameters(n_samples=1))
    copy = req.copy()
    copy.input_ids.append(3)
    assert req.input_ids == [1, 2] and copy.rid == req.rid
    assert ModelRequest().rid != ModelRequest().rid


def test_routed_experts_ride_with_their_tokens():
    """MoE: each output token's routed experts (layers x top-k), -1 on the prompt; rows of different
    lengths concatenate (the padding is never read: the loss mask is 0 there)."""
    from megarl.api.trajectory import concat_padded_tensors, make_trajectory

    short = make_trajectory([1, 2], [3], [-0.5], [0], 1.0, [[4, 5, 6, 7]])
    long = make_trajectory([1, 2], [3, 4], [-0.5, -0.1], [0, 0], 0.0, [[4, 5, 6, 7], [0, 1, 2, 3]])
    assert long["routed_experts"].tolist() == [[[-1] * 4, [-1] * 4, [4, 5, 6, 7], [0, 1, 2, 3]]]
    batch = concat_padded_tensors([short, long])
    assert batch["routed_experts"].shape == (2, 4, 4) and batch["routed_experts"][0, 2].tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="2 output tokens but routed experts for 1"):
        make_trajectory([1], [3, 4], [-0.5, -0.1], [0, 0], 0.0, [[4, 5, 6, 7]])

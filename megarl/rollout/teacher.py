"""On-policy distillation's teacher: its logprob of every token the policy sampled, from servers serving it.

The rollout pool hands each accepted training trajectory to :meth:`TeacherScorer.score` before the trainer
can take it; the trajectory gains ``teacher_logp`` ([rows, length], aligned as ``logprobs``: position ``i``
holds ``log pi_teacher(token i | tokens < i)``, 0 at position 0 and on padding). The actor turns it into
per-token advantages (:func:`megarl.actor.advantages.teacher_advantages`). With ``teacher.top_k`` the same
request brings the teacher's k most likely tokens at each position too: ``teacher_topk_ids`` and
``teacher_topk_logp`` ([rows, length, k], aligned alike, most likely first), the forward KL term of the actor's
loss (:mod:`megarl.actor.teacher_loss`).

Each row is one request to the least busy teacher server (``teacher.addresses``): vLLM's ``prompt_logprobs``
or SGLang's ``input_token_logprobs`` of the row's tokens (:meth:`~megarl.serving.backend.InferenceBackend.score_payload`).
A request that fails on one server (retried there as the rollout's own requests are) goes to the next; when
none could score it, :class:`TeacherError` fails the episode, naming each server and what it answered. A
reply whose tokens are not the ones sent, or whose logprobs are not numbers <= 0, is refused like any
malformed reply. Teacher servers are not paused by weight updates: their weights never change.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import torch

from megarl.config.rollout import TeacherConfig
from megarl.serving import make_backend
from megarl.serving.backend import InferenceBackend
from megarl.serving.http import (
    InferenceServerError,
    MalformedResponseError,
    RetryPolicy,
    arequest_with_retry,
    http_json,
)
from megarl.serving.kept_http import LoopConnections
from megarl.utils.host_tensors import host_list, host_tensor

logger = logging.getLogger(__name__)

TOKENIZER_PROBE = "Teachers and students share one vocabulary: 12 + 30 = 42, naïve café."
"""The text both sides tokenize at start: a teacher that splits it otherwise has another tokenizer."""

LOGPROB_SLACK = 1e-3
"""A teacher logprob above this is refused (a probability above 1, beyond rounding)."""


def check_same_tokenizer(teacher_tokenizer, tokenizer, teacher: str) -> None:
    """Refuse a teacher (``teacher`` names it) whose tokenizer splits :data:`TOKENIZER_PROBE` otherwise."""
    _same_tokens(teacher, *(list(t(TOKENIZER_PROBE)["input_ids"]) for t in (teacher_tokenizer, tokenizer)))


def _same_tokens(teacher: str, got: list[int], expected: list[int]) -> None:
    if got != expected:
        raise TeacherError(
            f"{teacher} tokenizes {TOKENIZER_PROBE!r} as {got} and the actor's tokenizer as {expected}: on-policy "
            "distillation needs a teacher with the actor's tokenizer"
        )


class TeacherError(RuntimeError):
    """No teacher server could score a trajectory, or a teacher does not share the actor's tokenizer."""


class TeacherScorer:
    """Scores trajectories with the teacher servers of ``config`` (one request per row, rows at once).

    Args:
        config: The ``teacher`` block.
        backend: The servers' dialect; default: ``config.backend``'s.
    """

    def __init__(self, config: TeacherConfig, backend: InferenceBackend | None = None):
        self.config = config
        self.backend = backend or make_backend(config.backend)
        self.policy = RetryPolicy(config.request_timeout, config.request_retries)
        self.in_flight = dict.fromkeys(config.addresses, 0)  # requests per server, on the pool's loop
        self._connections = LoopConnections(config.max_connections)

    # ------------------------------------------------------------------ at start

    def check_tokenizer(self, tokenizer, timeout: float = 60.0) -> None:
        """Ask every teacher server to score :data:`TOKENIZER_PROBE` as text (with ``top_k``, its top k too: a
        server that cannot answer as many is refused now, not at the first trajectory), and refuse one whose
        tokens are not ``tokenizer``'s (its logprobs would be of other tokens). Blocking; raises
        :class:`TeacherError`."""
        expected = list(tokenizer(TOKENIZER_PROBE)["input_ids"])[1:]
        k = self.config.top_k
        for address in self.config.addresses:
            endpoint = self.backend.generate_endpoint
            try:
                body = http_json(address, endpoint, self.backend.score_payload(TOKENIZER_PROBE, k), timeout=timeout)
                got = [token for token, _ in self.backend.parse_score(body)]
                if k:
                    _checked_top(self.backend.parse_top_k(body, k), len(got))
            except (OSError, RuntimeError, MalformedResponseError) as e:
                asked = f" with its top {k} (teacher.top_k; a vLLM server answers up to its max_logprobs)" if k else ""
                raise TeacherError(
                    f"teacher server {address} ({self.config.backend}) did not score a probe text{asked} on "
                    f"{endpoint}: {e}"
                ) from e
            _same_tokens(f"teacher server {address} (from the second token on)", got, expected)

    # ------------------------------------------------------------------ scoring

    async def score(self, traj: dict[str, Any]) -> None:
        """Add ``traj["teacher_logp"]`` (and with ``top_k`` the teacher's top k; see the module doc), scoring its
        rows concurrently."""
        ids, lengths = traj["input_ids"], traj["attention_mask"].sum(-1)
        rows = [host_list(ids[b, : int(lengths[b])]) for b in range(ids.shape[0])]
        scored = await asyncio.gather(*(self.score_tokens(row) for row in rows))
        width, k = ids.shape[1], self.config.top_k
        out = [[0.0, *logps] + [0.0] * (width - 1 - len(logps)) for logps, _ in scored]
        traj["teacher_logp"] = host_tensor(out, torch.float32)
        if k:
            top = [
                [[(0, 0.0)] * k, *positions] + [[(0, 0.0)] * k] * (width - 1 - len(positions))
                for _, positions in scored
            ]
            pairs = torch.tensor(top, dtype=torch.float64)  # [rows, width, k, 2]: ids exact in float64
            traj["teacher_topk_ids"] = pairs[..., 0].long()
            traj["teacher_topk_logp"] = pairs[..., 1].float()

    async def score_tokens(self, tokens: list[int]) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """The teacher's logprob of ``tokens[1:]``, each given those before it, and with ``top_k`` its top k
        ``(token id, logprob)`` at each of those positions (else ``[]``)."""
        if len(tokens) < 2:
            return [], []
        k = self.config.top_k
        payload = self.backend.score_payload(tokens, k)
        failures = []
        for address in sorted(self.in_flight, key=self.in_flight.get):  # least busy first
            self.in_flight[address] += 1
            try:
                return await arequest_with_retry(
                    self._connections.here(),
                    address,
                    self.backend.generate_endpoint,
                    payload,
                    policy=self.policy,
                    parse=lambda body: (
                        _checked(self.backend.parse_score(body), tokens),
                        _checked_top(self.backend.parse_top_k(body, k), len(tokens) - 1) if k else [],
                    ),
                )
            except InferenceServerError as e:
                failures.append(f"{address}: {e}")
            finally:
                self.in_flight[address] -= 1
        raise TeacherError(f"no teacher server scored a {len(tokens)}-token trajectory: " + "; ".join(failures))

    async def aclose(self) -> None:
        """Close the running loop's connections (the pool calls this when it stops)."""
        self._connections.close_here()


def _checked_top(top: list[list[tuple[int, float]]], positions: int) -> list[list[tuple[int, float]]]:
    """A teacher's top k at each of ``positions`` positions, if its logprobs are numbers <= 0."""
    if len(top) != positions:
        raise MalformedResponseError(f"the teacher's top k covers {len(top)} positions, not the {positions} scored")
    for i, entry in enumerate(top):
        bad = _first_bad([logp for _, logp in entry])
        if bad is not None:
            raise MalformedResponseError(
                f"teacher logprob {entry[bad][1]!r} in the top k at position {i + 1} is not a log-probability"
            )
    return top


def _first_bad(logps: list[float]) -> int | None:
    """The index of the first of ``logps`` that is not a number <= 0 (within :data:`LOGPROB_SLACK`), or None."""
    return next((i for i, x in enumerate(logps) if math.isnan(x) or x > LOGPROB_SLACK), None)


def _checked(scored: list[tuple[int, float]], tokens: list[int]) -> list[float]:
    """The logprobs of a teacher's reply, if it scored exactly ``tokens[1:]`` with numbers <= 0."""
    got = [token for token, _ in scored]
    if got != tokens[1:]:
        first = next((i for i, (a, b) in enumerate(zip(got, tokens[1:])) if a != b), min(len(got), len(tokens) - 1))
        raise MalformedResponseError(
            f"the teacher scored {len(got)} tokens, not the {len(tokens) - 1} sent (from the second on); "
            f"they differ from position {first + 1}"
        )
    logps = [logp for _, logp in scored]
    bad = _first_bad(logps)
    if bad is not None:
        raise MalformedResponseError(f"teacher logprob {logps[bad]!r} at position {bad + 1} is not a log-probability")
    return logps

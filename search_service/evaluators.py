"""Leaf evaluators backed by the reward service.

:class:`RewardServiceEvaluator` sends one wave's leaf observations (uint8
``[N, 2, 6, 7]``) to the reward service's value model in one ``Evaluate``
call with critical priority, and returns values (and priors from the policy
logits, if the model has them). If the reward service fails, is unreachable
or cannot answer by the search deadline it raises :class:`EvaluatorUnavailable`
(an :class:`EvaluationFailed`): the backend undoes that wave and goes on in
the same tree with rollouts, or answers from it at the deadline.
"""
from __future__ import annotations

import time

import grpc
import numpy as np
from tandem.v1 import reward_pb2, reward_pb2_grpc

from search_service.mcts.backend import EvaluationFailed
from tandem import tensors

HANDOFF_GRPC = "grpc"  # how leaves reach the reward service: one Evaluate call per wave


class EvaluatorUnavailable(EvaluationFailed):
    """The reward service could not evaluate the leaves."""


class RewardServiceEvaluator:
    """Calls ``Evaluate`` on ``model`` at the reward service behind ``channel``.

    Args:
        channel: a gRPC channel to the reward service.
        model: the value model's name; it takes ``board`` uint8 [N, 2, 6, 7] and
            returns ``value`` float32 [N, 1] in [-1, 1] and optionally
            ``policy_logits`` float32 [N, A].
        timeout_s: per-call deadline (s).
    """

    def __init__(self, channel: grpc.Channel, model: str, timeout_s: float = 2.0):
        self._stub = reward_pb2_grpc.RewardServiceStub(channel)
        self.model = model
        self.timeout_s = timeout_s
        self._input: str | None = None
        self._has_policy = False
        # Totals over the calls so far, for benchmarks: the reward service's own time
        # (queue + model, ms) and the leaves sent. Written by the calling thread; read
        # between searches (the serving path calls from one dispatcher thread).
        self.calls = 0
        self.server_ms = 0.0
        self.leaves = 0

    def _metadata(self, timeout: float) -> None:
        meta = self._stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model=self.model), timeout=timeout)
        self._input = meta.inputs[0].name
        self._has_policy = any(o.name == "policy_logits" for o in meta.outputs)

    def until(self, deadline: float | None):
        """This evaluator as a LeafEvaluator whose calls end by ``deadline``
        (``time.monotonic()`` seconds; None: only ``timeout_s``), so a slow
        reward service cannot hold a search past its own deadline."""
        return lambda observations: self(observations, deadline)

    def __call__(self, observations: np.ndarray, deadline: float | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Values float32 [N] (side to move's view) and priors float32 [N, A] or None.

        Raises:
            EvaluatorUnavailable: the reward service failed, is unreachable, or
                did not answer by ``deadline``.
        """
        timeout = self.timeout_s
        if deadline is not None:
            timeout = max(min(timeout, deadline - time.monotonic()), 1e-3)
        try:
            if self._input is None:
                self._metadata(timeout)
            outputs = ["value", "policy_logits"] if self._has_policy else ["value"]
            reply = self._stub.Evaluate(
                reward_pb2.EvaluateRequest(
                    model=self.model,
                    inputs=[tensors.to_proto(self._input, observations)],
                    output_names=outputs,
                    request_class=reward_pb2.REQUEST_CLASS_CRITICAL,
                ),
                timeout=timeout,
            )
        except grpc.RpcError as exc:
            raise EvaluatorUnavailable(f"reward service: {exc.code().name}: {exc.details()}") from None
        self.calls += 1
        self.server_ms += reply.queue_ms + reply.compute_ms
        self.leaves += len(observations)
        by_name = {t.name: tensors.from_proto(t) for t in reply.outputs}
        values = by_name["value"].reshape(-1).astype(np.float32)
        logits = by_name.get("policy_logits")
        if logits is None:
            return values, None
        z = logits - logits.max(axis=1, keepdims=True)
        priors = np.exp(z)
        return values, (priors / priors.sum(axis=1, keepdims=True)).astype(np.float32)

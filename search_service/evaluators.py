"""Leaf evaluators backed by the reward service.

Each sends one wave's leaf observations (uint8 ``[N, 2, 6, 7]``) to the
reward service's value model, critical priority, and returns values (and
priors from the policy logits, if the model has them), by one of two
hand-offs:

* :class:`LeafChannelEvaluator` (``leaf_channel``): the leaf channel
  (tandem/leaf_channel.py): shared-memory regions and one Unix-socket message
  each way, for a reward service on this host;
* :class:`RewardServiceEvaluator` (``grpc``): one ``Evaluate`` call per wave,
  for any reward service;
* ``in_process``: a reward service in this very process (co-located mode):
  a :class:`LeafChannelEvaluator` over its in-process link
  (tandem/in_process.py), straight into its critical lane.

:class:`HandoffEvaluator` picks between them (``search.handoff``) and says which
it used. If the reward service fails, is unreachable or cannot answer by the
search deadline, each raises :class:`EvaluatorUnavailable` (an
:class:`EvaluationFailed`): the backend undoes that wave and goes on in the
same tree with rollouts, or answers from it at the deadline.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
from tandem.v1 import reward_pb2, reward_pb2_grpc

from search_service.games.connect4 import COLUMNS, NUM_ACTIONS, ROWS
from search_service.mcts.backend import EvaluationFailed
from tandem import in_process, tensors
from tandem.deadline import Deadline, within_s
from tandem.in_process import HANDOFF_IN_PROCESS
from tandem.leaf_channel import LeafChannel, LeafChannelError

log = logging.getLogger(__name__)

HANDOFF_GRPC = "grpc"  # how leaves reach the reward service: one Evaluate call per wave
HANDOFF_LEAF_CHANNEL = "leaf_channel"  # the leaf channel: shared memory and a Unix-socket doorbell
OBSERVATION_ROW = (2, ROWS, COLUMNS)  # a leaf's observation, as the CUDA selection kernel writes it (uint8)


class EvaluatorUnavailable(EvaluationFailed):
    """The reward service could not evaluate the leaves."""


@dataclass
class CallTotals:
    """What an evaluator's answered calls add up to, for benchmarks: the time
    of a wave split into the reward service's queue and model run (as its
    replies report them) and the rest of the call (the hand-off: copies,
    transport, decoding). Written by the calling thread; read between searches
    (HandoffEvaluator serialises the serving path's host calls)."""

    calls: int = 0
    leaves: int = 0
    call_ms: float = 0.0  # wall time inside the evaluator's __call__ (ms)
    queue_ms: float = 0.0  # the reward service's queue (ms)
    compute_ms: float = 0.0  # its model runs, copies in and out included (ms)

    def add(self, leaves: int, started: float, queue_ms: float, compute_ms: float) -> None:
        """One answered call of ``leaves`` rows that began at ``started`` (time.perf_counter() s)."""
        self.calls += 1
        self.leaves += leaves
        self.call_ms += (time.perf_counter() - started) * 1e3
        self.queue_ms += queue_ms
        self.compute_ms += compute_ms


class RewardServiceEvaluator:
    """Calls ``Evaluate`` on ``model`` at the reward service behind ``channel``.

    Args:
        channel: a gRPC channel to the reward service.
        model: the value model's name; it takes ``board`` uint8 [N, 2, 6, 7] and
            returns ``value`` float32 [N, 1] in [-1, 1] and optionally
            ``policy_logits`` float32 [N, A].
        timeout_s: per-call deadline (s).
    """

    handoff = HANDOFF_GRPC

    def __init__(self, channel: grpc.Channel, model: str, timeout_s: float = 2.0):
        self._stub = reward_pb2_grpc.RewardServiceStub(channel)
        self.model = model
        self.timeout_s = timeout_s
        self._input: str | None = None
        self._has_policy = False
        self.totals = CallTotals()

    def _metadata(self, timeout: float) -> None:
        meta = self._stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model=self.model), timeout=timeout)
        self._input = meta.inputs[0].name
        self._has_policy = any(o.name == "policy_logits" for o in meta.outputs)

    def until(self, deadline: Deadline | None):
        """This evaluator as a LeafEvaluator whose calls end by ``deadline``
        (None: only ``timeout_s``), so a slow reward service cannot hold a
        search past its own deadline."""
        return lambda observations: self(observations, deadline)

    def __call__(self, observations: np.ndarray, deadline: Deadline | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Values float32 [N] (side to move's view) and priors float32 [N, A] or None.

        Raises:
            EvaluatorUnavailable: the reward service failed, is unreachable, or
                did not answer by ``deadline``.
        """
        start = time.perf_counter()
        timeout = self.timeout_s
        if deadline is not None:
            timeout = max(min(timeout, deadline.left_s()), 1e-3)
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
        answer = values_and_priors({t.name: tensors.from_proto(t) for t in reply.outputs})
        self.totals.add(len(observations), start, reply.queue_ms, reply.compute_ms)
        return answer


def values_and_priors(outputs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
    """Values float32 [N] and priors float32 [N, A] (the softmax of
    ``policy_logits``; None without it) from the model's outputs by name."""
    values = outputs["value"].reshape(-1).astype(np.float32)
    logits = outputs.get("policy_logits")
    if logits is None:
        return values, None
    logits = np.asarray(logits, np.float32)
    priors = logits - logits.max(axis=1, keepdims=True)  # a new array: changed in place below
    np.exp(priors, out=priors)
    priors /= priors.sum(axis=1, keepdims=True)
    return values, priors


class LeafChannelEvaluator:
    """The value model through the leaf channel (tandem/leaf_channel.py), or
    through the in-process link of a reward service in this process.

    Args:
        channel: an attached :class:`tandem.leaf_channel.LeafChannel`, or an
            in-process link (tandem/in_process.py), which answers to the same calls.
        timeout_s: per-call deadline (s), as RewardServiceEvaluator's: a wave
            waits at most this long even with no or a later ``deadline``.
        handoff: the hand-off's name (``leaf_channel`` or ``in_process``).
    """

    def __init__(self, channel: LeafChannel, timeout_s: float = 2.0, handoff: str = HANDOFF_LEAF_CHANNEL):
        self.channel, self.timeout_s, self.handoff = channel, timeout_s, handoff
        self.totals = CallTotals()

    def __call__(self, observations: np.ndarray, deadline: Deadline | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """As :meth:`RewardServiceEvaluator.__call__`.

        Raises:
            EvaluatorUnavailable: the server's status, or a broken connection
                (the channel is closed then).
        """
        return values_and_priors(self.wave(self.channel.evaluate, observations, len(observations), deadline))

    def wave(self, send, inputs, rows: int, deadline: Deadline | None) -> dict:
        """``send(inputs, deadline)`` -- one of the channel's wave calls -- bound
        by ``deadline`` and at most ``timeout_s`` (as over gRPC: a reward service
        that hangs must not hold the search), counted in :attr:`totals`.

        Raises:
            EvaluatorUnavailable: the server's status, or a broken connection.
        """
        start = time.perf_counter()
        try:
            outputs = send(inputs, self.limit(deadline))
        except LeafChannelError as exc:
            raise self.unavailable(exc) from None
        self.answered(rows, start)
        return outputs

    def limit(self, deadline: Deadline | None) -> Deadline:
        """A wave's limit: ``deadline``, at most ``timeout_s`` from now."""
        return within_s(deadline, self.timeout_s)

    def unavailable(self, exc: LeafChannelError) -> EvaluatorUnavailable:
        """A wave's failure as the search sees it."""
        via = "leaf channel" if self.handoff == HANDOFF_LEAF_CHANNEL else "in process"
        return EvaluatorUnavailable(f"reward service ({via}): {exc}")

    def answered(self, rows: int, started: float) -> None:
        """Counts an answered wave of ``rows`` rows that began at ``started`` (perf_counter s) in :attr:`totals`."""
        self.totals.add(rows, started, self.channel.queue_ms, self.channel.compute_ms)


class DeviceWaves:
    """A leaf channel whose two regions are CUDA memory, or a device link of
    a reward service in this process, lent to one search call: the CUDA
    backend's device path (``CudaBackend.search(device_waves=)``).
    :attr:`handoff` says which (``leaf_channel`` or ``in_process``).
    Its calls end by ``deadline`` (or None: no deadline), and at most
    ``timeout_s`` after they start, as :class:`LeafChannelEvaluator`'s.

    Attributes:
        inputs: the input region, CuPy uint8 ``[max_rows, 2, 6, 7]``: the
            selection kernel writes a wave's leaves there, one row per slot.
        max_rows: the most rows one wave may carry.
    """

    def __init__(self, evaluator: LeafChannelEvaluator, deadline: Deadline | None):
        self._ev, self.deadline = evaluator, deadline
        self.handoff = evaluator.handoff  # leaf_channel or in_process
        self.max_rows = evaluator.channel.max_rows
        self.inputs = evaluator.channel.device_inputs
        # A leaf channel ordered by events: the selection marks a wave's inputs written (inputs_written).
        self._marks = isinstance(evaluator.channel, LeafChannel) and evaluator.channel.ordered

    @staticmethod
    def fits(channel: LeafChannel) -> bool:
        """Whether ``channel`` can carry device waves: CUDA regions, the
        selection kernel's uint8 [2, 6, 7] observations as its input, a value
        output of one float per row and, if any, policy logits of one per move
        (a model whose outputs do not fit goes the host way, whose checks
        refuse it: EvaluationFailed, and the search goes on with rollouts)."""
        rows = dict(channel.output_rows)
        return (channel.device_inputs is not None and channel.input_dtype == np.uint8
                and channel.input_row == OBSERVATION_ROW and rows.get("value") == (1,)
                and rows.get("policy_logits", (NUM_ACTIONS,)) == (NUM_ACTIONS,))

    @property
    def ordered(self) -> bool:
        """Whether the channel orders waves by CUDA events (LeafChannel.ordered):
        the caller queues a wave's kernels and calls :meth:`evaluate` without
        synchronising its stream."""
        return self._ev.channel.ordered

    def carries(self, rows: int) -> bool:
        """Whether a wave of ``rows`` slots (B trees x K) goes by these regions:
        the CUDA backend's rule for using them, which the servicer reports."""
        return rows <= self.max_rows

    def evaluate(self, rows: int):
        """Runs rows ``[0, rows)`` of :attr:`inputs` (written, and the writing
        kernel finished -- or, :attr:`ordered`, queued on the current stream)
        and returns the output region's views: values CuPy float32
        ``[max_rows, 1]`` and policy logits float32 ``[max_rows, A]`` or None;
        rows ``[0, rows)`` this wave's, valid until the next call, and in
        place for the kernels queued on the current stream after the return.

        Raises:
            EvaluatorUnavailable: as :meth:`LeafChannelEvaluator.__call__`.
        """
        outputs = self._ev.wave(self._ev.channel.evaluate_device, rows, rows, self.deadline)
        return outputs["value"], outputs.get("policy_logits")

    def inputs_written(self) -> None:
        """Marks the next wave's inputs written after the kernels queued on
        the current stream so far (an ordered leaf channel; else nothing to do).
        A broken CUDA state closes the channel: the wave's :meth:`evaluate` says so."""
        if self._marks:
            try:
                self._ev.channel.inputs_written()
            except LeafChannelError:  # the channel closed itself: the wave's evaluate fails, and the search undoes it
                pass

    @property
    def closed(self) -> bool:
        return self._ev.channel.closed


class HandoffEvaluator:
    """The value model by the leaf channel where it can be reached, else by gRPC.

    ``mode`` (``search.handoff``): ``"grpc"`` always calls ``Evaluate``;
    ``"auto"``, where the reward service at ``address`` runs in this very
    process (co-located mode: tandem/in_process.py), hands the waves to it
    in-process (host waves, and device waves through device links lent as
    below: ``handoff`` ``in_process``); else ``"auto"`` and ``"leaf_channel"`` attach a
    leaf channel in the background as soon as
    the reward service offers one (``ModelMetadata.runtime["leaf_channel"]``)
    and this process can connect to it, and use gRPC until then, or for waves
    larger than the channel carries. A channel whose connection breaks (the
    reward service restarted) is dropped: that wave fails
    (EvaluatorUnavailable, as over gRPC) and a new channel is attached in the
    background, at most every ``retry_s``. :attr:`handoff` is the hand-off of
    the last call.

    Device channels: once the channel is attached with CUDA regions, up to
    ``device_channels`` more are attached in the background, which
    :meth:`lend` lends one per wave (or search call) to the CUDA backend's
    device path (:class:`DeviceWaves`): its borrower sends its waves itself,
    besides the host calls, and the reward service's critical lane merges
    the waves that meet there (batching across groups and workers). A lent
    channel whose connection broke is closed when it comes back, with the free ones
    (the reward service they reach restarted or died), and new ones are
    attached at the next :meth:`lend` that finds none free.

    Thread safety: host calls (:meth:`__call__`) are serialised by ``_calls``
    (the wave loop's group threads: one per group of searches sharing their
    constants; the leaf channel carries one wave at a time); a lent channel
    is used by its borrower's thread alone until it is given back. ``_lock``
    guards the channel that the background attach publishes, ``_closed`` (a
    channel attached after :meth:`close` is closed at once),
    ``_device_free``, ``_device_count``, ``_topping_up`` and
    ``_next_device_attach`` (a top-up starts at most every ``retry_s``).
    ``why_grpc`` and ``handoff`` are single writes of strings, read anywhere.
    """

    def __init__(self, channel: grpc.Channel, model: str, mode: str = "auto", timeout_s: float = 2.0,
                 max_rows: int = 4096, retry_s: float = 1.0, device_channels: int = 4, address: str = ""):
        self.grpc = RewardServiceEvaluator(channel, model, timeout_s)
        self.address = address  # the reward service's: an in-process one is found by it
        self._stub, self.model, self.mode = reward_pb2_grpc.RewardServiceStub(channel), model, mode
        self.max_rows, self.retry_s, self.timeout_s = max_rows, retry_s, timeout_s
        self._lock = threading.Lock()
        self._calls = threading.Lock()  # one host call at a time (class docstring)
        self.calls = 0  # host calls made, each one model call (tests read it); guarded by _calls
        self._leaf: LeafChannelEvaluator | None = None  # guarded by _lock
        self._attaching = False  # guarded by _lock
        self._next_attach = 0.0  # time.monotonic() s; guarded by _lock
        self._closed = False  # guarded by _lock
        self.device_channels = device_channels
        self._device_free: list[LeafChannelEvaluator] = []  # attached device channels not lent; guarded by _lock
        self._device_count = 0  # device channels attached and not closed, lent or not; guarded by _lock
        self._topping_up = False  # guarded by _lock
        self._next_device_attach = 0.0  # time.monotonic() s: no top-up before; guarded by _lock
        self.handoff = HANDOFF_LEAF_CHANNEL if mode == HANDOFF_LEAF_CHANNEL else HANDOFF_GRPC
        self.why_grpc = "" if mode != HANDOFF_GRPC else "search.handoff: grpc"  # why the last call used gRPC

    def until(self, deadline: Deadline | None):
        """This evaluator with its calls bound by ``deadline`` (None: only ``timeout_s``)."""
        return lambda observations: self(observations, deadline)

    def __call__(self, observations: np.ndarray, deadline: Deadline | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """As :meth:`RewardServiceEvaluator.__call__`; waits for another
        group's call in flight at most until ``deadline`` (else ``timeout_s``).

        Raises:
            EvaluatorUnavailable: the hand-off used failed, its answer was
                malformed, or another call held the channel past ``deadline``.
        """
        if not self._calls.acquire(timeout=deadline.wait_s() if deadline is not None else self.timeout_s):
            raise EvaluatorUnavailable("reward service: DEADLINE_EXCEEDED (waiting for another wave's model call)")
        try:
            self.calls += 1
            return self._call(observations, deadline)
        except EvaluationFailed:
            raise
        except Exception as exc:  # a broken answer fails this wave (undone, rollouts), never the batch
            raise EvaluatorUnavailable(f"reward service: a malformed answer: {type(exc).__name__}: {exc}") from exc
        finally:
            self._calls.release()

    def _call(self, observations: np.ndarray, deadline: Deadline | None) -> tuple[np.ndarray, np.ndarray | None]:
        leaf = self._channel()
        if leaf is None or len(observations) > self.max_rows:
            self.handoff = HANDOFF_GRPC
            return self.grpc(observations, deadline)
        self.handoff = leaf.handoff
        try:
            return leaf(observations, deadline)
        except EvaluatorUnavailable:
            if leaf.channel.closed:  # the connection broke: attach again later
                with self._lock:
                    self._leaf = None
                self.why_grpc = f"{leaf.handoff} hand-off lost"
            raise

    def wait_attached(self, timeout_s: float) -> bool:
        """Starts an attach if none is running and waits up to ``timeout_s`` for
        the leaf channel; True once attached (benchmarks and tests: serving
        never waits, it uses gRPC meanwhile)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self._channel() is not None:
                return True
            time.sleep(0.01)
        return False

    def wait_device_channels(self, timeout_s: float) -> int:
        """Waits up to ``timeout_s`` for ``device_channels`` device channels to
        be attached (benchmarks and tests; serving never waits) and returns how
        many are."""
        end = time.monotonic() + timeout_s
        while True:
            self._top_up()
            with self._lock:
                count = self._device_count
            if count >= self.device_channels or time.monotonic() >= end:
                return count
            time.sleep(0.01)

    def _channel(self) -> LeafChannelEvaluator | None:
        """The attached channel, or None (and an attach started in the background)."""
        if self.mode == HANDOFF_GRPC:
            return None
        with self._lock:
            if self._leaf is not None or self._closed:
                return self._leaf
            if self._attaching or time.monotonic() < self._next_attach:
                return None
            self._attaching = True
            self._next_attach = time.monotonic() + self.retry_s
        threading.Thread(target=self._attach, name="leaf-channel-attach", daemon=True).start()
        return None

    def _local(self):
        """The in-process server of the reward service at :attr:`address`, where
        it runs in this process and ``mode`` is ``auto``; else None."""
        return in_process.find(self.address) if self.mode == "auto" and self.address else None

    def _local_link(self, device: bool):
        """A link of the in-process server (:meth:`_local`), or None: none, or
        one it refuses (logged, and said in ``why_grpc``; the leaf channel is
        tried instead for host waves)."""
        local = self._local()
        if local is None:
            return None
        try:
            return local.link(self.model, self.max_rows, device=device)
        except LeafChannelError as exc:
            self.why_grpc = f"in process: {exc}"
            log.warning("search service: the in-process reward service refuses a %s link (%s)",
                        "device" if device else "host", exc)
            return None

    def _attach(self) -> None:
        leaf = None
        try:
            link = self._local_link(device=False)
            channel = None if link else LeafChannel.offered(self._stub, self.model, self.max_rows, self.timeout_s)
            if link:
                leaf = LeafChannelEvaluator(link, self.timeout_s, HANDOFF_IN_PROCESS)
                log.warning("search service: the reward service runs in this process; waves go to it in-process")
            elif channel is None:
                self.why_grpc = "the reward service offers no leaf channel"
            else:
                leaf = LeafChannelEvaluator(channel, self.timeout_s)
                log.warning("search service: leaf channel to the reward service attached (%s input region, %s)",
                            channel.kind, channel.path)
        except (LeafChannelError, grpc.RpcError, OSError, ValueError) as exc:
            why = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            self.why_grpc = f"leaf channel: {why}"
            log.info("search service: no leaf channel (%s); leaves go over gRPC", why)
        except Exception as exc:  # anything else (CuPy out of memory...): still gRPC, and a retry later
            self.why_grpc = f"leaf channel: {type(exc).__name__}: {exc}"
            log.exception("search service: attaching the leaf channel failed; leaves go over gRPC")
        with self._lock:
            closed, self._attaching = self._closed, False
            if not closed:
                self._leaf = leaf
        if leaf is not None:
            if closed:  # closed while attaching: nothing may hold the socket and the regions on
                leaf.channel.close()
            else:
                self.why_grpc = ""  # gRPC again only for waves larger than the channel
                self._top_up()

    @contextlib.contextmanager
    def lend(self, deadline: Deadline | None):
        """A :class:`DeviceWaves` over a free device channel for one wave (or
        search call) whose calls end by ``deadline`` (None: none), given back
        when the block ends; None when none is free (the search goes the host
        way, :meth:`__call__`): none attached yet (an attach is started),
        all lent, or the reward service offers none with CUDA regions."""
        with self._lock:
            ev = self._device_free.pop() if self._device_free else None
        if ev is None:
            self._top_up()
            yield None
            return
        try:
            yield DeviceWaves(ev, deadline)
        finally:
            with self._lock:
                if ev.channel.closed:
                    # A broken connection: the reward service restarted or died, and the free
                    # channels are as dead as this one; new ones attach at the next lend.
                    drop, self._device_free = [ev, *self._device_free], []
                elif self._closed:
                    drop = [ev]
                else:
                    drop = []
                    self._device_free.append(ev)
                self._device_count -= len(drop)
            for gone in drop:
                gone.channel.close()

    def _top_up(self) -> None:
        """Attaches device channels up to ``device_channels`` in the background,
        if the channel is attached with CUDA regions and no top-up is running."""
        with self._lock:
            leaf = self._leaf
            if (self._closed or self._topping_up or leaf is None or leaf.channel.kind != "cuda"
                    or self._device_count >= self.device_channels or time.monotonic() < self._next_device_attach):
                return
            self._topping_up = True
            self._next_device_attach = time.monotonic() + self.retry_s  # a failing attach is tried again after
        threading.Thread(target=self._attach_device, name="leaf-channel-attach-device", daemon=True).start()

    def _attach_device(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed or self._device_count >= self.device_channels:
                        return
                local = self._local() is not None  # in this process a leaf channel's CUDA IPC handle does not open
                try:
                    channel = (self._local_link(device=True) if local else
                               LeafChannel.offered(self._stub, self.model, self.max_rows, self.timeout_s))
                except (LeafChannelError, grpc.RpcError, OSError, ValueError) as exc:
                    log.info("search service: no device leaf channel (%s)", exc)
                    return
                if channel is None or not DeviceWaves.fits(channel):
                    if channel is not None:
                        channel.close()
                    return
                handoff = HANDOFF_IN_PROCESS if local else HANDOFF_LEAF_CHANNEL
                with self._lock:
                    keep = not self._closed
                    if keep:
                        self._device_free.append(LeafChannelEvaluator(channel, self.timeout_s, handoff))
                        self._device_count += 1
                if not keep:
                    channel.close()
                    return
        except Exception:  # anything else (CuPy out of memory...): the host way, and a retry at a later lend
            log.exception("search service: attaching a device leaf channel failed")
        finally:
            with self._lock:
                self._topping_up = False

    def close(self) -> None:
        """Closes the leaf channel and the device channels not lent (a lent
        one when it comes back), and attaches none again (an attach under way
        closes its channel as it ends)."""
        with self._lock:
            leaf, self._leaf, self._closed = self._leaf, None, True
            free, self._device_free = self._device_free, []
            self._device_count -= len(free)
        for ev in free:
            ev.channel.close()
        if leaf is not None:
            leaf.channel.close()

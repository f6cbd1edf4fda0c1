"""The CUDA MPS control daemon, owned by the scheduler.

Across processes, stream priorities act only when the processes are clients
of one MPS server (docs/design.md, "Measured physics", consequence 1). So on a
GPU host the scheduler attaches to a control daemon that already answers in
the configured pipe directory, or starts one (``nvidia-cuda-mps-control -d``)
with ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY``; the reward
and search processes get the same two variables (:func:`client_env`, set by
``tandem up`` and ``tandem serve``) before they create their CUDA contexts.
On exit the scheduler stops the daemon (``echo quit | nvidia-cuda-mps-control``)
only if it started it.

Nothing here raises for a missing GPU, binary or daemon: :func:`ensure`
returns an :class:`MpsControl` whose ``message`` says plainly what holds.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.device import MPS_CONTROL_BINARY, mps_client_env, probe_mps

log = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0  # the daemon must answer within this after `-d`
_QUITTING: list[subprocess.Popen] = []  # stop(wait=False)'s control processes


@dataclass(frozen=True)
class MpsControl:
    """What :func:`ensure` found or did.

    Attributes:
        pipe_directory, log_directory: the directories all three processes share.
        binary: path of ``nvidia-cuda-mps-control``, "" when not on PATH.
        active: a control daemon answers in ``pipe_directory``.
        started: this process started it (and :func:`stop` will stop it).
        message: one sentence for the log and ``tandem status``.
    """

    pipe_directory: str
    log_directory: str
    binary: str = ""
    active: bool = False
    started: bool = False
    message: str = ""


def _control(binary: str, command: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([binary], input=command + "\n", capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **env})


def ensure(pipe_directory: str, log_directory: str, has_gpu: bool, *, timeout_s: float = START_TIMEOUT_S) -> MpsControl:
    """Attaches to the control daemon answering in ``pipe_directory``, or starts one.

    Never raises; on a host without a GPU, or without the binary, or where the
    daemon does not come up within ``timeout_s``, the result is inactive and
    its message says why and that priorities are not enforced across processes.
    """
    base = MpsControl(pipe_directory, log_directory)
    if not has_gpu:  # nothing to enforce, so no remedy to give
        return MpsControl(pipe_directory, log_directory, message=f"no GPU: MPS not started ({NOT_APPLICABLE})")
    binary = shutil.which(MPS_CONTROL_BINARY) or ""
    if not binary:
        return _inactive(base, f"MPS unavailable: {MPS_CONTROL_BINARY} is not on PATH")
    base = MpsControl(pipe_directory, log_directory, binary)
    _, answering, _ = probe_mps(pipe_directory, 2.0)
    if answering:
        return MpsControl(pipe_directory, log_directory, binary, True, False,
                          f"attached to the MPS control daemon already answering at {pipe_directory}")
    env = mps_client_env(pipe_directory, log_directory)
    try:
        for d in (pipe_directory, log_directory):
            Path(d).mkdir(parents=True, exist_ok=True)
        done = subprocess.run([binary, "-d"], capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **env})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return _inactive(base, f"could not start the MPS control daemon: {exc}")
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        return _inactive(base, f"{MPS_CONTROL_BINARY} -d failed (exit {done.returncode}"
                               f"{': ' + detail[-1] if detail else ''})")
    end = time.monotonic() + timeout_s
    message = ""
    while time.monotonic() < end:
        _, answering, message = probe_mps(pipe_directory, 2.0)
        if answering:
            return MpsControl(pipe_directory, log_directory, binary, True, True,
                              f"started the MPS control daemon (pipes {pipe_directory}, logs {log_directory})")
        time.sleep(0.05)
    return _inactive(base, f"started {MPS_CONTROL_BINARY} -d but it did not answer within {timeout_s:.0f} s "
                           f"({message}); see {log_directory}/control.log")


NOT_APPLICABLE = "not applicable without a GPU"  # MPS and stream priorities on a CPU host


def _inactive(base: MpsControl, why: str) -> MpsControl:
    return MpsControl(base.pipe_directory, base.log_directory, base.binary, False, False,
                      f"{why}; cross-process stream priorities are NOT enforced "
                      "(set co_located: true in the config, or start MPS)")


def stop(control: MpsControl, timeout_s: float = 10.0, wait: bool = True) -> bool:
    """Stops the control daemon if ``control.started`` (``quit``: MPS waits for
    its clients to finish). Returns whether it was asked to quit; never raises.

    ``wait=False``: for a caller that is itself an MPS client (a benchmark
    holding a CUDA context), whose ``quit`` would wait for its own exit: the
    command goes to a control process of its own session, left to finish
    once this process has gone."""
    if not control.started:
        return False
    if not wait:
        try:
            proc = subprocess.Popen([control.binary], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                                    env={**os.environ, **mps_client_env(control.pipe_directory,
                                                                        control.log_directory)})
            proc.stdin.write("quit\n")
            proc.stdin.close()
        except OSError as exc:
            log.warning("MPS control daemon: could not send `quit`: %s", exc)
            return False
        _QUITTING.append(proc)  # held, not dropped while it runs (Popen warns then); reaped at this process's exit
        return True
    try:
        done = _control(control.binary, "quit", mps_client_env(control.pipe_directory, control.log_directory), timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("MPS control daemon did not take `quit`: %s", exc)
        return False
    if done.returncode != 0:
        log.warning("MPS control daemon refused `quit` (exit %d): %s", done.returncode, done.stderr.strip())
        return False
    log.info("stopped the MPS control daemon at %s", control.pipe_directory)
    return True

"""``tandem status``: the scheduler's view (policy, MPS, services, assignments)
and each configured server's health, printed for people."""
from __future__ import annotations

import grpc
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

from stack.restarts import read_record
from tandem import nvml
from tandem.config import TandemConfig, endpoints
from tandem.server import channel, health_status


def _kind(k: int) -> str:
    return scheduler_pb2.ServiceKind.Name(k).removeprefix("SERVICE_KIND_").lower()


UP_HINT = "is tandem up running, with this config?"  # where nothing answers (as tandem play says)
NOT_APPLICABLE = "not applicable without a GPU"


def print_status(cfg: TandemConfig) -> int:
    """Prints the status; returns 0 if every server reports SERVING and the
    scheduler answered, else 1 (all of it is printed either way)."""
    print("health:")
    healthy, reached = True, False
    for name, (address, _) in endpoints(cfg).items():
        health = health_status(address, cfg)
        healthy &= health == "SERVING"
        reached |= health != "UNREACHABLE"
        print(f"  {name:<11} {address:<22} {health}")
    _print_restarts(cfg)
    with channel(cfg.scheduler.address, cfg) as ch:
        try:
            st = scheduler_pb2_grpc.SchedulerStub(ch).Status(scheduler_pb2.StatusRequest(), timeout=2)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                print(f"scheduler: not answering at {cfg.scheduler.address}"
                      + ("" if reached else f" ({UP_HINT})"))
            else:
                print(f"scheduler: {exc.code().name}: {exc.details()}")
            return 1
    print(f"scheduler: policy {st.policy}, {st.decisions} decisions, GPU {st.gpu or 'none'}")
    print(f"  bulk lever: frames {'AT RISK' if st.frames_at_risk else 'safe'}, "
          f"{st.bulk_share_changes} bulk share changes")
    gpu = nvml.sample()  # this host's GPU 0, where NVML answers
    if gpu is not None:
        print(f"  GPU utilisation {gpu['gpu_util_percent']:.0f} %, {gpu['memory_used_bytes'] / 2**30:.1f} of "
              f"{gpu['memory_total_bytes'] / 2**30:.1f} GiB in use, SM clock {gpu['sm_clock_mhz']} MHz")
    if not st.gpu:  # the models and the search run on the CPU: nothing to prioritise, nothing to fix
        print(f"  stream priorities and MPS: {NOT_APPLICABLE} (the services run on the CPU)")
    else:
        print(f"  stream priorities: least {st.least_priority}, greatest {st.greatest_priority}")
        enforced = "enforced" if st.priorities_enforced else "NOT ENFORCED across processes"
        print(f"  MPS: {'active' if st.mps_active else 'inactive'}; priorities {enforced}: {st.mps_message}")
        if cfg.co_located:
            print("  co-located: reward and search share one process, where stream priorities act without MPS")
        elif not st.priorities_enforced:
            print("  to have priorities act here: start MPS, or set co_located: true in the config")
    if not st.services:
        print("  no services registered")
    for s in st.services:
        a, load = s.assignment, s.last_load
        bulk = (f"  bulk share {a.bulk_share_percent or 100} %  critical p95 {load.critical_latency_ms:.2f} ms"
                if s.kind == scheduler_pb2.SERVICE_KIND_REWARD else "")
        print(
            f"  {_kind(s.kind):<7} {s.instance:<28} {s.address:<22} priority {a.stream_priority:>2}  "
            f"pool {load.memory_used_bytes / 2**20:.0f}/{a.memory_pool_bytes / 2**20:.0f} MiB  urgency {s.urgency:.2f}  "
            f"lease {s.lease_expires_in_ms:.0f} ms  queue {load.queue_depth}  {load.requests_per_s:.1f} req/s{bulk}"
        )
    return 0 if healthy else 1


def _print_restarts(cfg: TandemConfig) -> None:
    """The restarts of each server under the ``tandem up`` of this config, where one runs."""
    record = read_record(cfg)
    if record is None:
        return
    print(f"supervisor: tandem up (pid {record['supervisor_pid']})")
    for name, child in record["servers"].items():
        last = f" (last exit {child['last_exit']})" if child["last_exit"] is not None else ""
        print(f"  {name:<11} pid {child['pid']:<8} {child['state']}, {child['restarts']} restarts{last}")
        if (child.get("crash_looping") or child.get("starting")) and child.get("last_line"):
            print(f"  {'':<11} last log line: {child['last_line']}")

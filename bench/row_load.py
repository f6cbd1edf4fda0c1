"""Where a benchmark row's time went on the host: CPU per tandem server (all
its workers), the clients' CPU, the host's busy share, and the search
service's wave loop from its /metrics, all over the row (Linux, /proc).

A row of many engines that misses frames is either short of CPU somewhere
(one interpreter at its limit: a server's ``cpu_cores`` near 1 per worker; the
host's ``host_busy_share`` near 1) or waits on the GPU; these figures tell
which, beside the frame figures.

    load = RowLoad(stack_pid, search_metrics_port)
    ...  # the row runs
    row.update(load.finish())
"""
from __future__ import annotations

import resource
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from bench.service_cpu import cpu_seconds
from loadtest.chaos import stack_processes
from tandem.workers import children

_PHASES = ("join", "leave", "wave", "roots")
# The wave loop's samples read from /metrics: sample name -> key (formatted with its labels).
_SAMPLES = {
    "tandem_search_join_left_seconds_bucket": "join_left_le_{le}", "tandem_search_join_left_seconds_count": "joined",
    "tandem_search_simulations_bucket": "simulations_le_{le}", "tandem_search_simulations_count": "answered",
    "tandem_search_wave_phase_seconds_sum": "{phase}_s", "tandem_search_wave_phase_seconds_count": "{phase}_n",
    "tandem_search_wave_trees_sum": "trees", "tandem_search_wave_trees_count": "waves",
    "tandem_search_wave_leaves_sum": "leaves", "tandem_search_wave_leaves_count": "planned",
    "tandem_search_wave_expected_seconds_sum": "expected_s", "tandem_search_wave_expected_seconds_count": "expected_n",
    "tandem_search_left_total": "left_{end}",
    "tandem_search_refused_total": "refused_{reason}",
    "tandem_rpc_shed_total": "shed_{method}",
}


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (those gone count 0)."""
    total = 0.0
    for pid in pids:
        try:
            total += cpu_seconds(pid)
        except OSError:
            pass
    return total


def _host_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole host so far (/proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return sum(ticks) - idle, sum(ticks)


def _servers(supervisor: int) -> dict[str, list[int]]:
    """``tandem up``'s servers by name (its ``serve NAME`` children), each with its workers."""
    return {name: [pid, *children(pid)] for name, pid in stack_processes(supervisor).items()}


def wave_sums(port: int) -> dict[str, float]:
    """The search service's wave-loop counters now (sums in s, counts):
    ``<phase>_s``, ``<phase>_n`` per phase, ``trees``, ``waves``, ``leaves``
    over ``planned`` waves, ``expected_s`` over ``expected_n``, ``left_<end>`` per way a
    search left, ``joined`` searches and their time left as cumulative
    buckets ``join_left_le_<bound>``, ``answered`` searches and their
    simulations as buckets ``simulations_le_<bound>``; {} if /metrics does
    not answer."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in _SAMPLES:
                out[_SAMPLES[s.name].format(**s.labels)] = s.value
    return out


def _buckets(d: dict[str, float], prefix: str) -> list[tuple[float, float]]:
    """A histogram's cumulative bucket counts ``d[prefix + le]`` as (bound, count), by bound."""
    return sorted((float(k[len(prefix):]), v) for k, v in d.items() if k.startswith(prefix))


def _at_most_zero(d: dict[str, float], prefix: str) -> float:
    """Observations at most 0 of a histogram with a bucket bound at 0 (:func:`_buckets`)."""
    return next((count for bound, count in _buckets(d, prefix) if bound == 0.0), 0.0)


def _median_of_buckets(d: dict[str, float], prefix: str) -> float | None:
    """The median of a histogram's observations from its cumulative bucket
    counts (:func:`_buckets`), linear within the bucket that holds it (as
    Prometheus's ``histogram_quantile``); None without observations, the
    largest finite bound where it lies past it, the first bound where it
    lies in the first bucket."""
    buckets = _buckets(d, prefix)
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    lower, below = None, 0.0
    for bound, count in buckets:
        if count >= total / 2:
            if bound == float("inf"):
                return lower
            if lower is None or count == below:
                return bound
            return lower + (bound - lower) * (total / 2 - below) / (count - below)
        lower, below = bound, count
    return lower


def wave_figures(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict:
    """The wave loop's figures between two :func:`wave_sums` readings
    ``wall_s`` (s) apart: ``join_ms_mean``, ``leave_ms_mean``, ``wave_ms_mean``,
    ``roots_ms_mean`` (ms a step; roots: a wave of fresh roots valued alone),
    ``waves_per_s``, ``trees_per_wave`` (both kinds of wave), ``root_wave_share``
    (of the waves run), ``leaves_per_wave``
    (waves of K, not sliced rollout waves), ``wave_expected_ms_mean`` (the
    plan's; these two, as ``wave_ms_mean``, over the waves that ran
    simulations), ``join_left_ms_p50`` (time left before a search's deadline
    as it joined: the median, linear within its bucket), ``joined_spent_share``
    (of the searches that joined, those with none left), ``unsimulated_share``
    (of the searches answered, those with no simulation), ``left_by``
    (searches by why they left: budget, proven, deadline, stopped, failed), ``refused_by`` (searches refused at
    admission, by why: full, deadline, spent), ``shed_by`` (the search
    service's calls shed by overload, by method); each absent where nothing
    was counted."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    out: dict = {}
    for phase in _PHASES:
        if d.get(f"{phase}_n"):
            out[f"{phase}_ms_mean"] = round(1e3 * d[f"{phase}_s"] / d[f"{phase}_n"], 3)
    if d.get("waves"):
        out["waves_per_s"] = round(d["waves"] / wall_s, 1)
        out["trees_per_wave"] = round(d["trees"] / d["waves"], 2)
    if d.get("planned"):
        out["leaves_per_wave"] = round(d["leaves"] / d["planned"], 1)
    if d.get("expected_n"):
        out["wave_expected_ms_mean"] = round(1e3 * d["expected_s"] / d["expected_n"], 3)
    if d.get("roots_n", 0) + d.get("wave_n", 0) > 0:
        out["root_wave_share"] = round(d.get("roots_n", 0.0) / (d.get("roots_n", 0.0) + d.get("wave_n", 0.0)), 3)
    # Counts that went down (the service restarted within the row) give no figure.
    median = _median_of_buckets(d, "join_left_le_")
    if d.get("joined", 0) > 0 and median is not None:
        out["join_left_ms_p50"] = round(1e3 * median, 3)
        out["joined_spent_share"] = round(_at_most_zero(d, "join_left_le_") / d["joined"], 3)
    if d.get("answered", 0) > 0:
        out["unsimulated_share"] = round(_at_most_zero(d, "simulations_le_") / d["answered"], 3)
    for prefix, key in (("left_", "left_by"), ("refused_", "refused_by"), ("shed_", "shed_by")):
        counts = {k[len(prefix):]: int(v) for k, v in sorted(d.items()) if k.startswith(prefix) and v}
        if counts:
            out[key] = counts
    return out


class RowLoad:
    """Samples at construction, reports the differences at :meth:`finish`.

    Args:
        supervisor: the ``tandem up`` process's pid.
        search_metrics_port: ``search.metrics_port`` (the wave loop of all its workers;
            0: no wave figures).
    """

    def __init__(self, supervisor: int, search_metrics_port: int = 0):
        self.servers = _servers(supervisor)
        self.port = search_metrics_port
        self.t0 = time.monotonic()
        self.cpu0 = {name: _cpu_s(pids) for name, pids in self.servers.items()}
        self.host0 = _host_ticks()
        self.clients0 = self._clients_s()
        self.waves0 = wave_sums(self.port) if self.port else {}

    @staticmethod
    def _clients_s() -> float:
        """CPU seconds of this process's children that have ended and been waited for (the engines)."""
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    def finish(self) -> dict:
        """The row's figures: ``cpu_cores`` {server: cores used on average over
        the row, its workers summed}, ``clients_cpu_cores`` (this process's
        children waited for since: the engines), ``host_busy_share`` (0..1, every core), and
        the search service's wave loop, all workers (:func:`wave_figures`; absent
        without /metrics)."""
        wall = max(time.monotonic() - self.t0, 1e-9)
        busy, total = _host_ticks()
        out: dict = {
            "cpu_cores": {name: round((_cpu_s(pids) - self.cpu0[name]) / wall, 2)
                          for name, pids in self.servers.items()},
            "clients_cpu_cores": round((self._clients_s() - self.clients0) / wall, 2),
            "host_busy_share": round((busy - self.host0[0]) / max(total - self.host0[1], 1), 3),
        }
        if self.port:
            out.update(wave_figures(self.waves0, wave_sums(self.port), wall))
        return out

"""One YAML file configures all three servers (``deploy/config/tandem.yaml``).

The schema is the dataclasses below: every field has a default, durations and
sizes carry their unit in the name (``_ms``, ``_us``, ``_bytes``), and loading
refuses unknown keys and bad values with a :class:`ConfigError` that names the
key (``reward.models[0].path: file not found``). A relative path whose first part
names one of tandem's packages (``reward_service/models/frame_reward.onnx``) is
that package's bundled file, wherever tandem is installed; other relative paths
are from the working directory (:func:`resolve_path`).
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from tandem.paths import PACKAGES, bundled, package_path
from tandem.urgency_weights import UrgencyWeights

DEFAULT_CONFIG = bundled("tandem.yaml")  # deploy/config/tandem.yaml in the checkout


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the key."""


@dataclass(frozen=True)
class TlsConfig:
    """TLS for the servers, and for tandem's own clients of them (health checks,
    ``tandem status``/``play``, search -> reward, the scheduler client). All
    paths empty: plaintext (loopback only)."""

    cert_path: str = ""  # PEM certificate chain of the server
    key_path: str = ""  # PEM private key of the server
    client_ca_path: str = ""  # PEM CA bundle; set: clients must present a certificate (mutual TLS)
    ca_path: str = ""  # PEM CA bundle tandem's clients verify the servers with; empty: cert_path itself
    client_cert_path: str = ""  # PEM certificate tandem's clients present (mutual TLS); with client_key_path
    client_key_path: str = ""  # PEM private key of client_cert_path


@dataclass(frozen=True)
class ServerConfig:
    """What every gRPC server shares."""

    # Threads serving RPCs: at least max_concurrent_rpcs, so that every admitted call has
    # its own at once (none waits in the executor's queue; tandem/guard.py). The scheduler
    # also sizes its watch-stream slots from it.
    max_workers: int = 16
    # Application calls in flight at once (health checks apart); more: RESOURCE_EXHAUSTED at once.
    # While all are taken, a new call takes the place of one that has waited 0.5 s or more
    # for its request message (tandem.guard.SILENT_AFTER_S), which is cancelled.
    max_concurrent_rpcs: int = 256
    # Calls one HTTP/2 connection may carry at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS;
    # health calls count); 0 = no cap (gRPC's default). Once a client has read the
    # server's settings its further calls wait in its own channel; but the calls it opens
    # beyond the cap before that (a burst on a new connection) are refused REFUSED_STREAM,
    # which grpcio 1.85's client reports UNAVAILABLE without retrying (45 of 50 at a cap of 4),
    # and so were calls that waited for a stream to end (tests/stack/test_transport.py):
    # so off by default. Silent calls and unread responses are bounded without it
    # (tandem/guard.py).
    max_concurrent_streams: int = 0
    # Admitted calls one connection (one client socket: gRPC's peer address) may hold at once;
    # more: RESOURCE_EXHAUSTED. So one connection that never reads, or floods, leaves the
    # other max_concurrent_rpcs - this for everyone else; 0 = no cap.
    max_rpcs_per_connection: int = 64
    # A call whose request message has not arrived this long after the call did (for a
    # client stream: after the previous message) is cancelled, freeing its thread.
    request_message_timeout_ms: float = 10_000.0
    # A call whose response gRPC has not taken this long after the handler gave it (a
    # client that does not read, or grants no HTTP/2 window) is cancelled, freeing its
    # thread, its admission place and the response.
    response_write_timeout_ms: float = 2000.0
    max_message_bytes: int = 64 * 1024 * 1024  # receive and send limit per message
    grace_period_ms: float = 5000.0  # drain time on SIGTERM before in-flight RPCs are cancelled
    # Clients may ping an idle connection this often (game engines ping every ~45 s);
    # a client pinging faster is sent GOAWAY (too_many_pings) after two strikes.
    keepalive_min_ping_interval_ms: int = 10_000
    # How long a Python thread may hold the interpreter before another that waits for it is
    # let in (sys.setswitchinterval; the process's, so co-located servers share the smaller).
    # Python's 5000 µs would make a thread that waits on the GPU or a socket many times a
    # wave wait up to 5 ms each time it wants the interpreter back from a busy gRPC handler.
    switch_interval_us: float = 200.0
    # Overload shedding (tandem/overload.py, CoDel's rule): once admitted calls have queued for
    # a thread without a break for 100 ms, a call whose thread starts more than this long after
    # its arrival is refused RESOURCE_EXHAUSTED before any work, instead of being served late;
    # the episode ends when the queue is empty. 0 = never shed.
    queue_wait_target_ms: float = 5.0


@dataclass(frozen=True)
class SchedulerConfig:
    address: str = "127.0.0.1:50050"
    metrics_port: int = 9450  # Prometheus /metrics; 0 = off
    policy: str = "default"  # "default" | "dynamic" | "static"
    lease_ttl_ms: float = 3000.0  # a service that has not reported for this long is dropped
    report_interval_ms: float = 250.0  # how often services report load (and renew their lease)
    gpu_memory_bytes: int = 0  # memory the scheduler may hand out; 0 = the device's total (unlimited on CPU)
    # CUDA MPS (scheduler/mps.py): "auto" = on a GPU host attach to the control daemon answering in
    # mps_pipe_directory or start one (and stop it on exit); "off" = leave MPS alone. The reward and
    # search processes get both directories in their environment (tandem up / tandem serve).
    mps: str = "auto"
    mps_pipe_directory: str = ""  # empty: $CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps
    mps_log_directory: str = ""  # empty: $CUDA_MPS_LOG_DIRECTORY, else /tmp/nvidia-log
    # Urgency weights, hysteresis thresholds and the static partition (tandem/urgency_weights.py,
    # UrgencyWeights: names; the formula in scheduler/policy.py, units and rules there); any subset may be given.
    urgency: UrgencyWeights = field(default_factory=UrgencyWeights)
    server: ServerConfig = field(default_factory=ServerConfig)


PRECISIONS = ("fp32", "fp16", "auto")  # ModelConfig.precision's choices


@dataclass(frozen=True)
class ModelConfig:
    name: str = ""  # name clients use in EvaluateRequest.model
    path: str = ""  # ONNX file; relative paths are relative to the repository root
    description: str = ""
    max_batch_size: int = 1024  # larger batches: INVALID_ARGUMENT
    # "fp32": run the file as it is. "fp16": convert it at load to an FP16 body whose
    # last layer and outputs stay FP32 (reward_service/precision.py; needs
    # onnxconverter-common); inputs keep their types. "auto": fp16 where the model runs
    # on the CUDA execution provider, fp32 on the CPU one (whose FP16 convolutions are
    # emulated through casts: connect4_value ran 1.5x slower there in FP16).
    precision: str = "fp32"
    # Batch sizes the dynamic batcher pads to (ascending). Requests are merged up to the
    # largest bucket (and max_batch_size) and padded to the smallest bucket that holds
    # them; on a GPU each bucket has preallocated device buffers and, with cuda_graph, a
    # CUDA graph. A single request larger than the largest bucket runs alone, unpadded.
    # On the CPU nothing is padded (padding only pays for fixed-shape GPU replays).
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    # Capture one CUDA graph per bucket and replay it (ONNX Runtime enable_cuda_graph,
    # run option gpu_graph_id). Needs every node on the CUDA execution provider; where
    # capture fails, or on the CPU, the model runs without graphs and says so in its log.
    cuda_graph: bool = False
    # CUDA: let ONNX Runtime run convolutions in NHWC (its prefer_nhwc option); FP16
    # tensor-core convolutions are NHWC-native, so this mostly pays with precision fp16.
    prefer_nhwc: bool = False
    # CUDA: add each convolution's bias inside the convolution's own kernel (ONNX Runtime's
    # fuse_conv_bias: cuDNN's frontend fuses the bias as the kernel's epilogue) instead of
    # in a kernel of its own; batch norms folded into the convolutions make that one
    # elementwise pass less per convolution. With FP16 and prefer_nhwc on the H200,
    # connect4_value's graph replay took 2,025 µs at 4,096 rows against 2,810 without
    # (docs/benchmarks.md). Needs prefer_nhwc with fp16 (cuDNN found no NCHW FP16 plan).
    fuse_conv_bias: bool = False


@dataclass(frozen=True)
class SharedMemoryConfig:
    """Shared-memory tensors of the reward service (reward_service/shared_memory.py,
    after Triton Inference Server's shared-memory extension): regions a client
    registers once and Evaluate then names instead of carrying bytes. Passing
    a limit: RESOURCE_EXHAUSTED."""

    # A region neither used by an Evaluate nor renewed by its client's
    # SharedMemoryStatus (the heartbeat) for this long is unregistered and closed:
    # how a client that went away without unregistering is cleaned up.
    lease_ttl_ms: float = 60_000.0
    max_regions_per_client: int = 16  # regions one client (uid and client_id) may hold
    max_bytes_per_client: int = 4 * 1024**3  # their byte_size summed (held in the client's memory, not copied)
    max_regions: int = 256  # all clients together (each holds a file descriptor or a mapping)
    # Regions of one user (the caller's uid) over all its client_ids: ids are free to
    # choose, so without it one user rotating them would fill max_regions for everyone.
    # The stack's own leaf channels count for the user it runs as (3 per connection at most).
    max_regions_per_user: int = 128
    # Registration only from the server's own host (loopback or Unix-socket peers):
    # a region names memory on this host, which a remote caller has no business mapping.
    local_clients_only: bool = True


@dataclass(frozen=True)
class LeafChannelConfig:
    """The leaf channel (reward_service/leaf_channel.py, tandem/leaf_channel.py):
    a search's leaf observations and their values through two shared-memory
    regions, with one Unix-domain socket message each way per wave. The search
    service uses it when it reaches this socket (same host), else gRPC."""

    enabled: bool = True
    socket_dir: str = ""  # where the socket is made; "" = the system's temporary directory
    max_rows: int = 8192  # most rows one wave may carry (the regions are sized for it)
    max_connections: int = 16  # search services attached at once; more: RESOURCE_EXHAUSTED
    # A connection that has not attached this long after it was accepted is answered
    # DEADLINE_EXCEEDED and closed: it held one of max_connections slots and nothing else.
    attach_timeout_ms: float = 2000.0


@dataclass(frozen=True)
class BulkServerConfig:
    """The reward service's bulk server (reward_service/server.py, role ``bulk``):
    a second reward-service process, started by ``tandem up`` after the first,
    that serves the same models to bulk clients (trainers, offline scoring) on
    an address of its own. Why a process: gRPC ingest, the batcher and the
    copies of a bulk client run in Python, and one interpreter runs one thread
    at a time; beside a trainer a critical request waited for that interpreter,
    not for the GPU (docs/design.md, "The bulk server"). It registers with
    the scheduler as a reward service, so the bulk lever reaches it."""

    enabled: bool = True
    address: str = "127.0.0.1:50053"
    metrics_port: int = 9453  # 0 = no metrics endpoint
    # The reward service's standby: the bulk server also holds a critical lane per model and
    # serves critical requests, which tandem's clients send here while the reward service is
    # down (tandem/failover.py); it costs that lane's runner (memory, warm-up). Off: critical
    # requests here are FAILED_PRECONDITION, and a reward service restart fails frames.
    standby: bool = True


@dataclass(frozen=True)
class RewardConfig:
    address: str = "127.0.0.1:50051"
    metrics_port: int = 9451
    execution_provider: str = "auto"  # "auto" (CUDA if it loads, else CPU) | "cuda" | "cpu"
    nonfinite_inputs: str = "reject"  # NaN/Inf in float inputs: "reject" (INVALID_ARGUMENT) | "pass"
    memory_pool_bytes: int = 0  # ONNX Runtime arena limit (gpu_mem_limit); 0 = no limit
    intra_op_threads: int = 0  # CPU execution provider threads; 0 = ONNX Runtime's default
    # ONNX Runtime's thread pools busy-wait for work after each run (session.intra_op /
    # inter_op.allow_spinning) unless told not to: off, an idle or lightly loaded service
    # costs ~0 CPU (on a 2-core host the search's); on, a run may start a few µs sooner.
    ort_thread_spinning: bool = False
    # How the service's threads wait for the GPU in synchronising CUDA calls (tandem.gpu.set_host_wait):
    # "auto" (CUDA's default: spin while the process has fewer contexts than cores) | "spin" | "yield" |
    # "block" (sleep until the GPU signals: no core burnt per waiting thread, a wake-up later).
    # Co-located mode applies the reward service's.
    host_wait: str = "auto"
    # Dynamic batcher (reward_service/batcher.py), one queue per model:
    # how long a bulk request waits for others to merge with (µs; 0 = merge only what is
    # already queued). REQUEST_CLASS_CRITICAL requests never wait for company.
    max_queue_delay_us: float = 100.0
    max_queue_size: int = 256  # requests waiting per model; more: RESOURCE_EXHAUSTED (bulk is shed first)
    # Bytes of the Evaluate requests being served together (serialized size), all models;
    # more: RESOURCE_EXHAUSTED. Bulk requests may fill 3/4 of it, the rest is for critical
    # ones; a request that finds nothing in flight is always admitted. 0 = no bound.
    max_bytes_in_flight: int = 256 << 20
    # cuDNN convolution algorithm choice: "HEURISTIC" (cuDNN's guess: a bucket's warm-up
    # ~0.11 s on the H200), "EXHAUSTIVE" (every algorithm timed at warm-up: ~0.7 s a
    # bucket, runs within 8 % of HEURISTIC's; docs/decisions/0011-start-up.md) or
    # "DEFAULT" (a fixed algorithm).
    cudnn_conv_algo_search: str = "HEURISTIC"
    # CUDA stream priorities the service may be assigned by the scheduler (0 = least
    # urgent, down to -5 on an H200): one ONNX Runtime session per model, priority and batch bucket,
    # each bound to a CuPy stream of that priority (user_compute_stream), for the bulk lane;
    # the critical lane has one more set at the greatest of them (reward_service/batcher.py).
    # memory_pool_bytes is split evenly over all sessions.
    stream_priorities: tuple[int, ...] = (0, -5)
    # Processes serving reward.address together (SO_REUSEPORT; tandem/workers.py), each
    # with its own sessions (GPU memory and start-up times this many), batchers and leaf
    # channel; a connection stays with one, so a client registers shared memory and
    # evaluates over one channel. Worker 0's metrics endpoint serves every worker's metrics
    # merged (counters, histograms and in-flight gauges summed; tandem/multiprocess_metrics.py).
    # The bulk server stays one. At most 64.
    workers: int = 1
    models: tuple[ModelConfig, ...] = (
        ModelConfig(
            name="connect4_value",
            path="reward_service/models/connect4_value.onnx",
            description="Connect Four value and policy network (reward_service/models/connect4_value.md)",
            max_batch_size=8192,
            precision="auto",
            batch_buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),  # search waves; bulk up to 8192
            cuda_graph=True,
            prefer_nhwc=True,
            fuse_conv_bias=True,
        ),
        ModelConfig(
            name="frame_reward",
            path="reward_service/models/frame_reward.onnx",
            description="Connect Four value from a 224x224 RGB uint8 frame (reward_service/models/frame_reward.md)",
            max_batch_size=256,
            cuda_graph=True,
        ),
    )
    shared_memory: SharedMemoryConfig = field(default_factory=SharedMemoryConfig)
    leaf_channel: LeafChannelConfig = field(default_factory=LeafChannelConfig)
    bulk_server: BulkServerConfig = field(default_factory=BulkServerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


@dataclass(frozen=True)
class SearchConfig:
    address: str = "127.0.0.1:50052"
    metrics_port: int = 9452
    backend: str = "auto"  # "auto" (CUDA where CuPy sees a GPU, else CPU) | "cpu" | "cuda"
    host_wait: str = "auto"  # as reward.host_wait, for the search service's threads
    # default when a request leaves it unspecified: "auto" (the value model where the search runs on
    # the CUDA backend, rollouts on the CPU, where the model is too slow for a frame) | "rollout" | "value_model"
    evaluator: str = "auto"
    reward_address: str = ""  # reward service for the value model; empty = reward.address
    value_model: str = "connect4_value"  # model name on the reward service
    parallel_sims: int = 16  # simulations in flight per tree in one wave (virtual loss)
    # The same for value-model searches: a wave is one model call (a round trip to the reward
    # service), so wider waves buy more simulations per frame at the cost of more virtual loss.
    value_model_parallel_sims: int = 32
    # Simulations of a value-model wave that one warp of the CUDA backend selects one
    # after another (1..32), each seeing the virtual losses of those before it: 32 picks
    # the CPU reference's leaves; 1 selects them all at once, faster, but more of them
    # alike (docs/design.md, "Tree search on the GPU"). Rollout searches keep one per warp.
    value_model_sims_per_warp: int = 32
    c_uct: float = 1.4  # UCT exploration constant (rollout evaluator)
    c_puct: float = 1.5  # PUCT exploration constant (value-model evaluator)
    max_nodes: int = 200_000  # node pool per tree
    max_simulations: int = 10_000_000  # larger budgets: INVALID_ARGUMENT
    # The longest any search runs (ms): longer deadline_ms: INVALID_ARGUMENT; a search
    # without deadline_ms (simulations only) stops here and answers (deadline_reached).
    max_deadline_ms: float = 60_000.0
    max_sessions: int = 1024  # trees kept for reuse; the least recently used goes first
    # ... and the bytes those trees hold together (node pools: ~166 bytes a slot on the CPU,
    # 176 on the GPU); the least recently used go first, a larger tree alone is not kept.
    max_session_bytes: int = 256 << 20
    session_ttl_ms: float = 60_000.0  # a session's tree is dropped after this long unused
    # CUDA stream priorities the scheduler may assign (0 = least urgent, down to -5 on an
    # H200): one CuPy stream per priority, created on first use (search_service/streams.py).
    stream_priorities: tuple[int, ...] = (0, -5)
    # CuPy memory pool limit (MemoryPool.set_limit), fixed at start; a search that would
    # exceed it fails with RESOURCE_EXHAUSTED. 0 = no limit.
    memory_pool_bytes: int = 0
    # Value-model leaves: the answers of positions already evaluated, kept up to this
    # many bytes (least recently used out; search_service/leaf_cache.py). 0 = no cache.
    evaluation_cache_bytes: int = 64 << 20
    # How leaves reach the reward service: "auto" (in-process where the reward service
    # runs in this process -- co-located mode, tandem/in_process.py -- else the leaf
    # channel where the reward service offers one this process can reach -- same host --
    # else gRPC), "leaf_channel" (the leaf channel; gRPC only while it cannot connect) or "grpc"
    # (one Evaluate per wave).
    handoff: str = "auto"
    # Leaf channels of CUDA regions lent one per value-model wave on the GPU
    # (search_service/evaluators.py HandoffEvaluator.lend): the leaves and the model's
    # answers never on the host; a wave that finds none free goes the host way. 0 = none. Each takes a reward.leaf_channel
    # connection (max_connections).
    device_channels: int = 4
    # Every search in flight advances as one batch of trees, one wave at a time
    # (search_service/wave_loop.py; backends that batch trees: the CPU reference).
    max_trees: int = 1024  # searches in flight at once (joined or waiting); more: RESOURCE_EXHAUSTED
    # Positions in one SearchBatch call; more: INVALID_ARGUMENT. At most 256: a request of 64 KiB
    # or more holds at most 4,096 fields, nested ones counted (tandem/guard.py): ~300 searches.
    max_batch_searches: int = 256
    # Searches bounded by a deadline alone take fewer simulations a wave where a wave
    # at parallel_sims each would take longer than this (ms): under load waves stay
    # short, every search gets several in its frame and newcomers join soon; their waves
    # grow to at most twice the largest recent one (search_service/mcts/plan.py). 0: never cut.
    wave_target_ms: float = 4.0
    # A rollout wave lasts this long (ms): searches bounded by a deadline alone take as
    # many simulations as fit (the CUDA kernel reads the clock between a warp's
    # simulations), capped ones up to their cap; searches join and leave between slices
    # (search_service/mcts/plan.py). Shorter: newcomers join sooner and a search loses
    # less of its deadline to the wave it cannot finish; longer: less per-wave overhead.
    # 0: waves of parallel_sims simulations.
    rollout_slice_ms: float = 1.0
    # Processes serving search.address together (SO_REUSEPORT; tandem/workers.py): each
    # has its own interpreter, wave loop, batch of trees, sessions and leaf channels, and
    # the kernel spreads connections over them (a connection, and so a session, stays
    # with one). One Python process serves about a thousand calls a second; more engines
    # need more workers. Worker 0's metrics endpoint serves every worker's metrics merged
    # (counters, histograms and in-flight gauges summed; tandem/multiprocess_metrics.py). At most 64.
    workers: int = 1
    # Game folders the search service loads at start, besides Connect Four (built in): each
    # a folder with game.yaml and rules.py (search_service/games/protocol.py), anywhere; a
    # relative path under one of tandem's packages is the bundled folder. Every game loaded
    # is served at once (Search.game, ListGames); a folder that does not load stops start-up.
    games: tuple[str, ...] = ("search_service/games/othello", "search_service/games/gomoku")
    server: ServerConfig = field(default_factory=ServerConfig)


@dataclass(frozen=True)
class TandemConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)  # applies to all three servers
    auth_token: str = ""  # non-empty: every RPC must send "authorization: Bearer <token>"
    # Reward and search services in one process (stack/colocated.py): stream priorities act
    # there without MPS. `tandem up` then starts two processes (scheduler, co_located).
    co_located: bool = False


_CHOICES = {
    "scheduler.policy": ("default", "dynamic", "static"),
    "scheduler.mps": ("auto", "off"),
    "reward.execution_provider": ("auto", "cuda", "cpu"),
    "reward.nonfinite_inputs": ("reject", "pass"),
    "reward.cudnn_conv_algo_search": ("EXHAUSTIVE", "HEURISTIC", "DEFAULT"),
    "reward.host_wait": ("auto", "spin", "yield", "block"),
    "search.host_wait": ("auto", "spin", "yield", "block"),
    "search.backend": ("auto", "cpu", "cuda"),
    "search.evaluator": ("auto", "rollout", "value_model"),
    "search.handoff": ("auto", "leaf_channel", "grpc"),
}
# Fields that may be zero (meaning "off" or "default"); every other number must be positive.
_MAY_BE_ZERO = {"metrics_port", "queue_wait_target_ms", "max_concurrent_streams", "max_rpcs_per_connection", "gpu_memory_bytes", "memory_pool_bytes", "intra_op_threads", "max_queue_delay_us",
                "evaluation_cache_bytes", "max_bytes_in_flight", "device_channels", "wave_target_ms",
                "rollout_slice_ms"}
# Sections that validate themselves (their dataclass's __post_init__), where zero may be meaningful.
_SELF_CHECKED = {"urgency"}
# Lists of numbers checked by their own rule instead (in _check_list).
_LISTS = {"batch_buckets", "stream_priorities"}
# Lists of folders, each holding the named file (in _check_folders; the search service loads them).
_FOLDERS = {"games": "game.yaml"}
# Upper bounds, by field name or by the unit suffix of the name (the first match counts).
# gRPC takes sizes, counts and intervals as C ints (int32), ports are 16-bit, and a
# duration past a day is a typo that would overflow timers.
_INT32_MAX = 2**31 - 1
_MAX_BY_NAME = {
    "max_message_bytes": _INT32_MAX,
    "max_bytes_per_client": 2**62,
    "max_simulations": 2**32 - 1,  # SearchRequest.simulations is a uint32
    "parallel_sims": 65536,  # SearchParams' range
    "value_model_parallel_sims": 65536,
    "value_model_sims_per_warp": 32,  # a warp's 32 lanes
    "workers": 64,  # processes sharing one address (tandem/workers.py)
    "max_batch_searches": 256,  # a SearchBatch of 256 fits the guard's field budget (tandem/guard.py)
    "switch_interval_us": 5000.0,  # Python's own: a server only ever shortens it
}
_MAX_BY_SUFFIX = (("_port", 65535), ("_bytes", 2**62), ("_ms", 86_400_000.0), ("_us", 86_400_000_000.0))
# Lower bounds of durations that a smaller positive value cannot mean (a typo, or seconds
# written as ms): a lease of 0.001 ms is expired before its first report arrives.
_MIN_BY_NAME = {"lease_ttl_ms": 10.0, "report_interval_ms": 10.0, "request_message_timeout_ms": 1.0,
                "response_write_timeout_ms": 1.0,
                "grace_period_ms": 1.0, "keepalive_min_ping_interval_ms": 1000, "max_deadline_ms": 1.0,
                "session_ttl_ms": 1.0, "wave_target_ms": 0.1, "rollout_slice_ms": 0.05, "attach_timeout_ms": 1.0, "switch_interval_us": 1.0}
_MAX_INT = _INT32_MAX  # any other count or size


def _upper_bound(name: str, value: int | float) -> int | float | None:
    if name in _MAX_BY_NAME:
        return _MAX_BY_NAME[name]
    for suffix, bound in _MAX_BY_SUFFIX:
        if name.endswith(suffix):
            return bound
    return _MAX_INT if isinstance(value, int) else None


# Keys a release removed -> what to do instead: named in the refusal, so an old config file says why.
RETIRED_KEYS = {
    "search.coalesce_max_rows": "removed: a wave's leaves, every tree of its batch, go in one call "
                                "(docs/decisions/0014-the-wave-loop-gets-the-interpreter-back.md); delete the line",
}


def _build(cls: type, data: Any, key: str) -> Any:
    """Builds dataclass ``cls`` from a YAML mapping, refusing unknown keys and bad types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{key or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{key}." if key else ""
        retired = RETIRED_KEYS.get(f"{where}{unknown[0]}")
        if retired:
            raise ConfigError(f"{where}{unknown[0]}: {retired}")
        raise ConfigError(f"{where}{unknown[0]}: unknown key (known: {', '.join(sorted(names))})")
    values = {}
    for name, raw in data.items():
        values[name] = _convert(hints[name], raw, f"{key}.{name}" if key else name)
    try:
        return cls(**values)
    except ConfigError:
        raise
    except ValueError as exc:  # the dataclass's own checks (e.g. UrgencyWeights)
        raise ConfigError(f"{key or 'config'}: {exc}") from None


def _convert(hint: Any, raw: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, raw, key)
    origin = typing.get_origin(hint)
    if origin is tuple:  # tuple[X, ...]
        (item,) = typing.get_args(hint)[:1]
        if not isinstance(raw, list):
            raise ConfigError(f"{key}: expected a list, got {type(raw).__name__}")
        return tuple(_convert(item, v, f"{key}[{i}]") for i, v in enumerate(raw))
    if origin in (types.UnionType, typing.Union):
        raise TypeError(f"{key}: union fields are not supported in the schema")
    if hint is bool:
        if not isinstance(raw, bool):
            raise ConfigError(f"{key}: expected true or false, got {_quote(raw)}")
        return raw
    if hint is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ConfigError(f"{key}: expected an integer, got {_quote(raw)}")
        return raw
    if hint is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {_quote(raw)}")
        if not math.isfinite(raw):  # .nan / .inf: a NaN compares false with every bound
            raise ConfigError(f"{key}: must be a finite number, got {_quote(raw)}")
        return float(raw)
    if hint is str:
        if not isinstance(raw, str):
            raise ConfigError(f"{key}: expected a string, got {_quote(raw)}")
        return raw
    raise TypeError(f"{key}: unsupported schema type {hint}")


def _check(obj: Any, key: str = "") -> None:
    """Range and choice checks on a built config, naming the offending key."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        path = f"{key}.{f.name}" if key else f.name
        if f.name in _SELF_CHECKED:
            continue
        if dataclasses.is_dataclass(value):
            _check(value, path)
        elif isinstance(value, tuple) and f.name in _LISTS:
            _check_list(f.name, value, path)
        elif isinstance(value, tuple) and f.name in _FOLDERS:
            _check_folders(value, path)
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                _check(item, f"{path}[{i}]")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if value < 0 or (value == 0 and f.name not in _MAY_BE_ZERO):
                raise ConfigError(f"{path}: must be {'>= 0' if f.name in _MAY_BE_ZERO else '> 0'}, got {value}")
            bound = _upper_bound(f.name, value)
            if bound is not None and value > bound:
                raise ConfigError(f"{path}: must be <= {bound}, got {value}")
            floor = _MIN_BY_NAME.get(f.name)
            if floor is not None and 0 < value < floor:
                raise ConfigError(f"{path}: must be >= {floor}{' (or 0)' if f.name in _MAY_BE_ZERO else ''}, got {value}")
        choices = _CHOICES.get(path)
        if choices and value not in choices:
            raise ConfigError(f"{path}: must be one of {', '.join(choices)}, got {_quote(value)}")
        if f.name == "address" and value:
            host, sep, port = str(value).rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"{path}: expected HOST:PORT, got {_quote(value)}")


def _check_list(name: str, value: tuple, path: str) -> None:
    if not value:
        raise ConfigError(f"{path}: must not be empty")
    if name == "batch_buckets":
        if any(v <= 0 for v in value) or list(value) != sorted(set(value)):
            raise ConfigError(f"{path}: must be positive and strictly ascending, got {list(value)}")
    elif name == "stream_priorities":
        if any(v > 0 for v in value) or len(set(value)) != len(value):
            raise ConfigError(f"{path}: must be distinct CUDA stream priorities <= 0, got {list(value)}")


def _check_folders(value: tuple, path: str) -> None:
    """Each entry a folder holding its file (``_FOLDERS``), no folder twice;
    what is inside is checked where it is loaded (search.games: the search
    service's start)."""
    seen: dict[Path, int] = {}
    for i, folder in enumerate(value):
        where = f"{path}[{i}]"
        if not folder:
            raise ConfigError(f"{where}: must be a folder path, got an empty string")
        resolved = resolve_path(folder).resolve()
        name = _FOLDERS[path.rpartition(".")[2]]
        if not (resolved / name).is_file():
            why = "no such folder" if not resolved.is_dir() else f"the folder has no {name}"
            raise ConfigError(f"{where}: {folder}: {why}")
        if resolved in seen:
            raise ConfigError(f"{where}: {folder} is also {path}[{seen[resolved]}]")
        seen[resolved] = i


BULK_SERVER = "reward_bulk"  # the bulk server's name as a process (tandem serve reward_bulk)


def _check_endpoints(cfg: TandemConfig) -> None:
    """Every server of one ``tandem up`` on a port of its own (gRPC and
    metrics), named by its config key. Two listeners on one port clash where
    their hosts are one, or either is every interface (``0.0.0.0``, ``[::]``),
    or one is ``localhost`` (which gRPC binds on 127.0.0.1 and [::1]) and the
    other a loopback address."""
    seen: list[tuple[str, int, str]] = []  # (host, port, config key)
    for name, (address, metrics_port) in endpoints(cfg).items():
        key = endpoint_key(name)
        host, _, grpc_port = address.rpartition(":")
        for field_key, port in ((f"{key}.address", int(grpc_port)), (f"{key}.metrics_port", metrics_port)):
            if not port:
                continue
            for other_host, other_port, other_key in seen:
                if port == other_port and _same_interface(host, other_host):
                    shown = "" if host == other_host else f" ({other_host}:{other_port})"
                    raise ConfigError(f"{field_key}: {host}:{port} is also {other_key}{shown}")
            seen.append((host, port, field_key))


def _check_value_model_address(cfg: TandemConfig) -> None:
    """``search.reward_address`` is not the bulk server: the value model's
    leaves are critical requests, which it refuses (FAILED_PRECONDITION)."""
    if cfg.reward.bulk_server.enabled and cfg.search.reward_address == cfg.reward.bulk_server.address:
        raise ConfigError(f"search.reward_address: {cfg.search.reward_address} is the reward service's bulk server "
                          f"(reward.bulk_server), which refuses the value model's critical requests; name the "
                          f"reward service ({cfg.reward.address}) or leave it empty")


def _check_workers(cfg: TandemConfig) -> None:
    """Co-located mode is one process (reward and search together): no workers."""
    for key, count in (("search.workers", cfg.search.workers), ("reward.workers", cfg.reward.workers)):
        if cfg.co_located and count > 1:
            raise ConfigError(f"{key}: {count} with co_located: true, which serves reward and search from one "
                              f"process; set it to 1, or co_located to false")


_EVERY_INTERFACE = ("0.0.0.0", "[::]", "[::0]")
_LOOPBACK = ("localhost", "127.0.0.1", "[::1]")  # localhost: gRPC binds both of the others


def _same_interface(a: str, b: str) -> bool:
    """Do listeners on hosts ``a`` and ``b`` (as in HOST:PORT) take one port of this host?"""
    a, b = a.lower(), b.lower()
    return (a == b or a in _EVERY_INTERFACE or b in _EVERY_INTERFACE
            or (a in _LOOPBACK and b in _LOOPBACK and "localhost" in (a, b)))


def endpoint_key(name: str) -> str:
    """The config section of :func:`endpoints` server ``name`` (``reward.bulk_server`` for the bulk server)."""
    return "reward.bulk_server" if name == BULK_SERVER else name


def endpoints(cfg: TandemConfig) -> dict[str, tuple[str, int]]:
    """Server name (``tandem serve`` NAME, config section for all but
    ``reward_bulk``) -> (gRPC address, metrics port; 0 = none), for every
    server this config runs: the scheduler, the reward service, its bulk
    server where ``reward.bulk_server.enabled``, and the search service."""
    out = {name: (getattr(cfg, name).address, getattr(cfg, name).metrics_port) for name in ("scheduler", "reward")}
    if cfg.reward.bulk_server.enabled:
        out[BULK_SERVER] = (cfg.reward.bulk_server.address, cfg.reward.bulk_server.metrics_port)
    out["search"] = (cfg.search.address, cfg.search.metrics_port)
    return out


def loopback_data(port: Callable[[], int], metrics: bool = False, bulk_server: bool = True,
                  sections: dict[str, dict] | None = None) -> dict:
    """Config data (a YAML mapping) putting every server of one stack on a
    loopback port that ``port()`` picks: the three servers and the reward
    service's bulk server (``reward.bulk_server.enabled`` = ``bulk_server``);
    metrics ports from ``port()`` too with ``metrics``, else none; then
    ``sections`` merged in, field by field per section (e.g.
    ``{"search": {"backend": "cpu"}}``). For stacks beside others on one host:
    tests, load tests, benchmarks."""
    def where() -> dict:
        return {"address": f"127.0.0.1:{port()}", "metrics_port": port() if metrics else 0}

    data = {name: where() for name in ("scheduler", "reward", "search")}
    data["reward"]["bulk_server"] = {**where(), "enabled": bulk_server}
    for name, fields in (sections or {}).items():
        data.setdefault(name, {}).update(fields)
    return data


def bulk_address(cfg: TandemConfig) -> str:
    """Where bulk clients (trainers) send their work: the bulk server where
    ``reward.bulk_server.enabled``, else the reward service."""
    return cfg.reward.bulk_server.address if cfg.reward.bulk_server.enabled else cfg.reward.address


def _check_models(cfg: TandemConfig) -> None:
    if not cfg.reward.models:
        raise ConfigError("reward.models: at least one model is needed")
    seen = set()
    for i, model in enumerate(cfg.reward.models):
        if not model.name:
            raise ConfigError(f"reward.models[{i}].name: must not be empty")
        if model.name in seen:
            raise ConfigError(f"reward.models[{i}].name: duplicate model name {model.name!r}")
        seen.add(model.name)
        if model.precision not in PRECISIONS:
            raise ConfigError(f"reward.models[{i}].precision: must be one of {', '.join(PRECISIONS)}, "
                              f"got {model.precision!r}")
        if not resolve_path(model.path).is_file():
            raise ConfigError(f"reward.models[{i}].path: file not found: {resolve_path(model.path)}")
        if model.fuse_conv_bias and not model.prefer_nhwc:
            raise ConfigError(f"reward.models[{i}].fuse_conv_bias: needs prefer_nhwc (cuDNN has no fused-bias "
                              "plan for these convolutions in NCHW)")
    tls = cfg.tls
    if bool(tls.cert_path) != bool(tls.key_path):
        raise ConfigError("tls: cert_path and key_path must be set together")
    if tls.client_ca_path and not tls.cert_path:
        raise ConfigError("tls.client_ca_path: mutual TLS needs tls.cert_path and tls.key_path")
    if bool(tls.client_cert_path) != bool(tls.client_key_path):
        raise ConfigError("tls: client_cert_path and client_key_path must be set together")
    for name in ("ca_path", "client_cert_path"):
        if getattr(tls, name) and not tls.cert_path:
            raise ConfigError(f"tls.{name}: client TLS settings need tls.cert_path and tls.key_path (TLS on)")
    for name in ("cert_path", "key_path", "client_ca_path", "ca_path", "client_cert_path", "client_key_path"):
        path = getattr(tls, name)
        if path and not resolve_path(path).is_file():
            raise ConfigError(f"tls.{name}: file not found: {resolve_path(path)}")


def resolve_path(path: str) -> Path:
    """Absolute path for a config path: a relative one under one of tandem's packages
    (first part ``reward_service``, ``tandem``, ...; :data:`tandem.paths.PACKAGES`)
    is that package's file, read through importlib.resources; any other relative
    one is from the working directory."""
    p = Path(path)
    if p.is_absolute():
        return p
    if p.parts and p.parts[0] in PACKAGES:
        return package_path(p.parts[0], *p.parts[1:])
    return Path.cwd() / p


def parse_config(data: Any) -> TandemConfig:
    """Validates a parsed YAML document.

    Raises:
        ConfigError: unknown key, wrong type, value out of range or missing file.
    """
    cfg = _build(TandemConfig, data, "")
    _check(cfg)
    _check_models(cfg)
    _check_endpoints(cfg)
    _check_value_model_address(cfg)
    _check_workers(cfg)
    return cfg


MAX_CONFIG_BYTES = 1 << 20  # a config file is a few KiB; more is not one (e.g. --config /dev/zero)
MAX_NESTING = 32  # mappings and lists inside each other; the schema needs 4


class _NoAliasLoader(yaml.SafeLoader):
    """PyYAML's safe loader with anchors and aliases refused (an alias is
    expanded into a new copy wherever it is used, so nine nested aliases in a
    few hundred bytes -- "billion laughs" -- become billions of nodes), a key
    given twice in one mapping refused (the last would silently win: a second
    ``auth_token: ""`` would turn authentication off), and nesting deeper than
    MAX_NESTING refused before the composer recurses into it."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.YAMLError(f"line {mark.line + 1}: YAML aliases (*name) are not allowed in the config")
        if self.check_event(yaml.MappingStartEvent, yaml.SequenceStartEvent):
            self._depth = getattr(self, "_depth", 0) + 1
            try:
                if self._depth > MAX_NESTING:
                    mark = self.peek_event().start_mark
                    raise yaml.YAMLError(f"line {mark.line + 1}: nested deeper than {MAX_NESTING} levels")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                continue  # an unhashable key: the schema refuses it by name later
            if key in seen:
                raise yaml.YAMLError(f"line {key_node.start_mark.line + 1}: {key}: the key is given twice")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _parse_yaml(text: str) -> Any:
    """The YAML document in ``text``, aliases refused (raises yaml.YAMLError)."""
    loader = _NoAliasLoader(text)  # a SafeLoader: plain data only, no Python objects
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _quote(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: messages never echo a large value."""
    text = repr(value)  # aliases are refused, so a value is never larger than the file
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(exc: Exception, limit: int = 200) -> str:
    """The first line of an error message, at most ``limit`` characters."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_yaml(path: str | Path) -> Any:
    """The YAML document in the file at ``path``, read with the config's
    checks (tandem.yaml's, and game folders' game.yaml).

    Raises:
        ConfigError: the file cannot be read, is larger than MAX_CONFIG_BYTES,
            is not UTF-8 YAML, uses YAML aliases (refused: their expansion is
            unbounded), gives a key twice or nests deeper than MAX_NESTING.
            The message is one line naming the file (and the line and key).
    """
    try:
        with open(path, "rb") as f:  # bounded: a device or a huge file is not read to its end
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes, not a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    try:
        return _parse_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {_one_line(exc)}") from None


def load_config(path: str | Path | None = None) -> TandemConfig:
    """Loads and validates the YAML file at ``path`` (default: the bundled
    ``tandem/bundled/tandem.yaml``, which is ``deploy/config/tandem.yaml``).

    Raises:
        ConfigError: the file is missing or not read by :func:`load_yaml`
            (too large, not UTF-8 YAML, aliases, a key given twice, too deep),
            or fails validation. The message is one line naming the file and
            the key (or line).
    """
    path = Path(path) if path else DEFAULT_CONFIG
    data = load_yaml(path)
    try:
        return parse_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None

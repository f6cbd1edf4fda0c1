"""tandem: real-time decision service for game AI (command line).

  tandem up [--config PATH]          the servers as processes (and the bulk server), until Ctrl-C / SIGTERM
  tandem serve NAME [--config PATH]  one server (scheduler | reward | reward_bulk | search) in the foreground
  tandem status [--config PATH]      what the scheduler knows, and each server's health
  tandem health HOST:PORT            exit 0 when the server reports SERVING (container probes)
  tandem play [...]                  the sample game engine against a running stack
  tandem demo [...]                  up + play on the bundled positions + report + stop
  tandem convert-fp16 MODEL.onnx     FP16 model with an FP32 last layer, + latency/accuracy report
  tandem check-game FOLDER           a game plug-in's rules against themselves and OpenSpiel

Exit codes: 0 done (up: stopped on request, every server cleanly); 1 failed (a
server could not start, did not stop cleanly or was crash-looping under
--on-crash-loop stop, a service is unreachable, a frame went unanswered); 2 a bad argument or config (one line on stderr); 130
interrupted by Ctrl-C (up: Ctrl-C is how it stops, 0).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path

import grpc

from stack import interrupt
from tandem.config import BULK_SERVER, ConfigError, TandemConfig, endpoints, load_config
from tandem.engine_client import address_type

SERVE = {  # tandem serve NAME -> (module, its function that serves until SIGINT/SIGTERM)
    "scheduler": ("scheduler.main", "serve"),
    "reward": ("reward_service.server", "serve"),
    BULK_SERVER: ("reward_service.server", "serve_bulk"),  # the reward service's bulk server (reward.bulk_server)
    "search": ("search_service.server", "serve"),
    "co_located": ("stack.colocated", "serve"),  # reward + search in one process (co_located: true)
}


class BadArgument(RuntimeError):
    """A command-line argument that cannot work (one line on stderr; exit 2)."""


def _config(args) -> TandemConfig:
    return load_config(args.config)


def cmd_serve(args) -> int:
    import importlib

    from tandem import multiprocess_metrics

    cfg = _config(args)
    # Several workers: prometheus-client's multiprocess mode in every one, chosen when it is first
    # imported (stack.supervisor imports it): the directory is set before, and removed at the end.
    metrics_dir = multiprocess_metrics.begin(_workers(cfg, args.name))
    try:
        from stack.supervisor import die_with_supervisor, mps_env

        die_with_supervisor()
        os.environ.update(mps_env(cfg))  # before any CUDA context: the MPS directories the scheduler uses
        module, function = SERVE[args.name]
        getattr(importlib.import_module(module), function)(cfg)
    finally:
        multiprocess_metrics.end(metrics_dir)
    return 0


def _workers(cfg: TandemConfig, name: str) -> int:
    """The processes server ``name`` runs as (tandem/workers.py)."""
    return {"search": cfg.search.workers, "reward": cfg.reward.workers}.get(name, 1)


def _print_endpoints(cfg: TandemConfig) -> None:
    for name, (address, metrics_port) in endpoints(cfg).items():
        metrics = f"  metrics http://127.0.0.1:{metrics_port}/metrics" if metrics_port else ""
        print(f"  {name:<11} {address:<22} SERVING{metrics}", flush=True)


def cmd_up(args) -> int:
    from stack.compute import describe as describe_compute
    from stack.restarts import RestartPolicy
    from stack.supervisor import Stack, run_until_signalled

    cfg = _config(args)
    print(describe_compute(cfg), flush=True)
    policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window_s,
                           max_delay_s=args.max_restart_delay_s, give_up=args.on_crash_loop == "stop")
    stack = Stack(cfg, args.config, log_dir=args.log_dir)
    stack.start()
    print("tandem is up:", flush=True)
    _print_endpoints(cfg)
    return run_until_signalled(stack, policy)


def cmd_status(args) -> int:
    from stack.status import print_status

    return print_status(_config(args))


def cmd_doctor(args) -> int:
    from stack import doctor

    return doctor.print_findings(doctor.run(_config(args), deep=args.deep))


def cmd_health(args) -> int:
    from tandem.server import health_status

    host, _, port = args.address.rpartition(":")
    if not host or not port.isdigit():
        print(f"tandem health: expected HOST:PORT, got {args.address!r}", file=sys.stderr)
        return 2
    cfg = load_config(args.config) if args.config else None
    status = health_status(args.address, cfg, args.service, timeout_s=args.timeout_s)
    print(status)
    return 0 if status == "SERVING" else 1


def _play_options(args, cfg: TandemConfig):
    """Raises BadArgument: ``--game`` is not a game of the config, or a ``--positions`` set that cannot be read."""
    from stack.play import PlayOptions, game_positions_file

    if args.game == PlayOptions.game:
        for name in args.positions or ():
            _check_position_set(name)
        sets = tuple(args.positions) if args.positions else PlayOptions.position_sets
    else:
        try:
            default = Path(game_positions_file(cfg.search.games, args.game))
        except RuntimeError as exc:
            raise BadArgument(str(exc)) from None
        sets = tuple(_game_set(default.parent, args.game, name) for name in args.positions or (default.name,))
    return PlayOptions(
        search_address=args.search or cfg.search.address,
        reward_address=args.reward or cfg.reward.address,
        frames=args.frames,
        fps=args.fps,
        game=args.game,
        position_sets=sets,
        simulations=args.simulations,
        evaluator=args.evaluator,
        agents=args.agents,
        model=cfg.search.value_model,
        seed=args.seed,
        late_answers=args.late_answers,
        start_at=args.start_at,
    )


def _check_reachable(opts, cfg: TandemConfig) -> None:
    """Raises RuntimeError naming every service that ``tandem play`` needs and that is not SERVING."""
    from tandem.server import health_status

    down = [f"{name} service at {address}: {status}"
            for name, address in (("search", opts.search_address), ("reward", opts.reward_address))
            if (status := health_status(address, cfg, timeout_s=2.0)) != "SERVING"]
    if down:
        raise RuntimeError(f"cannot play: {'; '.join(down)} (is tandem up running?)")


def _run_play(args, cfg: TandemConfig) -> int:
    from stack.play import play, print_report, write_report

    opts = _play_options(args, cfg)
    _check_reachable(opts, cfg)
    report = play(opts, cfg)
    print_report(report)
    if args.report:
        write_report(report, args.report)
        print(f"{'partial report' if report['interrupted'] else 'report'} written to {args.report}")
    if report["interrupted"]:
        print(f"tandem {args.command}: interrupted after {report['frames']} of {opts.frames} frames",
              file=sys.stderr, flush=True)
        return interrupt.EXIT_INTERRUPTED
    # A call that reached its frame's end (DEADLINE_EXCEEDED) is a missed frame, like a late answer; any
    # other failure (a refusal included: RESOURCE_EXHAUSTED says a limit, of load or of the config) is the
    # stack's, and the report prints its reason.
    failed = sum(n for code, n in report["errors"].items() if code != "DEADLINE_EXCEEDED")
    return 0 if not failed else 1


def cmd_play(args) -> int:
    return _run_play(args, _config(args))


def cmd_demo(args) -> int:
    from stack.compute import describe as describe_compute
    from stack.supervisor import Stack

    cfg = _config(args)
    print(describe_compute(cfg), flush=True)
    started = time.perf_counter()
    stack = Stack(cfg, args.config, log_dir=args.log_dir)
    stack.start()
    try:
        print(f"tandem is up ({time.perf_counter() - started:.1f} s):", flush=True)
        _print_endpoints(cfg)
        status = _run_play(args, cfg)
    finally:
        print("stopping the servers", flush=True)
        codes = stack.stop()
        print("stopped: " + ", ".join(f"{n} exit {c}" for n, c in codes.items()), flush=True)
    return status or int(any(codes.values()))


def cmd_convert_fp16(args) -> int:
    try:
        import onnxconverter_common  # noqa: F401  (the conversion imports it on first use: ask up front)

        from training import fp16_report
    except ImportError as exc:
        print(f"tandem convert-fp16 needs the fp16 extra: pip install 'tandem[fp16]' "
              f"(in a checkout: pip install -e '.[fp16]'); {exc}", file=sys.stderr)
        return 2

    return fp16_report.main(args)


def _number(kind: type, low: float, strict: bool = True):
    """An argparse type: a finite ``kind`` above ``low`` (at least ``low`` when not ``strict``)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not math.isfinite(value) or (value <= low if strict else value < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text!r}")
        return value
    return parse


def _check_position_set(text: str) -> None:
    """Raises BadArgument unless ``text`` is a bundled Connect Four set's name or a readable JSONL file of
    labelled positions."""
    from tandem.positions import PONS_DIR, load_set

    try:
        if not load_set(text):
            raise ValueError("no positions in it")
    except FileNotFoundError:
        names = ", ".join(sorted(p.stem for p in PONS_DIR.glob("*.jsonl")))
        raise BadArgument(f"argument --positions: no position set or file {text[:200]!r} (bundled sets: {names})") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise BadArgument(f"argument --positions: {text[:200]!r}: {exc}") from None


def _game_set(folder: Path, game: str, text: str) -> str:
    """The path of another game's position set: a file of its folder (``endgames.jsonl``) or a path.

    Raises:
        BadArgument: no such file, or not a position set (the line named).
    """
    from search_service.games.positions import read_records

    path = folder / text if (folder / text).is_file() else Path(text)
    try:
        if not read_records(path):
            raise ValueError("no positions in it")
    except FileNotFoundError:
        files = ", ".join(sorted(p.name for p in folder.glob("*.jsonl")))
        raise BadArgument(f"argument --positions: no file {text[:200]!r} in game {game}'s folder nor at that path "
                          f"(its sets: {files})") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise BadArgument(f"argument --positions: {str(exc)[:300]}") from None
    return str(path)


_PORT_WORDS = ("port", "address", "host")  # in an unknown option: the user looks for where ports are set


class _Parser(argparse.ArgumentParser):
    """Bad arguments get one line on stderr (no usage block) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        # argparse reports an unknown option before the command as "the following arguments are
        # required: command", which hides the typo: name it first.
        argv = sys.argv[1:] if args is None else list(args)
        if self._subparsers is not None:
            for token in argv:
                if not token.startswith("-"):
                    break
                name = token.split("=", 1)[0]
                if not any(o == name or (name.startswith("--") and o.startswith(name))
                           for o in self._option_string_actions):
                    self.error(f"unrecognized argument {token!r} before the command")
        return super().parse_known_args(argv, namespace)

    def parse_args(self, args=None, namespace=None):
        # argparse names unknown arguments after the command from the top parser ("see tandem
        # --help"): point at the command's own help, where its options are.
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = getattr(parsed, "command", None)
            where = f"{self.prog} {command}" if command else self.prog
            about_ports = any(word in t.lower() for t in extra if t.startswith("-") for word in _PORT_WORDS)
            hint = "; ports are set in the config (--config)" if about_ports else ""
            self.exit(2, f"{self.prog}: unrecognized arguments: {' '.join(extra)}{hint} (see {where} --help)\n")
        return parsed


def _add_play_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--frames", type=_number(int, 0), default=600, help="frames to play (default 600)")
    p.add_argument("--fps", type=_number(float, 0), default=60.0, help="target frame rate (default 60)")
    p.add_argument("--game", default="connect4",
                   help="the game to play (default connect4): another of the config's search.games plays its "
                        "folder's position set, searches only (no value model)")
    p.add_argument("--positions", action="append",
                   help="Connect Four: a bundled position set's name or a JSONL path; another game: a file of "
                        "its folder (endgames.jsonl: labelled by an exact solver) or a path (repeatable)")
    p.add_argument("--simulations", type=_number(int, 0, strict=False), default=0,
                   help="simulations per search; 0 = frame deadline only")
    p.add_argument("--evaluator", choices=("auto", "rollout", "value_model"), default="auto",
                   help="leaf evaluation: random rollouts, or the value model on the reward service; auto "
                        "(default): the search service's search.evaluator, whose auto is the value model on a "
                        "GPU and rollouts on the CPU (the report's backends say which ran)")
    p.add_argument("--agents", type=_number(int, 0), default=1,
                   help="agents of this engine: each frame searches this many positions, in one SearchBatch "
                        "call where more than one (at most the search service's search.max_batch_searches; "
                        "default 1: one Search)")
    p.add_argument("--seed", type=int, default=1, help="seed of the position order and the searches (default 1)")
    p.add_argument("--late-answers", action="store_true",
                   help="wait up to ten frames for each answer, to see how late they come (default: each "
                        "call's gRPC deadline is the frame's end, as an engine sets it)")
    p.add_argument("--start-at", type=_number(float, 0), default=None, metavar="UNIX_S",
                   help="begin the first frame at this Unix time (s), so engines started together play in "
                        "step after their start-up (default: at once)")
    p.add_argument("--report", help="write the report as JSON here")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="tandem", description=__doc__.split("\n\n")[0])
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    ap.add_argument("--version", action="version", version=f"tandem {_version()}", help="print the version and exit")
    sub = ap.add_subparsers(dest="command", required=True, help="what to do (`tandem COMMAND --help` for its options)")

    def command(name, fn, help):
        p = sub.add_parser(name, help=help)
        p.add_argument("--config", help="YAML config (default: the bundled one, deploy/config/tandem.yaml)")
        p.set_defaults(fn=fn)
        return p

    p = command("serve", cmd_serve, "run one server in the foreground")
    p.add_argument("name", choices=sorted(SERVE), help="which server: " + ", ".join(sorted(SERVE)))
    p = command("up", cmd_up, "start scheduler, reward and search services")
    p.add_argument("--log-dir", type=Path, help="write each server's log here")
    p.add_argument("--max-restarts", type=_number(int, 0, strict=False), default=5,
                   help="restarts of one server in a row, each run shorter than --restart-window-s, after which "
                        "it is crash-looping (default 5)")
    p.add_argument("--restart-window-s", type=_number(float, 0), default=60.0,
                   help="a server that runs this long (s) is no longer restarting in a row (default 60)")
    p.add_argument("--max-restart-delay-s", type=_number(float, 0.5, strict=False), default=60.0,
                   help="the restart delay (0.5 s, doubling with each restart in a row) is at most this (s; "
                        "default 60)")
    p.add_argument("--on-crash-loop", choices=("restart", "stop"), default="restart",
                   help="a crash-looping server: restart it on at the capped delay while the others serve "
                        "(default), or stop all and exit 1")
    command("status", cmd_status, "print what the scheduler knows")
    p = command("doctor", cmd_doctor, "check this host for MPS, priorities, memory, copies, clocks; print fixes")
    p.add_argument("--deep", action="store_true", help="also time priorities across two processes (GPU, ~10 s)")
    p = command("health", cmd_health, "check one server's gRPC health")
    p.add_argument("address", help="HOST:PORT")
    p.add_argument("--service", default="", help="service name (default: the whole server)")
    p.add_argument("--timeout-s", type=_number(float, 0), default=2.0, help="seconds to wait for the answer (default 2)")
    p = command("play", cmd_play, "the sample game engine, against a running stack")
    p.add_argument("--search", type=address_type("search service", "127.0.0.1:50052"),
                   help="search service HOST:PORT (default: the config's search.address)")
    p.add_argument("--reward", type=address_type("reward service", "127.0.0.1:50051"),
                   help="reward service HOST:PORT (default: the config's reward.address)")
    _add_play_args(p)
    p = command("demo", cmd_demo, "up, play on the bundled positions, report, stop")
    p.add_argument("--log-dir", type=Path, default=None, help="write each server's log here (default: this terminal)")
    p.set_defaults(search=None, reward=None)
    _add_play_args(p)
    p = sub.add_parser("convert-fp16", help="write an FP16 model whose last layer and outputs stay FP32, and report")
    p.add_argument("model", help="FP32 ONNX model")
    p.add_argument("--out", help="output path (default MODEL.fp16.onnx beside it)")
    p.add_argument("--report", help="also write the latency/accuracy report as JSON here")
    p.add_argument("--limit", type=_number(int, 0), help="held-out positions per set (default all)")
    p.add_argument("--repeats", type=_number(int, 0), default=20, help="timed runs per batch size (default 20)")
    p.add_argument("--no-report", action="store_true", help="convert only")
    p.set_defaults(fn=cmd_convert_fp16)
    from search_service.games import conformance

    p = sub.add_parser("check-game", help="check a game folder's rules against themselves and OpenSpiel")
    conformance.add_arguments(p)
    p.set_defaults(fn=lambda args, p=p: conformance.run(p, args))
    return ap


def main(argv: list[str] | None = None) -> int:
    interrupt.install()
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"tandem: config error: {exc}", file=sys.stderr)
        return 2
    except BadArgument as exc:
        print(f"tandem {args.command}: {exc} (see tandem {args.command} --help)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tandem {args.command}: interrupted", file=sys.stderr, flush=True)
        return interrupt.EXIT_INTERRUPTED
    except RuntimeError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"tandem: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `tandem status | head`
        return 0

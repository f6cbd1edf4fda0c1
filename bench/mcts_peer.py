"""mcts_peer: tandem against mctx (DeepMind's MCTS in JAX) on the same GPU.

The peer: ``mctx.muzero_policy`` (``--policy gumbel``: ``gumbel_muzero_policy``)
on pgx's Connect Four (``pgx.make("connect_four")``), every tree rooted at the
empty board, ``--simulations`` (1000) simulations per tree, one tree and a
batch of ``--batch`` (1024) trees. The recurrent function steps the pgx state
(reward for the player who moved, discount -1 between the two players, 0 once
the game ended) and gives the new state's value, from one of two evaluators:

* ``zero``: value 0, uniform priors over legal moves (the search alone);
* ``rollout``: one uniformly random playout to the end of the game from the
  new state, written here in JAX over pgx's ``step`` (+1 / 0 / -1 for the side
  to move there); the root's value comes from a rollout too. Two loops, both
  measured (``--rollout-loops``): ``while`` stops once every playout of the
  batch has ended (a data-dependent ``lax.while_loop``: its condition is
  tested after every ply), ``fixed`` always runs 42 plies (a static trip
  count, finished games left as they are: more work, no test).

The whole search is one ``jax.jit``-compiled function of a PRNG key; it is
compiled ahead (``lower().compile()``) and run once before timing, then timed
``--repeats`` times (``--batch-repeats`` for the batch) with a fresh key each,
``block_until_ready`` on its outputs.

tandem's rows use the same sizes through ``backend.search``: ``rollout`` is its
in-kernel random rollouts (UCT); ``zero`` is its value-model path (PUCT) with a
host evaluator returning zeros, called once per wave. tandem runs
``--parallel-sims`` simulations in flight per tree (mctx runs one per tree per
step: its rows say parallel_sims 1).

Units: ``latency_ms_p50`` is the median wall-clock ms of one search call
(all trees); ``sims_per_s`` = trees x simulations / that median.

Row fields: system (``tandem``, ``mctx``), trees, simulations, evaluator,
latency_ms_p50, sims_per_s, plus variant (tandem's backend variant, or the mctx
policy), parallel_sims, latency_ms_p99, repeats, and for mctx compile_s (the
ahead-of-time compilation, s).

Reference (an H200, 2026-11-30): mctx, 1000 simulations of one tree, 224 ms
(zero) / 269 ms (rollout); 1024 trees, 0.60 M (zero) / 0.26 M (rollout) sims/s.

Command (full): ``python3 -m bench.mcts_peer`` (mctx and pgx must be
installed; on the GPU machine bench/run_gpu.sh installs the carried wheels)
Smoke test:     ``python3 -m bench.mcts_peer --quick`` (JAX on the CPU)
"""
from __future__ import annotations

import os
import sys
import time

from bench import common
from stack.stats import percentiles

BENCHMARK = "mcts_peer"
EVALUATORS = ("zero", "rollout")
MAX_PLIES = 42  # a Connect Four game's length at most
ROLLOUT_LOOPS = ("while", "fixed")


# -- mctx on pgx -----------------------------------------------------------------


def build_mctx_search(trees: int, simulations: int, evaluator: str, policy: str, rollout_loop: str = "while"):
    """A jitted function key -> (actions int32 [trees], root visit shares
    float32 [trees, 7]) running one mctx search of ``trees`` empty Connect Four
    boards. ``rollout_loop``: ``while`` plays until every playout of the batch
    has ended (a data-dependent ``lax.while_loop``); ``fixed`` always plays
    MAX_PLIES plies (``lax.fori_loop`` with a static trip count; pgx's step
    leaves a finished game as it is)."""
    import jax
    import jax.numpy as jnp
    import mctx
    import pgx

    env = pgx.make("connect_four")
    step = jax.vmap(env.step)
    rows = jnp.arange(trees)
    illegal_logit = jnp.finfo(jnp.float32).min

    def playout_value(state, key):
        """float32 [trees]: result of one random playout for each state's side to move."""
        me = state.current_player

        def unfinished(carry):
            return ~jnp.all(carry[0].terminated)

        def one_ply(carry):
            s, k, total = carry
            k, sub = jax.random.split(k)
            logits = jnp.where(s.legal_action_mask, 0.0, -jnp.inf)
            s = step(s, jax.random.categorical(sub, logits, axis=-1))
            return s, k, total + s.rewards[rows, me]  # rewards are 0 except at the last ply

        start = (state, key, jnp.zeros(trees, jnp.float32))
        if rollout_loop == "fixed":
            _, _, total = jax.lax.fori_loop(0, MAX_PLIES, lambda _, c: one_ply(c), start)
        else:
            _, _, total = jax.lax.while_loop(unfinished, one_ply, start)
        return total

    def value_of(state, key):
        if evaluator == "zero":
            return jnp.zeros(trees, jnp.float32)
        return jnp.where(state.terminated, 0.0, playout_value(state, key))

    def priors(state):
        return jnp.where(state.legal_action_mask, 0.0, illegal_logit)

    def recurrent_fn(params, key, action, state):
        del params
        mover = state.current_player
        nxt = step(state, action)
        out = mctx.RecurrentFnOutput(
            reward=nxt.rewards[rows, mover],
            discount=jnp.where(nxt.terminated, 0.0, -1.0).astype(jnp.float32),
            prior_logits=priors(nxt),
            value=value_of(nxt, key),
        )
        return out, nxt

    run_policy = mctx.gumbel_muzero_policy if policy == "gumbel" else mctx.muzero_policy

    @jax.jit
    def search(key):
        k_init, k_root, k_search = jax.random.split(key, 3)
        root_state = jax.vmap(env.init)(jax.random.split(k_init, trees))
        root = mctx.RootFnOutput(
            prior_logits=priors(root_state), value=value_of(root_state, k_root), embedding=root_state
        )
        out = run_policy(
            params=None,
            rng_key=k_search,
            root=root,
            recurrent_fn=recurrent_fn,
            num_simulations=simulations,
            invalid_actions=~root_state.legal_action_mask,
        )
        return out.action, out.action_weights

    return search


def measure_mctx(trees: int, simulations: int, evaluator: str, policy: str, rollout_loop: str, repeats: int) -> dict:
    import jax

    keys = jax.random.split(jax.random.PRNGKey(0), repeats + 1)
    t = time.perf_counter()
    search = build_mctx_search(trees, simulations, evaluator, policy, rollout_loop).lower(keys[0]).compile()
    compile_s = time.perf_counter() - t
    ms = common.time_calls(lambda i: jax.block_until_ready(search(keys[i])), repeats, warmup=1, sync=lambda: None)
    variant = f"mctx.{'gumbel_' if policy == 'gumbel' else ''}muzero_policy"
    if evaluator == "rollout":
        variant += f", {rollout_loop} rollout loop"
    row = _row("mctx", variant, trees, simulations, evaluator, 1, ms)
    return {**row, "compile_s": compile_s}


# -- tandem ------------------------------------------------------------------------


def measure_tandem(variant: str, trees: int, simulations: int, evaluator: str, k: int, repeats: int) -> dict | None:
    kind, leaf_eval = common.evaluator_setup(evaluator)
    params = common.search_params(simulations=simulations, parallel_sims=k, evaluator=kind, max_nodes=simulations + 1)
    if params is None:
        return None
    backend = common.make_backend(variant)
    roots = common.positions([""] * trees)
    ms = common.time_calls(lambda i: backend.search(roots, params, leaf_eval), repeats, warmup=1)
    return _row("tandem", variant, trees, simulations, evaluator, k, ms)


def _row(system: str, variant: str, trees: int, sims: int, evaluator: str, k: int, ms) -> dict:
    p50, p99 = percentiles(ms, 50, 99)
    return dict(
        system=system,
        variant=variant,
        trees=trees,
        simulations=sims,
        evaluator=evaluator,
        parallel_sims=k,
        latency_ms_p50=p50,
        latency_ms_p99=p99,
        sims_per_s=trees * sims / (p50 / 1e3),
        repeats=len(ms),
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.make_parser(__doc__)
    parser.add_argument("--systems", default="mctx,tandem", help="comma list of mctx, tandem")
    parser.add_argument("--simulations", type=int, default=None, help="per tree (default 1000; quick 16)")
    parser.add_argument("--batch", type=int, default=None, help="trees of the batch rows (default 1024; quick 4)")
    parser.add_argument("--evaluators", default=",".join(EVALUATORS), help="comma list of zero, rollout")
    parser.add_argument("--policy", choices=["muzero", "gumbel"], default="muzero", help="mctx policy")
    parser.add_argument("--rollout-loops", default=",".join(ROLLOUT_LOOPS), help="mctx rollout loops to measure: while, fixed")
    parser.add_argument("--parallel-sims", type=common.int_list, default=[1, 16], help="tandem's simulations in flight per tree")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per one-tree row (default 10; quick 2)")
    parser.add_argument("--batch-repeats", type=int, default=None, help="timed calls per batch row (default 5; quick 2)")
    parser.add_argument("--cpu-max-sims", type=int, default=1 << 18, help="largest trees x simulations per CPU-reference call")
    args = parser.parse_args(argv)
    q = args.quick
    sims = args.simulations or (16 if q else 1000)
    sizes = [1, args.batch or (4 if q else 1024)]
    repeats = {1: args.repeats or (2 if q else 10), sizes[1]: args.batch_repeats or (2 if q else 5)}
    evaluators = [e for e in args.evaluators.split(",") if e]
    systems = [s for s in args.systems.split(",") if s]
    loops = [x for x in args.rollout_loops.split(",") if x]
    if not set(loops) <= set(ROLLOUT_LOOPS) or not loops:
        parser.error(f"--rollout-loops: use one or more of {', '.join(ROLLOUT_LOOPS)}")
    rows = []

    if "mctx" in systems:
        # JAX must not take most of the GPU's memory at start (tandem's CuPy runs
        # in this process too); --quick keeps JAX on the CPU.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        if q:
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        try:
            import jax
            import mctx  # noqa: F401
            import pgx  # noqa: F401
        except ImportError as exc:
            common.note(f"mctx rows skipped: {exc} (pip install mctx pgx, or carry the wheels: bench/README.md)")
        else:
            print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})", flush=True)
            for trees in sizes:
                for ev in evaluators:
                    for loop in loops if ev == "rollout" else loops[:1]:
                        row = common.attempt(
                            f"mctx trees={trees} {ev} {loop}", measure_mctx, trees, sims, ev, args.policy, loop, repeats[trees]
                        )
                        if row is not None:
                            common.progress(row)
                            rows.append(row)

    if "tandem" in systems:
        for variant in common.chosen_variants(args.backend, q):
            for trees in sizes:
                if variant == common.CPU_VARIANT and trees * sims > args.cpu_max_sims:
                    common.note(f"{variant} trees={trees}: {trees * sims} simulations per call > --cpu-max-sims, skipped")
                    continue
                for ev in evaluators:
                    for k in args.parallel_sims:
                        row = common.attempt(
                            f"{variant} trees={trees} {ev} parallel_sims={k}", measure_tandem, variant, trees, sims, ev, k, repeats[trees]
                        )
                        if row is not None:
                            common.progress(row)
                            rows.append(row)

    common.finish(BENCHMARK, rows, args.out, ["system", "variant", "trees", "simulations", "evaluator", "parallel_sims", "latency_ms_p50", "sims_per_s"])
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])

"""tandem's benchmarks: each module measures one thing and writes
``bench/results/<benchmark>.json`` (format: ``bench/common.py``, docs/design.md,
"Benchmark results"). Run them from the repository root as modules, e.g.
``python3 -m bench.mcts_latency``; ``bench/README.md`` lists the commands."""

"""Load generation and reliability figures: ``loadtest.generator`` (an open-loop
load generator playing N game engines), ``loadtest.soak`` (a bounded soak of
a real ``tandem`` stack with memory and file-descriptor tracking),
``loadtest.reliability_figures`` (the schema of the figures the reliability
tests write to ``runs/reliability/``) and ``loadtest.reliability_report`` (the
markdown tables of ``docs/reliability.md`` from them)."""

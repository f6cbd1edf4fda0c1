"""Fuzzing harness for the request decoding of the three services (hypothesis-based).

``pytest tests/stack/fuzz`` runs every target for a share of ``TANDEM_FUZZ_SECONDS``
(default 20 s in all); ``python -m tests.stack.fuzz --seconds 600`` runs longer, by
itself. See ``tests/stack/fuzz/harness.py``.
"""

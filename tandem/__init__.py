"""tandem: real-time decision service for game AI on one GPU.

The gRPC contract's generated modules live beside their sources in
``protos/tandem/v1``; extending this package's path makes them importable as
``tandem.v1`` (the proto package name), which is also what the generated
modules themselves import.
"""
from pathlib import Path as _Path

__path__.append(str(_Path(__file__).resolve().parent.parent / "protos" / "tandem"))

"""tandem: real-time decision service for game AI on one GPU.

The gRPC contract's generated modules are ``tandem.v1`` (the proto package name,
which the generated modules import themselves too); in the checkout they are kept
beside their sources in ``protos/tandem/v1``, and ``tandem/v1`` links there.
"""

"""The scheduler daemon (one per GPU) and the client library the services use.

Modules, one job each:

* :mod:`scheduler.policy` -- urgency and the ``default`` / ``dynamic`` /
  ``static`` policies, as pure functions.
* :mod:`scheduler.leases` -- the lease table, watch mailboxes, the reaper.
* :mod:`tandem.device` -- what the GPU offers (priority range, memory, MPS).
* :mod:`scheduler.server` -- the ``tandem.v1.Scheduler`` gRPC servicer.
* :mod:`scheduler.main` -- ``serve(cfg)`` (blocking) and ``start(cfg)`` (tests).
* :mod:`tandem.scheduler_client` -- ``SchedulerClient``, used by both services.
"""

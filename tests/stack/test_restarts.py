"""``tandem up``'s restart policy: the delay doubles up to its cap, restarts
older than the window stop counting, and the budget runs out (in process: the
processes themselves are in test_supervision.py)."""
import pytest

from stack.restarts import ChildRecord, RestartPolicy


def test_delay_doubles_up_to_the_cap():
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=3.0)
    assert [policy.delay_s(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_budget_counts_restarts_within_the_window_only():
    policy = RestartPolicy(first_delay_s=1.0, max_restarts=2, window_s=60.0)
    child = ChildRecord(pid=10)
    assert child.exited(-9, now=0.0, policy=policy) == 1.0
    child.restarted(11, now=1.0)
    assert child.exited(-9, now=5.0, policy=policy) == 7.0  # second restart: twice the delay
    child.restarted(12, now=7.0)
    assert child.exited(1, now=8.0, policy=policy) is None  # a third within 60 s: given up
    assert (child.restarts, child.last_exit, child.pid) == (2, 1, 12)
    # Once the earlier restarts are more than a window old, the server may be restarted again.
    assert child.exited(-9, now=70.0, policy=policy) == 71.0
    assert child.as_json(now=70.5) == {"pid": 12, "restarts": 2, "last_exit": -9, "state": "restarting in 0.5 s"}


def test_no_restarts_at_all():
    assert ChildRecord(pid=1).exited(0, now=0.0, policy=RestartPolicy(max_restarts=0)) is None


@pytest.mark.parametrize("fields", [{"max_restarts": -1}, {"window_s": 0}])
def test_bad_policy_is_refused(fields):
    with pytest.raises(ValueError):
        RestartPolicy(**fields)

"""``tandem up``'s restart policy: the delay doubles with each restart in a
row up to its cap, a run that lasts the window ends the series, a server
restarted too often in a row is crash-looping and is restarted on (or, with
``give_up``, not), and a crash loop ends once the server runs the window (in
process: the processes themselves are in test_supervision.py)."""
import pytest

from stack.restarts import ChildRecord, RestartPolicy


def test_delay_doubles_up_to_the_cap():
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=3.0)
    assert [policy.delay_s(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert RestartPolicy().delay_s(10_000) == 60.0  # no overflow however long the loop


def test_restarts_in_a_row_count_runs_shorter_than_the_window():
    policy = RestartPolicy(first_delay_s=1.0, max_restarts=2, window_s=60.0)
    child = ChildRecord(pid=10, started=0.0)
    assert child.exited(-9, now=0.0, policy=policy) == 1.0
    child.restarted(11, now=1.0)
    assert child.exited(-9, now=5.0, policy=policy) == 7.0  # second restart in a row: twice the delay
    child.restarted(12, now=7.0)
    assert not child.crash_looping
    # A run that lasted the window ends the series: the next exit waits the first delay again.
    assert child.exited(1, now=67.0, policy=policy) == 68.0
    assert (child.restarts, child.last_exit, child.pid, child.crash_looping) == (2, 1, 12, False)


def test_a_crash_loop_is_restarted_on_at_a_growing_capped_delay_until_it_runs_the_window():
    policy = RestartPolicy(first_delay_s=1.0, max_delay_s=8.0, max_restarts=2, window_s=60.0)
    child, now, delays = ChildRecord(pid=1, started=0.0), 0.0, []
    for pid in range(2, 9):
        now += 0.5
        restart_at = child.exited(1, now=now, policy=policy)
        delays.append(restart_at - now)
        now = restart_at
        child.restarted(pid, now)
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    assert child.crash_looping and child.in_a_row == 7
    assert child.as_json(now)["state"] == "CRASH-LOOPING (7 restarts in a row), starting for 0.0 s"
    assert not child.settled(now + 59.0, policy)
    assert child.settled(now + 60.0, policy) and not child.crash_looping
    assert child.exited(1, now=now + 61.0, policy=policy) == now + 62.0  # a new series


def test_give_up_stops_at_the_crash_loop():
    policy = RestartPolicy(max_restarts=1, give_up=True)
    child = ChildRecord(pid=1)
    assert child.exited(1, now=0.0, policy=policy) == 0.5
    child.restarted(2, now=0.5)
    assert child.exited(1, now=1.0, policy=policy) is None and child.crash_looping
    assert ChildRecord(pid=1).exited(0, now=0.0, policy=RestartPolicy(max_restarts=0, give_up=True)) is None


@pytest.mark.parametrize("fields", [{"max_restarts": -1}, {"window_s": 0}, {"first_delay_s": 0},
                                    {"first_delay_s": 2.0, "max_delay_s": 1.0}])
def test_bad_policy_is_refused(fields):
    with pytest.raises(ValueError):
        RestartPolicy(**fields)


def test_a_restarted_server_is_starting_with_its_last_line_until_it_serves():
    child = ChildRecord(pid=10, started=0.0)
    assert child.as_json(1.0)["state"] == "running" and not child.as_json(1.0)["starting"]
    child.exited(-9, 5.0, RestartPolicy())
    child.restarted(11, 6.0)
    child.last_line = "start-up: model connect4_value: sessions ..."
    record = child.as_json(8.5)
    assert record["state"] == "starting for 2.5 s" and record["starting"]
    assert record["last_line"].startswith("start-up: ")
    child.serving = True
    assert child.as_json(9.0)["state"] == "running"

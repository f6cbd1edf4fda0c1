"""`tandem play`'s report against real servers on loopback (CPU): a Ctrl-C
mid-game still gives the report of the frames played, and the printed
report names where each line is explained."""
from __future__ import annotations

import time

import pytest

from stack import cli
from stack.play import REPORT_DOC, PlayOptions, _reason, call_timeout_s, first_frame, play, print_report


@pytest.fixture(scope="module")
def cfg(cpu_stack):
    return cpu_stack


def _ctrl_c_at(frame: int):
    def log(line: str) -> None:
        if line.startswith(f"frame {frame}/"):
            raise KeyboardInterrupt  # where a Ctrl-C lands: the main thread, between frames
    return log


def test_a_ctrl_c_mid_game_reports_the_frames_played(cfg, capsys):
    opts = PlayOptions(cfg.search.address, cfg.reward.address, late_answers=True, frames=10, fps=10.0, simulations=20,
                       evaluator="rollout")
    report = play(opts, cfg, log=_ctrl_c_at(3))
    assert report["interrupted"] is True
    assert report["frames"] == 3 and report["frames_answered"] == 3 and not report["errors"]
    assert report["simulations_per_frame"]["min"] == 20
    print_report(report)
    out = capsys.readouterr().out
    assert "interrupted (Ctrl-C) after 3 frames" in out and f"(each line is explained in {REPORT_DOC})" in out


def test_a_whole_game_is_not_marked_interrupted_and_errors_print_as_counts(cfg, capsys):
    opts = PlayOptions(cfg.search.address, cfg.reward.address, late_answers=True, frames=2, fps=10.0, simulations=20,
                       evaluator="rollout")
    report = play(opts, cfg, log=None)
    assert report["interrupted"] is False and report["frames"] == 2
    report["errors"] = {"UNAVAILABLE": 2}
    print_report(report)
    out = capsys.readouterr().out
    assert "errors                 UNAVAILABLE (2 frames)" in out and "interrupted" not in out
    # Connect Four's positions carry the solver's labels: the answers are compared with it.
    assert report["solver"] is True and report["best_score_move_rate"] is not None
    assert "best_score_move_rate" in out and " as the solver" in out and "no solver" not in out


def test_a_call_past_its_frames_end_fails_as_a_missed_frame_and_the_loop_goes_on(cfg):
    """The default: each call's gRPC deadline is the frame's end. A budget no
    call can meet (1 µs) fails every frame, counted as missed, and the
    frames after it are still played: DEADLINE_EXCEEDED, or RESOURCE_EXHAUSTED
    where the search service refused the search first (no time left for a
    wave), whichever comes first."""
    opts = PlayOptions(cfg.search.address, cfg.reward.address, frames=3, fps=1e6, evaluator="rollout")
    report = play(opts, cfg, log=None)
    assert report["frames"] == 3 and report["frames_answered"] == 0
    assert sum(report["errors"].values()) == 3 and report["missed_frames"] == 3
    assert set(report["errors"]) <= {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}, report["errors"]


def test_a_report_with_no_frame_answered_says_so_and_counts_each_cause_once(cfg, capsys):
    """Frames of 1 µs: none answered. The printed lines say "none answered"
    instead of None figures and an empty backend, the CPU note stays (on a
    host without a GPU), and the most common failure is printed, naming the
    call that failed."""
    report = play(PlayOptions(cfg.search.address, cfg.reward.address, frames=3, fps=1e6, evaluator="rollout"),
                  cfg, log=None)
    assert report["frames_answered"] == 0
    print_report(report)
    out = capsys.readouterr().out
    assert "None" not in out.split("proven by")[0] and "search none answered" in out
    assert "frame_latency_ms       none answered" in out and "simulations per frame  none answered" in out
    assert report["gpu"] or "note: on the CPU some missed frames are expected" in out
    assert sum(report["error_reasons"].values()) == 3 and "most common reason     " in out
    assert all(r.startswith(("DEADLINE_EXCEEDED (search", "RESOURCE_EXHAUSTED (search")) for r in report["error_reasons"])


def test_failure_reasons_count_one_cause_once_whatever_its_times_and_keep_addresses():
    """The times in a message (ms left, a wave's expected ms) read as "#", so
    one cause is one count; an address's port, a model's name are kept: they
    tell causes apart."""
    assert _reason("at capacity: its next wave is expected to take 24.3 ms, more than the 0.0 ms the call has") == \
        _reason("at capacity: its next wave is expected to take 6.8 ms, more than the 1.2 ms the call has")
    assert _reason("failed to connect to ipv4:127.0.0.1:50051") != _reason("failed to connect to ipv4:127.0.0.1:50052")
    assert _reason("unknown model 'value_v2'") != _reason("unknown model 'value_v3'")
    assert _reason("5 searches in flight, 2 s left") == "5 searches in flight, # s left"


def test_frames_missed_by_their_deadline_do_not_fail_the_command(cfg, capsys):
    """Missed frames are the figures, not a failure: `tandem play` exits 0 when
    its calls failed only by their frames' end. One frame of 1 µs: its calls
    end at the client before any answer can come back. (A second frame's
    search would reach the server while the first's is in flight, and be
    refused RESOURCE_EXHAUSTED there when that answer beat the client's own
    deadline: a race with the host's speed.)"""
    code = cli.main(["play", "--search", cfg.search.address, "--reward", cfg.reward.address, "--frames", "1",
                     "--fps", "1000000", "--evaluator", "rollout"])
    assert code == 0 and "DEADLINE_EXCEEDED (1 frames)" in capsys.readouterr().out


def test_a_frames_calls_wait_for_the_frames_end_or_with_late_answers_ten_frames():
    assert call_timeout_s(16.0) == 0.016
    assert call_timeout_s(16.0, late_answers=True) == 1.0 and call_timeout_s(200.0, late_answers=True) == 2.0


def test_a_report_records_its_provenance(cfg, monkeypatch):
    """Where a figure came from travels with it: the commit the caller names
    (as a tree sent to the GPU machine does), whether the tree differed, the
    command line and the date, first in the report."""
    monkeypatch.setenv("TANDEM_COMMIT", "0" * 40)
    monkeypatch.setenv("TANDEM_DIRTY", "0")
    opts = PlayOptions(cfg.search.address, cfg.reward.address, late_answers=True, frames=1, fps=10.0, simulations=4,
                       evaluator="rollout")
    report = play(opts, cfg, log=None)
    assert list(report)[:4] == ["date", "gpu", "versions", "command"]
    assert report["versions"]["tandem_commit"] == "0" * 40 and report["versions"]["tandem_dirty"] is False
    assert report["versions"]["numpy"] and report["date"].endswith("Z") and report["command"]


def test_a_start_time_becomes_the_first_frames_start_on_the_monotonic_clock():
    """--start-at: engines started together begin in step; a time past (or none) starts at once."""
    assert first_frame(None) is None
    m0 = time.monotonic()
    assert m0 <= first_frame(time.time() - 60) <= time.monotonic()  # past: now
    w0, m0 = time.time(), time.monotonic()
    at = first_frame(w0 + 5.0)
    m1, w1 = time.monotonic(), time.time()
    assert m0 + 5.0 - (w1 - w0) <= at <= m1 + 5.0


def test_play_takes_a_start_time_and_refuses_a_negative_one_naming_it(cfg, capsys):
    code = cli.main(["play", "--search", cfg.search.address, "--reward", cfg.reward.address, "--frames", "2",
                     "--fps", "10", "--evaluator", "rollout", "--simulations", "8", "--late-answers",
                     "--start-at", f"{time.time() + 0.2:.3f}"])
    assert code == 0 and "frames                 2 at 10 FPS" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cli.main(["play", "--start-at", "-1"])
    assert info.value.code == 2 and "--start-at" in capsys.readouterr().err

"""`tandem play --agents K` against real servers on loopback (CPU): each frame
is one SearchBatch of K positions and one Evaluate, every agent scored."""
from __future__ import annotations

from conftest import loopback_config

from reward_service import server as reward_server
from search_service import server as search_server
from stack.play import PlayOptions, play


def test_an_engine_of_several_agents_plays_every_agents_search():
    cfg = loopback_config(search={"backend": "cpu"})
    reward = reward_server.start(cfg, follow_scheduler=False)
    search = search_server.start(cfg, follow_scheduler=False)
    try:
        # Frames of 10 fps: a generous budget on a loaded 2-core host; a capped search each.
        opts = PlayOptions(cfg.search.address, cfg.reward.address, late_answers=True, frames=4, fps=10.0, simulations=20,
                           evaluator="rollout", agents=3)
        report = play(opts, cfg, log=None)
    finally:
        search.stop()
        reward.stop()
    assert report["agents"] == 3 and report["frames_answered"] == 4 and not report["errors"]
    assert report["simulations_per_frame"]["min"] == 20 and report["simulations_per_frame"]["mean"] == 20
    assert report["positions_not_lost"] > 4  # the agents' positions are scored, not the frames'
    assert 0 <= report["optimal_move_rate"] <= 1 and report["backends"]["search"] == ["cpu_reference"]

"""Loading game plug-ins: a folder anywhere loads, and every bad folder raises
a GameError that names the game and the cause."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from game_folders import TIC_TAC_TOE, TIC_TAC_TOE_RULES, broken, write_game

from search_service.games.plugin import GameError, bundled_folder, load_game, resolve_folder
from search_service.games.protocol import GameRules


def raises_game_error(folder, *fragments: str) -> GameError:
    """The GameError that loading ``folder`` raises; its message holds every fragment."""
    with pytest.raises(GameError) as info:
        load_game(folder)
    message = str(info.value)
    assert all(f in message for f in fragments), message
    return info.value


# -- folders that load ---------------------------------------------------------


def test_a_folder_outside_the_repository_loads(tmp_path):
    game = load_game(write_game(tmp_path / "ttt"))
    assert game.name == "tic_tac_toe"
    assert (game.meta.num_actions, game.meta.state_words, game.meta.observation) == (9, 1, (2, 3, 3))
    assert (game.meta.players, game.meta.max_moves, game.meta.openspiel) == (2, 9, "tic_tac_toe")
    assert game.meta.folder == (tmp_path / "ttt").resolve() and game.meta.positions is None
    assert isinstance(game.rules, GameRules)
    assert game.rules.moves_to_text([4, 0]) == "51"


def test_each_load_imports_rules_afresh(tmp_path):
    folder = write_game(tmp_path / "ttt")
    first, second = load_game(folder), load_game(folder)
    assert first.rules is not second.rules and first.rules.__name__ != second.rules.__name__
    assert sys.modules[first.rules.__name__] is first.rules


def test_two_games_with_one_name_in_two_folders_do_not_collide(tmp_path):
    a = load_game(write_game(tmp_path / "a"))
    b = load_game(write_game(tmp_path / "b", rules=TIC_TAC_TOE_RULES + "\nFOLDER = 'b'\n"))
    assert not hasattr(a.rules, "FOLDER") and b.rules.FOLDER == "b"


def test_the_bundled_othello_loads_by_folder_and_by_name():
    folder = bundled_folder("othello")
    assert resolve_folder("othello") == folder
    game = load_game(folder)
    assert (game.name, game.meta.num_actions, game.meta.state_words) == ("othello", 65, 3)
    assert game.meta.observation == (2, 8, 8) and game.meta.openspiel == "othello"


def test_positions_names_a_file_in_the_folder(tmp_path):
    folder = write_game(tmp_path / "ttt", positions="openings.txt")
    (folder / "openings.txt").write_text("5\n")
    assert load_game(folder).meta.positions == (folder / "openings.txt").resolve()


# -- folders that do not ---------------------------------------------------------


def test_an_unknown_folder(tmp_path):
    err = raises_game_error(tmp_path / "nowhere", str(tmp_path / "nowhere"), "no such game folder")
    assert isinstance(err, ValueError) and err.cause == "no such game folder"


def test_an_unknown_bundled_name():
    with pytest.raises(GameError, match=r"'chess'.*no bundled game of that name; bundled: .*othello"):
        resolve_folder("chess")


def test_a_folder_without_game_yaml(tmp_path):
    folder = write_game(tmp_path / "ttt")
    (folder / "game.yaml").unlink()
    raises_game_error(folder, str(folder), "no game.yaml")


def test_a_folder_without_rules_py(tmp_path):
    folder = write_game(tmp_path / "ttt")
    (folder / "rules.py").unlink()
    raises_game_error(folder, "'tic_tac_toe'", "no rules.py")


def test_game_yaml_that_is_not_a_mapping(tmp_path):
    folder = write_game(tmp_path / "ttt")
    (folder / "game.yaml").write_text("- just\n- a list\n")
    raises_game_error(folder, str(folder), "must be a mapping")


def test_game_yaml_that_does_not_parse(tmp_path):
    folder = write_game(tmp_path / "ttt")
    (folder / "game.yaml").write_text("name: [unclosed\n")
    raises_game_error(folder, str(folder), f"{folder.resolve() / 'game.yaml'}: not valid YAML")


# game.yaml is read with tandem.yaml's checks (tandem.config.load_yaml).
def test_game_yaml_with_a_key_given_twice_names_the_key_and_line(tmp_path):
    """The last would silently win."""
    folder = write_game(tmp_path / "ttt")
    path = folder / "game.yaml"
    path.write_text(path.read_text() + "name: noughts\n")
    lines = path.read_text().count("\n")
    err = raises_game_error(folder, f"{path.resolve()}: not valid YAML: line {lines}: name: the key is given twice")
    assert "\n" not in str(err)


def test_deeply_nested_game_yaml_is_refused_in_one_line(tmp_path):
    folder = write_game(tmp_path / "ttt")
    path = folder / "game.yaml"
    path.write_text(path.read_text() + "positions: " + "[" * 100_000 + "]" * 100_000 + "\n")
    err = raises_game_error(folder, f"{path.resolve()}: not valid YAML: line ", "nested deeper than 32 levels")
    assert "\n" not in str(err) and len(str(err)) < 300 and err.__cause__ is None


def test_an_oversized_or_aliased_game_yaml_is_refused(tmp_path):
    folder = write_game(tmp_path / "ttt")
    path = folder / "game.yaml"
    path.write_text(path.read_text() + "#" * (1 << 20) + "\n")  # a comment: valid YAML, but not read past 1 MiB
    raises_game_error(folder, str(folder), f"{path.resolve()}: larger than 1048576 bytes")
    write_game(folder, name="x")
    path.write_text(path.read_text().replace("name: x", "name: &n tic_tac_toe\nopenspiel: *n"))
    raises_game_error(folder, str(folder), "not valid YAML: line ", "YAML aliases (*name) are not allowed")


@pytest.mark.parametrize("field", ["name", "num_actions", "state_words", "observation", "players", "max_moves"])
def test_a_missing_field(tmp_path, field):
    folder = write_game(tmp_path / "ttt", drop=(field,))
    err = raises_game_error(folder, str(folder.resolve()), f"lacks field(s) {field}")
    if field != "name":
        assert "'tic_tac_toe'" in err.game


def test_an_unknown_field(tmp_path):
    raises_game_error(write_game(tmp_path / "ttt", open_spiel="tic_tac_toe"), "'tic_tac_toe'",
                      "unknown field(s) open_spiel")


@pytest.mark.parametrize(("field", "value", "cause"), [
    ("num_actions", "nine", "field num_actions must be an integer, got 'nine'"),
    ("num_actions", 9.0, "field num_actions must be an integer"),
    ("num_actions", True, "field num_actions must be an integer, got True"),
    ("num_actions", 0, "field num_actions must be in 1..4096, got 0"),
    ("num_actions", 4097, "field num_actions must be in 1..4096, got 4097"),
    ("state_words", 0, "field state_words must be in >= 1"),
    ("max_moves", "9", "field max_moves must be an integer"),
    ("players", 3, "field players must be 2"),
    ("observation", [2, 3], "field observation must be [planes, rows, columns]"),
    ("observation", [2, 3, 0], "field observation must be [planes, rows, columns]"),
    ("observation", "2x3x3", "field observation must be [planes, rows, columns]"),
    ("openspiel", 7, "field openspiel must be a pyspiel game name"),
    ("positions", "missing.txt", "positions names missing.txt, which is not a file"),
    ("positions", "../outside.txt", "points outside the game folder"),
])
def test_a_field_of_the_wrong_type_or_range(tmp_path, field, value, cause):
    raises_game_error(write_game(tmp_path / "ttt", **{field: value}), "'tic_tac_toe'", cause)


def test_a_bad_name(tmp_path):
    folder = write_game(tmp_path / "ttt", name="tic tac/toe")
    raises_game_error(folder, str(folder.resolve()), "field name must be a string")


@pytest.mark.parametrize(("fields", "cause"), [
    ({"state_words": 2}, "initial(1) returned uint64 [1, 1], expected uint64 [1, 2]"),
    ({"num_actions": 10}, "legal_mask returned bool [2, 9], expected bool [2, 10]"),
    ({"observation": [3, 3, 3]}, "observation returned uint8 [2, 2, 3, 3], expected uint8 [2, 3, 3, 3]"),
])
def test_rules_that_disagree_with_the_metadata(tmp_path, fields, cause):
    err = raises_game_error(write_game(tmp_path / "ttt", **fields), "'tic_tac_toe'", cause)
    assert "game.yaml and rules.py disagree" in err.cause


@pytest.mark.parametrize(("old", "new", "cause"), [
    ("return np.zeros((batch, 1), _U64)", "return np.zeros((batch, 1), np.int64)",
     "initial(1) returned int64 [1, 1], expected uint64 [1, 1]"),
    ("return (_count(x) > _count(o)).astype(np.int8)", "return (_count(x) > _count(o)).astype(np.int64)",
     "to_play returned int64 [2], expected int8 [2]"),
    ("    return nxt, terminal, -returns(nxt)", "    return nxt, terminal",
     "step returned tuple, expected (next, terminal, reward)"),
    ("    state = initial(1)\n    for i, ch", "    state = initial(1) + _U64(1)\n    for i, ch",
     'parse_moves("") is not the starting state'),
    ("def step(", "def not_step(", "rules.py lacks the function(s) step"),
    ("def to_openspiel_action(", "def openspiel_id(", "rules.py lacks the function(s) to_openspiel_action"),
    ('    if not "1" <= ch <= "9":', '    if True:', "rules.parse_moves raised ValueError: character 1"),
])
def test_rules_that_break_the_protocol(tmp_path, old, new, cause):
    raises_game_error(write_game(tmp_path / "ttt", rules=broken(old, new)), "'tic_tac_toe'", cause)


def test_to_openspiel_action_is_needed_only_with_openspiel(tmp_path):
    rules = broken("def to_openspiel_action(", "def openspiel_id(")
    assert load_game(write_game(tmp_path / "ttt", rules=rules, drop=("openspiel",))).meta.openspiel is None


def test_rules_that_raise_on_import(tmp_path):
    folder = write_game(tmp_path / "ttt", rules="import numpy\nraise RuntimeError('no licence file')\n")
    before = set(sys.modules)
    raises_game_error(folder, "'tic_tac_toe'", str(folder.resolve()),
                      "rules.py raised on import: RuntimeError: no licence file")
    assert not [m for m in set(sys.modules) - before if m.startswith("_tandem_game_")]


def test_rules_with_a_syntax_error(tmp_path):
    raises_game_error(write_game(tmp_path / "ttt", rules="def initial(:\n"), "'tic_tac_toe'",
                      "rules.py raised on import: SyntaxError")


def test_a_folder_that_fails_its_checks_leaves_no_module(tmp_path):
    before = set(sys.modules)
    raises_game_error(write_game(tmp_path / "ttt", state_words=3), "initial(1)")
    assert not [m for m in set(sys.modules) - before if m.startswith("_tandem_game_")]


def test_the_meta_of_the_written_folder_is_tic_tac_toes(tmp_path):
    """The variants above differ from a folder that loads only where they say."""
    game = load_game(write_game(tmp_path / "ttt"))
    assert {k: getattr(game.meta, k) for k in TIC_TAC_TOE if k != "observation"} == \
        {k: v for k, v in TIC_TAC_TOE.items() if k != "observation"}
    assert np.array_equal(game.rules.parse_moves("5"), game.rules.step(game.rules.initial(1), np.array([4]))[0])

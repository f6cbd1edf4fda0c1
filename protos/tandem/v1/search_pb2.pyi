from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GamePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GAME_PHASE_UNSPECIFIED: _ClassVar[GamePhase]
    GAME_PHASE_EARLY: _ClassVar[GamePhase]
    GAME_PHASE_MID: _ClassVar[GamePhase]
    GAME_PHASE_LATE: _ClassVar[GamePhase]

class ProvenResult(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROVEN_RESULT_UNSPECIFIED: _ClassVar[ProvenResult]
    PROVEN_RESULT_WIN: _ClassVar[ProvenResult]
    PROVEN_RESULT_LOSS: _ClassVar[ProvenResult]
    PROVEN_RESULT_DRAW: _ClassVar[ProvenResult]

class Evaluator(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVALUATOR_UNSPECIFIED: _ClassVar[Evaluator]
    EVALUATOR_ROLLOUT: _ClassVar[Evaluator]
    EVALUATOR_VALUE_MODEL: _ClassVar[Evaluator]
GAME_PHASE_UNSPECIFIED: GamePhase
GAME_PHASE_EARLY: GamePhase
GAME_PHASE_MID: GamePhase
GAME_PHASE_LATE: GamePhase
PROVEN_RESULT_UNSPECIFIED: ProvenResult
PROVEN_RESULT_WIN: ProvenResult
PROVEN_RESULT_LOSS: ProvenResult
PROVEN_RESULT_DRAW: ProvenResult
EVALUATOR_UNSPECIFIED: Evaluator
EVALUATOR_ROLLOUT: Evaluator
EVALUATOR_VALUE_MODEL: Evaluator

class Board(_message.Message):
    __slots__ = ("rows", "columns", "cells")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    CELLS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    columns: int
    cells: bytes
    def __init__(self, rows: _Optional[int] = ..., columns: _Optional[int] = ..., cells: _Optional[bytes] = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("game", "moves", "board", "simulations", "deadline_ms", "phase", "session_id", "evaluator", "seed")
    GAME_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    BOARD_FIELD_NUMBER: _ClassVar[int]
    SIMULATIONS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    game: str
    moves: str
    board: Board
    simulations: int
    deadline_ms: float
    phase: GamePhase
    session_id: str
    evaluator: Evaluator
    seed: int
    def __init__(self, game: _Optional[str] = ..., moves: _Optional[str] = ..., board: _Optional[_Union[Board, _Mapping]] = ..., simulations: _Optional[int] = ..., deadline_ms: _Optional[float] = ..., phase: _Optional[_Union[GamePhase, str]] = ..., session_id: _Optional[str] = ..., evaluator: _Optional[_Union[Evaluator, str]] = ..., seed: _Optional[int] = ...) -> None: ...

class LatencyBreakdown(_message.Message):
    __slots__ = ("select_ms", "expand_ms", "evaluate_ms", "backup_ms", "total_ms")
    SELECT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPAND_MS_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_MS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    select_ms: float
    expand_ms: float
    evaluate_ms: float
    backup_ms: float
    total_ms: float
    def __init__(self, select_ms: _Optional[float] = ..., expand_ms: _Optional[float] = ..., evaluate_ms: _Optional[float] = ..., backup_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("action", "move", "visit_counts", "q_values", "root_value", "principal_variation", "principal_variation_moves", "simulations", "latency", "backend", "evaluator", "max_depth", "tree_nodes", "tree_reused", "pool_exhausted", "deadline_reached", "model_simulations", "handoff", "evaluation_failure", "proven")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    MOVE_FIELD_NUMBER: _ClassVar[int]
    VISIT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    Q_VALUES_FIELD_NUMBER: _ClassVar[int]
    ROOT_VALUE_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_VARIATION_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_VARIATION_MOVES_FIELD_NUMBER: _ClassVar[int]
    SIMULATIONS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    TREE_REUSED_FIELD_NUMBER: _ClassVar[int]
    POOL_EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_REACHED_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIMULATIONS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FAILURE_FIELD_NUMBER: _ClassVar[int]
    PROVEN_FIELD_NUMBER: _ClassVar[int]
    action: int
    move: str
    visit_counts: _containers.RepeatedScalarFieldContainer[int]
    q_values: _containers.RepeatedScalarFieldContainer[float]
    root_value: float
    principal_variation: _containers.RepeatedScalarFieldContainer[int]
    principal_variation_moves: str
    simulations: int
    latency: LatencyBreakdown
    backend: str
    evaluator: Evaluator
    max_depth: int
    tree_nodes: int
    tree_reused: bool
    pool_exhausted: bool
    deadline_reached: bool
    model_simulations: int
    handoff: str
    evaluation_failure: str
    proven: ProvenResult
    def __init__(self, action: _Optional[int] = ..., move: _Optional[str] = ..., visit_counts: _Optional[_Iterable[int]] = ..., q_values: _Optional[_Iterable[float]] = ..., root_value: _Optional[float] = ..., principal_variation: _Optional[_Iterable[int]] = ..., principal_variation_moves: _Optional[str] = ..., simulations: _Optional[int] = ..., latency: _Optional[_Union[LatencyBreakdown, _Mapping]] = ..., backend: _Optional[str] = ..., evaluator: _Optional[_Union[Evaluator, str]] = ..., max_depth: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., tree_reused: bool = ..., pool_exhausted: bool = ..., deadline_reached: bool = ..., model_simulations: _Optional[int] = ..., handoff: _Optional[str] = ..., evaluation_failure: _Optional[str] = ..., proven: _Optional[_Union[ProvenResult, str]] = ...) -> None: ...

class SearchBatchRequest(_message.Message):
    __slots__ = ("searches",)
    SEARCHES_FIELD_NUMBER: _ClassVar[int]
    searches: _containers.RepeatedCompositeFieldContainer[SearchRequest]
    def __init__(self, searches: _Optional[_Iterable[_Union[SearchRequest, _Mapping]]] = ...) -> None: ...

class SearchBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SearchResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[SearchResponse, _Mapping]]] = ...) -> None: ...

class ListGamesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GameInfo(_message.Message):
    __slots__ = ("name", "num_actions", "rows", "columns", "evaluators", "value_model", "backend", "backend_note", "boards")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    EVALUATORS_FIELD_NUMBER: _ClassVar[int]
    VALUE_MODEL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_NOTE_FIELD_NUMBER: _ClassVar[int]
    BOARDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_actions: int
    rows: int
    columns: int
    evaluators: _containers.RepeatedScalarFieldContainer[Evaluator]
    value_model: str
    backend: str
    backend_note: str
    boards: bool
    def __init__(self, name: _Optional[str] = ..., num_actions: _Optional[int] = ..., rows: _Optional[int] = ..., columns: _Optional[int] = ..., evaluators: _Optional[_Iterable[_Union[Evaluator, str]]] = ..., value_model: _Optional[str] = ..., backend: _Optional[str] = ..., backend_note: _Optional[str] = ..., boards: bool = ...) -> None: ...

class ListGamesResponse(_message.Message):
    __slots__ = ("games",)
    GAMES_FIELD_NUMBER: _ClassVar[int]
    games: _containers.RepeatedCompositeFieldContainer[GameInfo]
    def __init__(self, games: _Optional[_Iterable[_Union[GameInfo, _Mapping]]] = ...) -> None: ...

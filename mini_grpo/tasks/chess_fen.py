"""chess_fen: read a short game from the start position, answer the FEN of the final position.

    prompt  "e2e4 e7e5 g1f3:"   (space-separated moves, UCI or SAN, then ':')
    target  "rnbqkbnr/pppp1ppp/8/4p3/4P3/5N2/PPPP1PPP/RNBQKB1R b KQkq - 1 2"   (board.fen())

Rows come from one of three sources:
  - generated: uniformly random legal games from random.Random(seed), with a ply count drawn
    uniformly from min_plies..max_plies; the held-out games are drawn first, with distinct
    prompts, and training games that repeat one of them are redrawn;
  - task_args.pgn_path: the first min_plies..max_plies moves of each game of a PGN file;
  - data_path: a JSONL file (tasks/jsonl.py); every row is checked at load against the chess
    alphabet, and its target must be a FEN python-chess accepts.

Evaluation extras: the valid-FEN rate, results by ply bucket, and the start position as a
trivial answer the policy must beat.
"""

from __future__ import annotations

import io
import logging
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import chess
import chess.pgn
import numpy as np

from mini_grpo.fields import ConfigError
from mini_grpo.task_registry import MAX_GENERATED, register
from mini_grpo.tasks.base import Example, TaskData, split_held_out
from mini_grpo.tasks.jsonl import load_jsonl
from mini_grpo.tokenizer import CharTokenizer

if TYPE_CHECKING:
    from mini_grpo.config import GRPOConfig

log = logging.getLogger("mini_grpo.tasks")

# Fixed, so the tokenizer is the same for every seed: files and ranks, digits for FEN runs and
# clocks, piece letters, side to move, SAN's x + # = and O-O, FEN's / and -, the ' ' and ':'.
ALPHABET = "".join(sorted(set("abcdefgh0123456789pnbrqkPNBRQKwOx+#=-/ :")))

# Half board_delta, which gives the start position ~0.1, half levenshtein, which still credits
# a near-miss whose placement does not parse. Under 0.2 fen_valid + 0.8 levenshtein, echoing
# the start FEN scored 0.76, more than a half-trained policy; here it scores 0.41 against 0.5
# for 2-3 random character edits of the target and 0.9 for 2-3 wrong squares. fen_valid is
# left out because every trivial answer is a valid FEN (docs/rewards.md has the table).
DEFAULT_REWARDS = [
    {"name": "board_delta", "weight": 0.5},
    {"name": "levenshtein", "weight": 0.5},
]

PLY_BUCKETS = ((2, 4), (5, 8), (9, 12))
# longest game asked for: a random game this long is ~5,000 characters of prompt, and its
# moves cost ~30 us each to generate, per training game
MAX_PLIES = 1000


@dataclass
class Args:
    """chess_fen's options (the config's task_args)."""
    num_train: int = 50000  # generated training prompts (~10 s to generate; at most 10 million)
    min_plies: int = 2  # shortest game (half-moves)
    max_plies: int = 12  # at most MAX_PLIES
    move_format: Literal["uci", "san"] = "uci"
    pgn_path: str = ""  # PGN file whose games give the prompts, instead of random games

    def check(self) -> None:
        if not 0 < self.num_train <= MAX_GENERATED:
            raise ConfigError(f"task_args.num_train: must be in 1..{MAX_GENERATED:,}, "
                              f"got {self.num_train}")
        if self.min_plies < 0:
            raise ConfigError(f"task_args.min_plies: must be >= 0, got {self.min_plies}")
        if self.max_plies < self.min_plies:
            raise ConfigError(f"task_args.max_plies: must be >= min_plies ({self.min_plies}), "
                              f"got {self.max_plies}")
        if self.max_plies > MAX_PLIES:
            raise ConfigError(f"task_args.max_plies: must be <= {MAX_PLIES}, "
                              f"got {self.max_plies}")


CACHED_PLIES = 3  # legal-move lists cached for the first plies, which most games share
TRIES_PER_GAME = 20  # give up (ConfigError) after this many draws per requested game


def format_prompt(moves: list[str]) -> str:
    return " ".join(moves) + ":"


def push_move(board: chess.Board, move: chess.Move, san: bool) -> str:
    """Plays the move and returns its text (SAN needs the position before the move)."""
    if san:
        return board.san_and_push(move)
    board.push(move)
    return move.uci()


def random_game(rng: random.Random, plies: int, san: bool, cache: dict) -> Example:
    """Up to `plies` uniformly random legal moves; shorter if the game ends first."""
    board, played, moves = chess.Board(), [], []
    for ply in range(plies):
        key = tuple(played)
        legal = cache.get(key) if ply < CACHED_PLIES else None
        if legal is None:
            legal = list(board.legal_moves)  # the dominant cost, ~30 us
            if ply < CACHED_PLIES:
                cache[key] = legal
        if not legal:
            break
        move = rng.choice(legal)
        moves.append(push_move(board, move, san))
        played.append(move)
    return Example(format_prompt(moves), board.fen(), {"plies": len(played)})


def generate_games(rng: random.Random, n: int, min_plies: int, max_plies: int, san: bool,
                   cache: dict, exclude: set[str] | frozenset = frozenset(),
                   distinct: bool = False) -> list[Example]:
    """Up to n games whose prompts avoid `exclude` (and each other, if distinct)."""
    out: list[Example] = []
    seen: set[str] = set()
    for _ in range(TRIES_PER_GAME * n + 1000):
        if len(out) == n:
            break
        ex = random_game(rng, rng.randint(min_plies, max_plies), san, cache)
        if ex.meta["plies"] < min_plies or ex.prompt in exclude or (distinct and ex.prompt in seen):
            continue
        seen.add(ex.prompt)
        out.append(ex)
    return out


def generate_split(num_train: int, num_eval: int, min_plies: int, max_plies: int, san: bool,
                   seed: int) -> tuple[list[Example], list[Example]]:
    rng, cache = random.Random(seed), {}
    held = generate_games(rng, num_eval, min_plies, max_plies, san, cache, distinct=True)
    if len(held) < num_eval:
        raise ConfigError(f"num_eval: found only {len(held)} distinct games of {min_plies}.."
                          f"{max_plies} plies; lower num_eval or widen the ply range")
    exclude = {ex.prompt for ex in held}
    train = generate_games(rng, num_train, min_plies, max_plies, san, cache, exclude=exclude)
    if len(train) < num_train:
        raise ConfigError(f"num_train: almost every game of {min_plies}..{max_plies} plies is "
                          f"held out for evaluation; lower num_eval or widen the ply range")
    return train, held


class _QuietBuilder(chess.pgn.GameBuilder):
    """Collects parse errors without logging them: load_pgn turns the first into a ConfigError."""

    def handle_error(self, error: Exception) -> None:
        self.game.errors.append(error)


def game_examples(game: chess.pgn.Game, min_plies: int, max_plies: int, san: bool,
                  index: int) -> list[Example]:
    board, moves, out = game.board(), [], []
    mainline = iter(game.mainline_moves())
    while True:
        if len(moves) >= min_plies:
            out.append(Example(format_prompt(moves), board.fen(),
                               {"plies": len(moves), "game": index}))
        move = next(mainline, None) if len(moves) < max_plies else None
        if move is None:
            return out
        moves.append(push_move(board, move, san))


def load_pgn(path, min_plies: int = 2, max_plies: int = 12, san: bool = False) -> list[Example]:
    """One example per game and ply count in min_plies..max_plies, deduplicated by prompt.

    Games set up from another position (a FEN header or a variant) are skipped with a warning:
    their moves do not make sense from the start position. A parse error (an illegal move, ...)
    is a ConfigError naming the file, the line where the game starts and the game's number.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read PGN file ({e.strerror})") from None
    handle, space = io.StringIO(text), re.compile(r"\s*")
    examples: dict[str, Example] = {}
    line, pos, index, skipped = 1, 0, 0, 0
    while True:
        start = space.match(text, handle.tell()).end()
        line, pos = line + text.count("\n", pos, start), start
        game = chess.pgn.read_game(handle, Visitor=_QuietBuilder)
        if game is None:
            break
        index += 1
        if game.errors:
            raise ConfigError(f"{path}:{line}: game {index}: {game.errors[0]}")
        if "FEN" in game.headers or game.headers.get("Variant", "Standard") != "Standard":
            skipped += 1
            continue
        for ex in game_examples(game, min_plies, max_plies, san, index):
            examples.setdefault(ex.prompt, ex)
    if index == 0:
        raise ConfigError(f"{path}: no games found")
    if skipped:
        log.warning("%s: skipped %d games that do not start from the standard position",
                    path, skipped)
    if not examples:
        raise ConfigError(f"{path}: no game from the standard position has {min_plies} plies")
    return list(examples.values())


def fen_error(target: str) -> str | None:
    """Why `target` is not a FEN python-chess accepts, or None."""
    try:
        chess.Board(target)
    except ValueError as e:
        return f"target {target[:80]!r} is not a FEN ({e})"
    return None


def _check_row(ex: Example) -> str | None:
    return fen_error(ex.target)


def valid_fen_column(examples: list[Example], completions: list[str]) -> dict:
    from mini_grpo.rewards.fen import fen_valid

    return {"valid_fen": np.asarray(fen_valid([], completions, [], []), dtype=float)}


def ply_bucket(ex: Example) -> str | None:
    plies = ex.meta.get("plies")
    for lo, hi in PLY_BUCKETS:
        if isinstance(plies, int) and lo <= plies <= hi:
            return f"plies_{lo}-{hi}"
    return None


@register("chess_fen", Args)
def build(cfg: GRPOConfig, args: Args) -> TaskData:
    san = args.move_format == "san"
    if cfg.data_path and args.pgn_path:
        raise ConfigError("task_args.pgn_path: data_path is set too; choose one source of rows")
    if cfg.data_path:
        rows = load_jsonl(cfg.data_path, CharTokenizer(ALPHABET), check=_check_row)
        train, held = split_held_out(rows, cfg.num_eval, cfg.seed, cfg.data_path)
    elif args.pgn_path:
        rows = load_pgn(args.pgn_path, args.min_plies, args.max_plies, san)
        train, held = split_held_out(rows, cfg.num_eval, cfg.seed, args.pgn_path)
    else:
        train, held = generate_split(args.num_train, cfg.num_eval, args.min_plies,
                                     args.max_plies, san, cfg.seed)
    return TaskData("chess_fen", train, held, [dict(r) for r in DEFAULT_REWARDS], ALPHABET,
                    eval_columns=valid_fen_column, eval_bucket=ply_bucket,
                    trivial_answers={"start_fen": lambda ex: chess.STARTING_FEN})

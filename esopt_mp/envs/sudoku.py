"""Sudoku as the paper runs it: one ``set <row> <col> <value>`` per turn, terminal reward.

9x9 boards with H* = mask_count blanks (the paper's 5 / 10 / 15), a 4x4 variant
(2x2 boxes) for CPU demos. The prompt shows the original puzzle, the current
board with row/column coordinates and box separators, the empty cells and the
last feedback. Invalid actions (bad format, out of range, a given cell, an
already filled cell) get a message and use up the turn. Reward 1 only for a
complete valid board consistent with the givens.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import re

from esopt_mp.envs.spec import EnvSpec

ACTION = re.compile(r"set\s+(-?\d+)\s+(-?\d+)\s+(-?\d+)", re.IGNORECASE)
_DIGITS = 6  # a longer number is out of range whatever it is (and int() refuses 4300+ digits)


def _box(size: int) -> int:
    b = math.isqrt(size)
    if b * b != size:
        raise ValueError(f"sudoku size must be a square (4, 9, ...), got {size}")
    return b


def count_solutions(board: list[list[int]], limit: int = 2) -> int:
    """Number of completions of ``board`` (0 = blank), counting at most ``limit``."""
    n = len(board)
    b = _box(n)
    full = (1 << (n + 1)) - 2
    rows, cols, boxes = [0] * n, [0] * n, [0] * n
    empty = []
    for r in range(n):
        for c in range(n):
            v = board[r][c]
            if v:
                bit = 1 << v
                k = (r // b) * b + c // b
                if rows[r] & bit or cols[c] & bit or boxes[k] & bit:
                    return 0
                rows[r] |= bit
                cols[c] |= bit
                boxes[k] |= bit
            else:
                empty.append((r, c))

    def solve(i: int) -> int:
        if i == len(empty):
            return 1
        # most constrained cell first
        best, best_opts = i, None
        for j in range(i, len(empty)):
            r, c = empty[j]
            opts = full & ~(rows[r] | cols[c] | boxes[(r // b) * b + c // b])
            if best_opts is None or bin(opts).count("1") < bin(best_opts).count("1"):
                best, best_opts = j, opts
                if opts == 0:
                    return 0
        empty[i], empty[best] = empty[best], empty[i]
        r, c = empty[i]
        k = (r // b) * b + c // b
        total = 0
        opts = best_opts
        while opts and total < limit:
            bit = opts & -opts
            opts ^= bit
            rows[r] |= bit
            cols[c] |= bit
            boxes[k] |= bit
            total += solve(i + 1)
            rows[r] ^= bit
            cols[c] ^= bit
            boxes[k] ^= bit
        empty[i], empty[best] = empty[best], empty[i]
        return total

    return solve(0)


def is_valid_solution(board: list[list[int]], givens: list[list[int]] | None = None) -> bool:
    """Complete, every row/column/box a permutation of 1..n, consistent with ``givens``."""
    n = len(board)
    b = _box(n)
    want = set(range(1, n + 1))
    if any(len(row) != n for row in board):
        return False
    groups = [board[r] for r in range(n)] + [[board[r][c] for r in range(n)] for c in range(n)]
    groups += [[board[r][c] for r in range(br, br + b) for c in range(bc, bc + b)]
               for br in range(0, n, b) for bc in range(0, n, b)]
    if any(set(g) != want for g in groups):
        return False
    return givens is None or all(givens[r][c] in (0, board[r][c]) for r in range(n) for c in range(n))


def _random_solution(size: int, rng: random.Random) -> list[list[int]]:
    b = _box(size)
    pattern = [[(b * (r % b) + r // b + c) % size for c in range(size)] for r in range(size)]
    rows = [g * b + r for g in rng.sample(range(b), b) for r in rng.sample(range(b), b)]
    cols = [g * b + c for g in rng.sample(range(b), b) for c in rng.sample(range(b), b)]
    digits = rng.sample(range(1, size + 1), size)
    return [[digits[pattern[r][c]] for c in cols] for r in rows]


def generate(n: int, mask_count: int, size: int = 9, seed: int = 0) -> list[dict]:
    """``n`` puzzles with a unique solution and exactly ``mask_count`` blanks: rows {id, puzzle, solution, mask_count}."""
    if not 0 < mask_count < size * size:
        raise ValueError(f"mask_count must be in 1..{size * size - 1}, got {mask_count}")
    rng = random.Random(seed)
    out = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 100:
            raise ValueError(f"could not make unique {size}x{size} puzzles with {mask_count} blanks")
        solution = _random_solution(size, rng)
        puzzle = [row[:] for row in solution]
        cells = [(r, c) for r in range(size) for c in range(size)]
        rng.shuffle(cells)
        blanks = 0
        for r, c in cells:
            if blanks == mask_count:
                break
            v, puzzle[r][c] = puzzle[r][c], 0
            if count_solutions(puzzle) == 1:
                blanks += 1
            else:
                puzzle[r][c] = v
        if blanks == mask_count:
            out.append({"id": f"sudoku{size}-h{mask_count}-s{seed}-{len(out):05d}", "puzzle": puzzle,
                        "solution": solution, "mask_count": mask_count})
    return out


def _grid(v, size: int, key: str, row_id) -> list[list[int]]:
    if isinstance(v, str):  # compact form: 81 chars, '.' or '0' blank
        if len(v) != size * size:
            raise ValueError(f"row {row_id}: {key} has {len(v)} characters, expected {size * size}")
        return [[0 if ch in ".0" else int(ch) for ch in v[r * size:(r + 1) * size]] for r in range(size)]
    if len(v) != size or any(len(r) != size for r in v):
        raise ValueError(f"row {row_id}: {key} is not a {size}x{size} grid")
    return [[int(x) for x in r] for r in v]


def load_jsonl(path: str, mask_count: int | None = None) -> list[dict]:
    """Tasks from JSONL (the paper's splits as they are, or ``generate``'s rows), optionally one H*."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            rid = row.get("id", i)
            puzzle = row.get("puzzle", row.get("puzzle_compact"))
            solution = row.get("solution", row.get("solution_compact"))
            if puzzle is None or solution is None:
                raise ValueError(f"{path}: row {rid} lacks puzzle/solution")
            size = len(puzzle) if isinstance(puzzle, list) else math.isqrt(len(puzzle))
            row["puzzle"] = _grid(puzzle, size, "puzzle", rid)
            row["solution"] = _grid(solution, size, "solution", rid)
            blanks = sum(v == 0 for r in row["puzzle"] for v in r)
            row.setdefault("mask_count", blanks)
            if blanks != row["mask_count"]:
                raise ValueError(f"{path}: row {rid} has {blanks} blanks but mask_count {row['mask_count']}")
            if mask_count is None or row["mask_count"] == mask_count:
                rows.append(row)
    return rows


def save_jsonl(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({k: row[k] for k in ("id", "puzzle", "solution", "mask_count")}) + "\n")


def render_board(board: list[list[int]]) -> str:
    """Rows/columns numbered from 1, '.' for blanks, box separators."""
    n = len(board)
    b = _box(n)
    head = "    " + " | ".join(" ".join(str(c + 1) for c in range(g, g + b)) for g in range(0, n, b))
    sep = "   " + "+".join("-" * (2 * b + 1) for _ in range(b))
    lines = [head, sep]
    for r in range(n):
        cells = " | ".join(" ".join(str(v) if v else "." for v in board[r][g:g + b]) for g in range(0, n, b))
        lines.append(f"{r + 1:>2}  {cells}")
        if r % b == b - 1 and r != n - 1:
            lines.append(sep)
    return "\n".join(lines)


SYSTEM = ("You are playing Sudoku. Fill every empty cell so that each row, column and box contains each digit "
          "exactly once. Each turn, reply with exactly one action: set <row> <col> <value> (1-indexed).")


class SudokuEnv:
    name = "sudoku"

    def __init__(self, max_turns: int = 45, show_original: bool = True, hints: bool = False):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.show_original = show_original
        self.hints = hints  # not the paper's prompt: list each empty cell's candidates (CPU demo aid)
        self.task = None

    def reset(self, task: dict):
        self.task = task
        self.givens = [row[:] for row in task["puzzle"]]
        self.board = [row[:] for row in task["puzzle"]]
        self.size = len(self.board)
        self.turn = 0
        self.invalid = 0
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self._observation(None)}], {
            "id": task.get("id"), "blanks": self._blanks()}

    def _blanks(self) -> int:
        return sum(v == 0 for r in self.board for v in r)

    def _observation(self, feedback: str | None) -> str:
        n = self.size
        empty = [f"({r + 1},{c + 1})" for r in range(n) for c in range(n) if self.board[r][c] == 0]
        parts = []
        if self.show_original:
            parts.append("Original puzzle:\n" + render_board(self.givens))
        parts.append("Current board:\n" + render_board(self.board))
        parts.append("Empty cells: " + (" ".join(empty) if empty else "none"))
        if self.hints and empty:
            parts.append("Candidates: " + " ".join(
                f"({r + 1},{c + 1}):{''.join(map(str, self._candidates(r, c)))}"
                for r in range(n) for c in range(n) if self.board[r][c] == 0))
        if feedback:
            parts.append("Feedback: " + feedback)
        parts.append(f"Turn {self.turn + 1} of {self.max_turns}. Your action:")
        return "\n".join(parts)

    def _candidates(self, r: int, c: int) -> list[int]:
        n, b = self.size, _box(self.size)
        used = set(self.board[r]) | {self.board[i][c] for i in range(n)}
        used |= {self.board[i][j] for i in range(r // b * b, r // b * b + b) for j in range(c // b * b, c // b * b + b)}
        return [v for v in range(1, n + 1) if v not in used]

    def _apply(self, text: str) -> str:
        m = ACTION.search(text)
        n = self.size
        if not m:
            return "invalid format: expected 'set <row> <col> <value>'"
        r, c, v = (int(x) if len(x) <= _DIGITS else 0 for x in m.groups())
        if not (1 <= r <= n and 1 <= c <= n and 1 <= v <= n):
            return f"out of range: row and column must be 1..{n}, value 1..{n}"
        if self.givens[r - 1][c - 1]:
            return f"cell ({r},{c}) is a given and cannot be changed"
        if self.board[r - 1][c - 1]:
            return f"cell ({r},{c}) is already filled"
        self.board[r - 1][c - 1] = v
        return f"placed {v} at ({r},{c})"

    def step(self, assistant_text: str):
        if self.task is None:
            raise RuntimeError("step() before reset()")
        self.turn += 1
        feedback = self._apply(assistant_text)
        valid_action = feedback.startswith("placed")
        self.invalid += not valid_action
        done = self._blanks() == 0
        reward = float(done and is_valid_solution(self.board, self.givens))
        truncated = not done and self.turn >= self.max_turns
        info = {"feedback": feedback, "valid_action": valid_action, "blanks": self._blanks(),
                "invalid_actions": self.invalid}
        if done:
            info["solved"] = bool(reward)
            return [], reward, True, False, info
        return [{"role": "user", "content": self._observation(feedback)}], 0.0, False, truncated, info


@dataclasses.dataclass
class SudokuConfig:
    """``env.sudoku``: the board and the prompt."""

    size: int = 4  # 4 (2x2 boxes, the CPU demo) or 9 (the paper's)
    mask_count: int = 4  # H*: blanks per puzzle
    show_original: bool = True  # show the original puzzle above the current board
    hints: bool = False  # list candidates per empty cell (a CPU-demo aid, not the paper's prompt)

    def validate(self, key: str = "env.sudoku") -> None:
        if self.size < 4 or math.isqrt(self.size) ** 2 != self.size:
            raise ValueError(f"{key}.size: must be a square >= 4 (4, 9, ...), got {self.size}")
        if not 1 <= self.mask_count <= self.size * self.size:
            raise ValueError(f"{key}.mask_count: must be in [1, {self.size * self.size}], got {self.mask_count}")


class SudokuSpec(EnvSpec):
    config = SudokuConfig

    def build(self, section, *, max_turns, sandbox=None):
        return SudokuEnv(max_turns, show_original=section.show_original, hints=section.hints)

    def make(self, sandbox=None, **kwargs):
        return SudokuEnv(**kwargs)

    def tasks(self, section, split, n, seed):
        return generate(n, section.mask_count, size=section.size, seed=seed)

    def load(self, section, path, n):
        return load_jsonl(path, section.mask_count)[:n]

    def task_key(self, task):
        return str(task.get("puzzle"))

    def identity(self, section):
        return dataclasses.asdict(section)  # at the top of ``env``, where these keys were before sections


SPEC = SudokuSpec()

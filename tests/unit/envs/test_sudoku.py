import json
import os

import pytest

from esopt_mp.data import data_path
from esopt_mp.envs import make, registered
from esopt_mp.envs.sudoku import (count_solutions, generate, is_valid_solution, load_jsonl, render_board,
                                  save_jsonl)

SHARED = os.path.dirname(data_path("sudoku/train.jsonl"))  # shipped in esopt_mp/data


@pytest.mark.parametrize("size,blanks", [(9, 5), (9, 10), (9, 15), (4, 4), (4, 8)])
def test_generated_puzzles_are_unique_with_exact_blanks(size, blanks):
    rows = generate(12, blanks, size=size, seed=blanks)
    assert len({r["id"] for r in rows}) == 12
    for r in rows:
        assert sum(v == 0 for row in r["puzzle"] for v in row) == blanks == r["mask_count"]
        assert count_solutions(r["puzzle"]) == 1
        assert is_valid_solution(r["solution"], r["puzzle"])
    assert generate(3, blanks, size=size, seed=blanks) == rows[:3]  # deterministic


def test_bad_generator_input():
    with pytest.raises(ValueError, match="mask_count"):
        generate(1, 0)
    with pytest.raises(ValueError, match="square"):
        generate(1, 3, size=5)


def test_jsonl_roundtrip_and_paper_splits(tmp_path):
    rows = generate(5, 10, seed=2)
    save_jsonl(rows, tmp_path / "x.jsonl")
    assert load_jsonl(tmp_path / "x.jsonl") == rows
    bad = dict(rows[0], mask_count=11)
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match="mask_count"):
        load_jsonl(tmp_path / "bad.jsonl")


def test_reads_the_papers_splits_as_they_are():
    for split in ("train", "eval"):
        rows = load_jsonl(os.path.join(SHARED, f"{split}.jsonl"))
        assert len(rows) == 128
        for r in rows[::16]:
            assert is_valid_solution(r["solution"], r["puzzle"])
    assert len(load_jsonl(os.path.join(SHARED, "eval.jsonl"), mask_count=15)) == 32


def _perfect(task):
    return [f"set {r + 1} {c + 1} {task['solution'][r][c]}" for r in range(len(task["puzzle"]))
            for c in range(len(task["puzzle"])) if task["puzzle"][r][c] == 0]


@pytest.mark.parametrize("size,blanks", [(9, 15), (4, 6)])
def test_scripted_perfect_player_scores_one_within_h_turns(size, blanks):
    task = generate(1, blanks, size=size, seed=7)[0]
    env = make("sudoku")
    msgs, info = env.reset(task)
    assert info["blanks"] == blanks and "Empty cells:" in msgs[-1]["content"]
    for k, action in enumerate(_perfect(task)):
        out, reward, term, trunc, info = env.step(f"I will play: {action}")
        if k < blanks - 1:
            assert (reward, term, trunc) == (0.0, False, False) and "placed" in info["feedback"]
    assert (reward, term, info["solved"]) == (1.0, True, True) and k + 1 == blanks


def test_invalid_actions_get_their_message_and_use_a_turn():
    task = generate(1, 5, seed=3)[0]
    given = next((r, c) for r in range(9) for c in range(9) if task["puzzle"][r][c])
    blank = next((r, c) for r in range(9) for c in range(9) if not task["puzzle"][r][c])
    env = make("sudoku", max_turns=45)
    env.reset(task)
    cases = [("hello", "invalid format"), ("set 10 1 1", "out of range"), ("set 1 1 0", "out of range"),
             (f"set {given[0] + 1} {given[1] + 1} 1", "is a given"),
             (f"set {blank[0] + 1} {blank[1] + 1} {task['solution'][blank[0]][blank[1]]}", "placed"),
             (f"set {blank[0] + 1} {blank[1] + 1} 1", "already filled")]
    for turn, (text, expected) in enumerate(cases, 1):
        msgs, reward, term, trunc, info = env.step(text)
        assert expected in info["feedback"] and expected in msgs[0]["content"]
        assert env.turn == turn
    assert info["invalid_actions"] == 5


def test_budget_truncates_and_wrong_fill_scores_zero():
    task = generate(1, 2, size=4, seed=1)[0]
    env = make("sudoku", max_turns=3)
    env.reset(task)
    for _ in range(2):
        msgs, reward, term, trunc, info = env.step("nonsense")
    assert not trunc
    msgs, reward, term, trunc, info = env.step("nonsense")
    assert trunc and reward == 0.0 and not term
    env.reset(task)
    wrong = [a[:-1] + str(int(a[-1]) % 4 + 1) for a in _perfect(task)]
    for a in wrong:
        msgs, reward, term, trunc, info = env.step(a)
    assert term and reward == 0.0 and info["solved"] is False


def test_render_and_registry():
    board = generate(1, 4, size=4, seed=0)[0]["puzzle"]
    text = render_board(board)
    assert text.splitlines()[0].split() == ["1", "2", "|", "3", "4"] and "." in text
    assert {"sudoku", "math_react", "heuristic"} <= set(registered())
    with pytest.raises(ValueError, match="unknown environment"):
        make("chess")


def test_candidate_hints_and_scripted_warm_start_data():
    from transformers import AutoTokenizer

    from tools.tiny_agent import encode_examples, scripted_episode

    task = generate(1, 3, size=4, seed=1)[0]
    env = make("sudoku", hints=True, show_original=False)
    msgs, _ = env.reset(task)
    text = msgs[-1]["content"]
    assert "Original puzzle" not in text and "Candidates: " in text
    for r in range(4):
        for c in range(4):
            if task["puzzle"][r][c] == 0:
                assert f"({r + 1},{c + 1}):" in text and str(task["solution"][r][c]) in text.split(f"({r + 1},{c + 1}):")[-1][:4]
    segs = scripted_episode(task, 6, {"hints": True, "show_original": False})
    actions = [t for t, a in segs if a]
    assert len(actions) == 3 and all(a.startswith("set ") and a.endswith("<|im_end|>") for a in actions)
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..", "esopt_mp", "assets", "tiny_agent")
    tok = AutoTokenizer.from_pretrained(root)
    ids, labels = encode_examples(tok, [task], 6, {"hints": True, "show_original": False})[0]
    supervised = tok.decode([t for t, l in zip(ids, labels) if l != -100])
    assert supervised == "".join(actions) and len(ids) == len(labels)

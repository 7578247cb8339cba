"""The reasoning_gym adapter scores what the library scores, on its own seeded tasks, and survives any reply."""
import json
import os
import tomllib

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from reasoning_gym.utils import extract_answer  # noqa: E402

from esopt_mp.envs.libs.reasoning_gym import (  # noqa: E402
    LINE_PROMPT, ReasoningGymConfig, ReasoningGymEnv, last_answer_span, read_answer)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def roundtrip(tasks):
    """Tasks as the runtime ships them (JSON)."""
    return json.loads(json.dumps(tasks))


def library_entry(task):
    """The task's entry straight from the library, from the seed and size it records."""
    src = task["source"]
    ds = reasoning_gym.create_dataset(src["dataset"], seed=src["seed"], size=src["size"], **src["config"])
    return ds[src["index"]], ds


def play(task, *replies, **section):
    env = ReasoningGymEnv(**section)
    messages, _ = env.reset(task)
    return env, messages, [env.step(r) for r in replies]


@pytest.mark.parametrize("dataset", ["leg_counting", "basic_arithmetic", "arc_agi"])
def test_oracle_answers_score_what_the_library_scores(dataset):
    """The entry's own answer, as the prompt asks for it, scores the library's score of it: 1."""
    for task in roundtrip(ReasoningGymEnv.tasks("train", 2, 5, dataset=dataset)):
        entry, ds = library_entry(task)
        assert (task["question"], task["answer"]) == (entry["question"], entry["answer"])
        env, messages, [(_, reward, terminated, _, info)] = play(task, f"Thinking.\n<answer>{task['answer']}</answer>",
                                                                 dataset=dataset)
        assert "<answer>" in messages[0]["content"] and messages[1]["content"] == entry["question"]
        assert reward == ds.score_answer(task["answer"], entry) == 1.0 and terminated and info["correct"]


def test_entries_json_changed_are_rebuilt_for_the_scorer():
    """arc_agi's scorer compares its metadata's tuples: the JSON form of an entry would score its own answer 0.05."""
    task = roundtrip(ReasoningGymEnv.tasks("train", 1, 0, dataset="arc_agi"))[0]
    entry, ds = library_entry(task)
    assert task["rebuild"] and ds.score_answer(task["answer"], task) < ds.score_answer(task["answer"], entry) == 1.0
    env, _, [(_, reward, *_)] = play(task, f"<answer>{task['answer']}</answer>", dataset="arc_agi")
    assert env.rebuilt and reward == 1.0


def test_wrong_answers_score_what_the_library_scores():
    task = roundtrip(ReasoningGymEnv.tasks("train", 1, 3, dataset="leg_counting"))[0]
    entry, ds = library_entry(task)
    for answer in ["0", f"{task['answer']}0", "many legs", f"{task['answer']} legs"]:
        _, _, [(_, reward, terminated, _, info)] = play(task, f"<answer>{answer}</answer>")
        assert reward == ds.score_answer(answer, entry) < 1.0 and terminated and info["answer"] == answer
    partial = ds.score_answer(f"{task['answer']}0", entry)
    assert 0 < partial < 1  # the library's partial credit reaches the reward as it is


def test_tasks_are_deterministic_per_seed_and_differ_between_seeds_and_splits():
    train = ReasoningGymEnv.tasks("train", 8, 0, dataset="basic_arithmetic")
    assert train == ReasoningGymEnv.tasks("train", 8, 0, dataset="basic_arithmetic") == roundtrip(train)
    other = ReasoningGymEnv.tasks("train", 8, 1, dataset="basic_arithmetic")
    held = ReasoningGymEnv.tasks("eval", 16, 1, dataset="basic_arithmetic")  # what the runtime asks for
    questions = {t["question"] for t in train}
    # entry i of the library's seed s is entry i - 1 of seed s + 1: consecutive seeds must not mean neighbouring ones
    assert not questions & {t["question"] for t in other} and not questions & {t["question"] for t in held}
    assert len({t["id"] for t in train + other + held}) == 32


def test_dataset_settings_reach_the_generator():
    tasks = ReasoningGymEnv.tasks("train", 6, 0, dataset="leg_counting", config={"min_animals": 2, "max_animals": 2})
    assert {t["metadata"]["num_animals"] for t in tasks} == {2}
    entry, _ = library_entry(tasks[0])
    assert entry["question"] == tasks[0]["question"]


def test_composite_mixes_datasets_by_weight():
    weights = {"leg_counting": 1.0, "basic_arithmetic": 3.0}
    tasks = roundtrip(ReasoningGymEnv.tasks("train", 400, 2, dataset="composite", weights=weights,
                                            config={"leg_counting": {"max_animals": 3}}))
    counts = {name: sum(t["dataset"] == name for t in tasks) for name in weights}
    # the library's own draw: binomial(400, 1/4) for leg_counting, whose sd is 8.7
    assert sum(counts.values()) == 400 and abs(counts["leg_counting"] - 100) < 35
    assert all(t["metadata"]["num_animals"] <= 3 for t in tasks if t["dataset"] == "leg_counting")
    for task in tasks[:6]:
        _, _, [(_, reward, *_)] = play(task, f"<answer>{task['answer']}</answer>", dataset="composite",
                                       weights=weights)
        assert reward == 1.0


def test_attempts_give_feedback_and_the_final_attempt_scores():
    task = roundtrip(ReasoningGymEnv.tasks("train", 1, 4, dataset="leg_counting"))[0]
    right = f"<answer>{task['answer']}</answer>"
    _, _, steps = play(task, "I do not know", "<answer>0</answer>", right, attempts=3, max_turns=3)
    (m1, r1, t1, tr1, i1), (m2, r2, t2, tr2, _), (m3, r3, t3, tr3, i3) = steps
    assert "No <answer>" in m1[0]["content"] and "2 attempts left" in m1[0]["content"] and m1[0]["role"] == "user"
    assert "scored 0.00" in m2[0]["content"] and "1 attempt left" in m2[0]["content"]
    assert (r1, r2, r3) == (0.0, 0.0, 1.0) and (t1, t2, t3) == (False, False, True) and not (tr1 or tr2 or tr3)
    assert m3 == [] and i3["attempt"] == 3 and i1["answer"] is None
    # a right answer ends the episode at once; used-up attempts end it with the last attempt's score
    _, _, [(_, reward, terminated, *_)] = play(task, right, attempts=3)
    assert reward == 1.0 and terminated
    near = f"<answer>{task['answer']}0</answer>"
    _, _, steps = play(task, "<answer>0</answer>", near, attempts=2)
    entry, ds = library_entry(task)
    assert [s[2] for s in steps] == [False, True] and steps[-1][1] == ds.score_answer(f"{task['answer']}0", entry) > 0
    # the runtime's turn cap truncates an episode with attempts left
    _, _, steps = play(task, "<answer>0</answer>", "<answer>1</answer>", attempts=5, max_turns=2)
    assert [(s[2], s[3]) for s in steps] == [(False, False), (False, True)]
    # ... and its last message asks for no attempt past the cap
    assert "(1 attempt left)" in steps[0][0][0]["content"]
    assert steps[1][0][0]["content"] == "Your answer scored 0.00 out of 1, so it is not correct. Out of turns (2/2): " \
                                        "the episode is over."


def test_the_last_answer_is_read_as_the_library_reads_it():
    for text in ["<answer>1</answer> then <answer> 2 </answer>", "<answer>a<answer>b</answer>", "no tags",
                 "<answer>x</answer></answer><answer>", "<answer></answer>", "<answer>\n\nmulti\nline\n</answer>",
                 "</answer><answer>y</answer><answer>z"]:
        span = last_answer_span(text)
        assert (extract_answer(text[span[0]:span[1]]) if span else None) == extract_answer(text), text


def test_hostile_replies_do_not_raise():
    task = roundtrip(ReasoningGymEnv.tasks("train", 1, 0, dataset="leg_counting"))[0]
    right = f"<answer>{task['answer']}</answer>"
    for text in ["", "x" * 2_000_000, "\x00\xff\ud800\udfff" * 10_000, "<answer>" * 200_000,
                 "<answer>1</answer>" * 50_000, "</answer>" * 100_000, "<answer>" + "9" * 10_000 + "</answer>"]:
        _, _, [(_, reward, terminated, _, info)] = play(task, text)
        assert 0.0 <= reward < 1.0 and terminated and len(info["answer"] or "") <= 200
    _, _, [(_, reward, *_)] = play(task, "<answer>1</answer>" * 50_000 + right)
    assert reward == 1.0


def test_a_scorer_raising_on_the_answer_scores_zero():
    task = roundtrip(ReasoningGymEnv.tasks("train", 1, 0, dataset="prime_factorization"))[0]
    entry, ds = library_entry(task)
    with pytest.raises(ValueError):
        ds.score_answer("two times three", entry)  # the library's own scorer raises on it
    _, _, [(_, reward, terminated, _, info)] = play(task, "<answer>two times three</answer>",
                                                    dataset="prime_factorization")
    assert reward == 0.0 and terminated and "ValueError" in info["score_error"]


@pytest.mark.parametrize("section,match", [
    ({"dataset": "leg_countin"}, r"no dataset 'leg_countin' \(close: leg_counting"),
    ({"config": {"max_animal": 3}}, r"leg_counting has no setting 'max_animal'; its settings: max_animals"),
    ({"config": {"seed": 3}}, r"config\.seed: set by the task source"),
    ({"config": {"min_animals": 0}}, r"leg_counting refuses"),
    ({"weights": {"leg_counting": 1}}, r"weights: set only with dataset=composite"),
    ({"dataset": "composite"}, r"needs weights"),
    ({"dataset": "composite", "weights": {"leg_counting": 0}}, r"weights\.leg_counting: must be a positive"),
    ({"dataset": "composite", "weights": {"leg_counting": 1}, "config": {"chain_sum": {}}}, r"config\.chain_sum"),
    ({"attempts": 0}, r"attempts: must be >= 1"),
    ({"system_prompt": "Be brief."}, r"system_prompt: one of"),
    ({"answer_format": "number"}, r"answer_format: one of tags, line, lenient"),
    ({"answer_format": "line", "system_prompt": "direct"}, r"system_prompt: with answer_format=line"),
])
def test_bad_sections_fail_with_one_line(section, match):
    with pytest.raises(ValueError, match=match) as e:
        ReasoningGymConfig(**section).validate("env.reasoning_gym")
    assert "\n" not in str(e.value) and str(e.value).startswith("env.reasoning_gym")


def test_the_extra_installs_what_the_adapter_requires():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert set(ReasoningGymEnv.requires.values()) <= set(extras[ReasoningGymEnv.extra])


def test_a_held_out_question_equal_to_a_training_question_is_dropped():
    """The runtime compares tasks by the adapter's task_key (dataset, question, answer), not by id or seed."""
    from esopt_mp.config import build_config

    cfg = build_config({"env": {"name": "reasoning_gym", "n_train": 8, "n_eval": 8, "episodes_per_step": 2,
                                "reasoning_gym": {"dataset": "leg_counting",
                                                  "config": {"min_animals": 1, "max_animals": 1,
                                                             "min_instances": 1, "max_instances": 1}}}})
    train, held = cfg.env.spec.splits(cfg.env, cfg.env.section)
    seen = {(t["question"], t["answer"]) for t in train}
    assert held and not [t for t in held if (t["question"], t["answer"]) in seen]


@pytest.mark.parametrize("text,line,lenient", [
    ("3 + 4 is 7.\nAnswer: 7", "7", "7"),
    ("Answer: 5\nwait, that is wrong.\n**Answer:** 8.", "8", "8"),
    ("answer = 12", "12", "12"),
    ("> Answer: *seven*", "seven", "seven"),
    ("The sum of 3 and 4 is 7.", None, "7"),
    ("It is 1,024 or -3.5", None, "-3.5"),
    ("Answer:\nno number here", None, None),
    ("<answer>9</answer>", None, "9"),
    ("", None, None),
])
def test_the_answer_line_and_the_last_number_are_read(text, line, lenient):
    assert read_answer(text, "line") == line
    assert read_answer(text, "lenient") == lenient
    assert read_answer("<answer>4</answer>\nAnswer: 5", "tags") == "4"


@pytest.mark.parametrize("fmt", ["line", "lenient"])
def test_an_answer_line_scores_the_library_s_score_and_form_alone_scores_nothing(fmt):
    task = roundtrip(ReasoningGymEnv.tasks("train", 1, 3, dataset="basic_arithmetic"))[0]
    entry, ds = library_entry(task)
    env, messages, [(_, reward, terminated, _, info)] = play(task, f"Let me add.\nAnswer: {task['answer']}",
                                                             dataset="basic_arithmetic", answer_format=fmt)
    assert messages[0]["content"] == LINE_PROMPT and reward == 1.0 and terminated and info["correct"]
    wrong = str(int(task["answer"]) + 1)
    _, _, [(_, reward, *_)] = play(task, f"Answer: {wrong}", dataset="basic_arithmetic", answer_format=fmt)
    assert reward == ds.score_answer(wrong, entry) < 1.0
    # a reply in the right form with no answer in it scores what the library gives nothing
    _, _, [(_, reward, *_)] = play(task, "Answer: I am not sure", dataset="basic_arithmetic", answer_format=fmt)
    assert reward == ds.score_answer("I am not sure", entry) == 0.0
    # the library's own tags are not this format's form (unless lenient finds the number inside them)
    _, _, [(_, reward, *_)] = play(task, f"<answer>{task['answer']}</answer>", dataset="basic_arithmetic",
                                   answer_format=fmt)
    assert reward == (1.0 if fmt == "lenient" else 0.0)


def test_feedback_names_the_answer_line_when_that_is_the_format():
    task = roundtrip(ReasoningGymEnv.tasks("train", 1, 4, dataset="leg_counting"))[0]
    _, _, steps = play(task, "I do not know", "Answer: 0", attempts=3, max_turns=3, answer_format="line")
    assert 'No final "Answer: ..." line' in steps[0][0][0]["content"]
    assert 'as a final line "Answer: <your answer>"' in steps[1][0][0]["content"]
    assert "<answer>" not in steps[0][0][0]["content"] + steps[1][0][0]["content"]

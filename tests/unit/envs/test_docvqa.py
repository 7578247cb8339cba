"""DocVQA scoring against hand-computed cases, answer extraction, the generator and the JSONL loader.

The environment itself (bash + tesseract in the sandbox) is tested in test_docvqa_sandbox.py."""
import json
import os

import pytest

from esopt_mp.envs.anls import anls, extract_final_answer, levenshtein, nls, normalize
from esopt_mp.identity import config_hash


def test_normalize():
    assert normalize("  INV-82935 ") == "inv 82935"
    assert normalize("$1,234.50") == "1 234 50"
    assert normalize("Grace\t\nSMITH!!") == "grace smith"
    assert normalize("...") == ""


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0


def test_anls_exact_case_and_punctuation():
    assert anls("Total", ["total"]) == 1.0
    assert anls("inv 82935", ["INV-82935"]) == 1.0
    assert anls("1 234 50", ["$1,234.50"]) == 1.0


def test_anls_threshold_just_under_and_over_half():
    assert nls("abcdxyz", "abcdefg") == pytest.approx(4 / 7)  # d = 3/7 = 0.43 < 0.5: 1 - d
    assert nls("abcwxyz", "abcdefg") == 0.0  # d = 4/7 = 0.57
    assert nls("abxy", "abcd") == 0.0  # d = 0.5 exactly: not < 0.5
    assert nls("sitting", "kitten") == pytest.approx(4 / 7)  # insertions count too, over the longer string


def test_anls_several_answers_takes_the_best():
    # "jon smith" vs "john smith": 1 edit / 10 -> 0.9; vs "mr smith": 3 edits / 9 -> 0.667
    assert nls("Jon Smith", "Mr. Smith") == pytest.approx(1 - 3 / 9)
    assert anls("Jon Smith", ["Mr. Smith", "John Smith"]) == pytest.approx(0.9)
    assert anls("Madison", ["Springfield", "Clinton"]) == 0.0


def test_anls_empty_prediction():
    assert anls("", ["abc"]) == 0.0
    assert anls("?!", ["abc"]) == 0.0  # nothing left after normalisation
    assert anls(None, ["abc"]) == 0.0


def test_anls_empty_accepted_answers_and_full_width_characters():
    assert anls(".", [""]) == 0.0 and anls("", [""]) == 0.0  # an empty accepted answer accepts nothing
    assert anls("abc", ["", "abd"]) == pytest.approx(2 / 3)  # skipped, the others still count
    assert nls("!", "?") == 0.0
    assert anls("１２３", ["123"]) == 1.0 and anls("ＩＮＶ－７", ["inv 7"]) == 1.0  # NFKC before normalising
    assert normalize("Ｆｕｌｌ　Ｗｉｄｔｈ") == "full width"


def test_extract_final_answer():
    assert extract_final_answer("think\nFinal answer: 42\nmore\nAnswer: 43") == "43"  # the last line counts
    assert extract_final_answer("Final answer：Madison") == "Madison"  # full-width colon
    assert extract_final_answer("**Final Answer:** Grace Smith") == "Grace Smith"
    assert extract_final_answer("answer:  INV-1  ") == "INV-1"
    assert extract_final_answer("The answer is 5") is None
    assert extract_final_answer("my Answer: 5 is inline") is None  # must start the line


def test_generator_is_seeded_and_answers_are_on_the_page(tmp_path):
    from esopt_mp.envs.docvqa_gen import generate

    a, b = generate(12, str(tmp_path / "a"), seed=3), generate(12, str(tmp_path / "b"), seed=3)
    assert [(r["question"], r["answers"]) for r in a] == [(r["question"], r["answers"]) for r in b]
    assert open(a[0]["image"], "rb").read() == open(b[0]["image"], "rb").read()
    c = generate(12, str(tmp_path / "c"), seed=4)
    assert [r["answers"] for r in a] != [r["answers"] for r in c]
    kinds = {r["question"].split()[1] for r in a}
    assert len(kinds) >= 3 and all(r["answers"] and os.path.isfile(r["image"]) for r in a)


def test_loader_reads_docvqa_jsonl_and_refuses_a_missing_image(tmp_path):
    from esopt_mp.envs.docvqa import load_jsonl
    from esopt_mp.envs.docvqa_gen import generate, write_jsonl

    rows = generate(3, str(tmp_path / "docs"), seed=0)
    path = str(tmp_path / "val.jsonl")
    write_jsonl(rows, path)
    got = load_jsonl(path)
    assert [r["answers"] for r in got] == [r["answers"] for r in rows]
    assert all(os.path.samefile(g["image"], r["image"]) for g, r in zip(got, rows))
    # the public DocVQA field names: questionId, a relative image path, several answers
    with open(path, "a") as f:
        f.write(json.dumps({"questionId": 49153, "question": "q?", "answers": ["a", "A."],
                            "image": "documents/missing.png"}) + "\n")
    with pytest.raises(FileNotFoundError, match="row 49153: image .*documents/missing.png does not exist"):
        load_jsonl(path)
    image = os.path.relpath(rows[0]["image"], tmp_path)
    for i, answers in enumerate(([""], [None, "3"], ["ok", 3], ["-"])):  # empty, not strings, nothing left
        bad = str(tmp_path / f"bad{i}.jsonl")
        with open(bad, "w") as f:
            f.write(json.dumps({"id": f"r{i}", "question": "q?", "answers": answers, "image": image}) + "\n")
        with pytest.raises(ValueError, match=rf"row r{i}: accepted answers must be strings with a letter or digit"):
            load_jsonl(bad)


def test_clip_keeps_head_and_tail_with_a_marker():
    from esopt_mp.envs.docvqa import clip

    assert clip("short", 10) == "short"
    text = "A" * 50 + "m" * 100 + "Z" * 50
    out = clip(text, 100)
    assert out == "A" * 50 + "\n[... 100 characters elided ...]\n" + "Z" * 50


def test_make_docvqa_is_registered():
    from esopt_mp.envs import registered

    assert "docvqa" in registered()


def test_config_section_validated_with_the_key_named():
    from esopt_mp.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=r"env\.docvqa\.observation_chars: must be >= 1"):
        build_config({"env": {"name": "docvqa", "docvqa": {"observation_chars": 0}}})
    with pytest.raises(ConfigError, match=r"env\.docvqa\.tesseract: '/nonexistent/tesseract' not found"):
        build_config({"env": {"name": "docvqa", "docvqa": {"tesseract": "/nonexistent/tesseract"}}})
    with pytest.raises(ConfigError, match=r"unknown config key 'env\.docvqa\.ocr'"):
        build_config({"env": {"name": "docvqa", "docvqa": {"ocr": "x"}}})
    # only the docvqa environment checks its section (no tesseract needed elsewhere), and other envs' hashes ignore it
    a = build_config({"env": {"docvqa": {"tesseract": "/nonexistent/tesseract"}}})
    assert config_hash(a, None) == config_hash(build_config({}), None)


def test_envs_never_import_agent_models_engine_or_parallel():
    """The dependency rule: tool-call parsing lives in chat/toolcalls.py, below both envs and the agent."""
    import ast

    import esopt_mp.envs

    root = os.path.dirname(esopt_mp.envs.__file__)
    bad = []
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                tree = ast.parse(open(os.path.join(d, f)).read())
                mods = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
                mods += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
                bad += [(f, m) for m in mods if m.split(".")[:2] in (["esopt_mp", "agent"], ["esopt_mp", "models"],
                                                                     ["esopt_mp", "engine"], ["esopt_mp", "parallel"])]
    assert not bad
    from esopt_mp.chat.toolcalls import build_parser
    from esopt_mp.envs.toolcalls import build_parser as envs_build_parser

    assert build_parser is envs_build_parser

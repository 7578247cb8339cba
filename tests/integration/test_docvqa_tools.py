"""DocVQA's image tool as the sandbox runs it (a child interpreter), and the docvqa_4b profile's tasks (its
tesseract resolved against what the sandbox shows, which starts the interpreter)."""
import os

import pytest


def _imgtool(*args):
    import subprocess
    import sys

    tool = os.path.join(os.path.dirname(__file__), "..", "..", "esopt_mp", "envs", "docvqa_imgtool.py")
    return subprocess.run([sys.executable, "-I", tool, *args], capture_output=True, text=True, timeout=60)


def test_imgtool_crop_clips_past_the_edge_and_refuses_an_inverted_box_in_one_line(tmp_path):
    from PIL import Image

    src, out = str(tmp_path / "in.png"), str(tmp_path / "out.png")
    Image.new("L", (40, 30), 255).save(src)
    p = _imgtool("crop", src, out, "20", "10", "100", "100")
    assert p.returncode == 0 and Image.open(out).size == (20, 20)  # clipped to the page, not padded
    for box in (("30", "10", "10", "20"), ("50", "0", "60", "10"), ("0", "x", "1", "1")):  # inverted, outside, junk
        p = _imgtool("crop", src, out, *box)
        assert p.returncode == 1 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert p.stderr.startswith("imgtool"), p.stderr
    p = _imgtool("info", str(tmp_path / "missing.png"))
    assert p.returncode == 1 and "Traceback" not in p.stderr and "missing.png" in p.stderr


@pytest.mark.skipif(__import__("shutil").which("tesseract") is None,
                    reason="tesseract not installed (apt-get install tesseract-ocr fonts-dejavu-core)")
def test_docvqa_4b_profile_has_the_paper_values_and_generates_tasks(tmp_path):
    from esopt_mp.agent.episodes import load_tasks
    from esopt_mp.config import build_config
    from tests.fixtures.configs import compose_config

    cfg = build_config(compose_config("+experiment=docvqa_4b", "env.n_train=8", "env.n_eval=4",
                                      "env.episodes_per_step=4", f"env.docvqa.gen_dir={tmp_path}"), 1)
    e = cfg.engine
    assert (cfg.env.name, cfg.env.max_turns, cfg.env.eval_repeats, cfg.env.max_episode_tokens) == ("docvqa", 50, 4,
                                                                                                    32768)
    assert (e.temperature, e.top_k, e.presence_penalty, e.max_new_tokens, e.max_model_len) == (1.0, 40, 2.0, 512, 32768)
    assert 50 * 30 <= cfg.env.episode_timeout_s < cfg.parallel.timeout_s  # 50 turns fit; the dp wait outlasts it
    train, held = load_tasks(cfg.env)
    assert len(train) == 8 and len(held) == 4 and all(os.path.dirname(t["image"]) == str(tmp_path) for t in train)
    assert not {t["image"] for t in train} & {t["image"] for t in held}


def test_env_docvqa_overrides_build_where_tesseract_is_installed():
    """The env.docvqa section composed from plain overrides builds, its tesseract found where the sandbox shows it
    (checking that starts the interpreter the sandbox runs)."""
    import shutil

    from esopt_mp.config import build_config
    from tests.fixtures.configs import compose_config

    if not shutil.which("tesseract"):
        pytest.skip("tesseract not installed (apt-get install tesseract-ocr)")
    cfg = build_config(compose_config("env.name=docvqa", "env.docvqa.observation_chars=123", "env.sandbox.wall_s=5"), 1)
    assert cfg.env.docvqa.observation_chars == 123 and cfg.env.sandbox.wall_s == 5

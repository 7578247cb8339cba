import json
import os

import re

import pytest
from omegaconf import OmegaConf
from esopt_mp.agent.episodes import load_tasks
from esopt_mp.config import ConfigError, build_config, open_sections
from esopt_mp.data import resolve
from esopt_mp.identity import config_hash
from tests.fixtures.configs import compose_config

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")




def test_embedded_default_composes():
    cfg = build_config(compose_config(), 1)
    # the embedded default's config hash as it was before environments had their own sections: its runs resume
    assert config_hash(cfg) == "e7cd39145205692f"
    assert cfg.model.path == "builtin:tiny_agent" and cfg.objective.name == "agent" and cfg.env.sudoku.hints
    fast = build_config(compose_config("model=tiny", "objective=target_logprob"), 1)
    assert fast.model.path is None and fast.objective.name == "target_logprob"
    assert os.path.isfile(os.path.join(os.path.dirname(__file__), "..", "..", "esopt_mp", "assets", "tiny_agent",
                                       "model.safetensors"))


@pytest.mark.parametrize("name,env,population", [("sudoku_4b", "sudoku", 32), ("sudoku_4b_h10", "sudoku", 32),
                                                 ("sudoku_4b_h15", "sudoku", 32), ("math_4b", "math_react", 16),
                                                 ("ahd_bpp", "heuristic", 16)])
def test_experiment_profiles(name, env, population, monkeypatch, tmp_path):
    """The profiles validate from a directory with no ../shared beside it: their data ships in the package."""
    monkeypatch.delenv("ESOPT_DATA", raising=False)
    work = tmp_path / "clone" / "cwd"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    assert not os.path.exists(os.path.join("..", "shared"))
    cfg = build_config(compose_config(f"+experiment={name}"), 1)
    assert (cfg.env.name, cfg.es.population, cfg.model.dtype, cfg.es.master) == (env, population, "bfloat16", "fp32_host")
    if cfg.env.train_path is not None:
        assert cfg.env.train_path.startswith("data:")  # the hash sees the same string on every machine
        assert os.path.isfile(resolve(cfg.env.train_path)) and os.path.isfile(resolve(cfg.env.eval_path))
    assert len(config_hash(cfg)) == 16  # the trainer hashes the training tasks by content: data: paths resolve
    if name == "math_4b":  # Mean@4 / Pass@4 over samples drawn at the training temperature
        assert (cfg.env.eval_repeats, cfg.env.eval_temperature, cfg.engine.temperature) == (4, 1.0, 1.0)
    if name.startswith("sudoku"):
        hstar = {"sudoku_4b": 5, "sudoku_4b_h10": 10, "sudoku_4b_h15": 15}[name]
        assert (cfg.env.sudoku.mask_count, cfg.env.max_turns) == (hstar, 3 * hstar)
        assert cfg.es.sigma.start == (7e-4 if hstar == 15 else 1e-3)
        train, held = load_tasks(cfg.env)
        assert len(train) == 32 and len(held) == 32 and all(t["mask_count"] == hstar for t in train)


def test_esopt_data_overrides_the_shipped_root(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ESOPT_DATA", str(tmp_path / "mine"))
    with pytest.raises(ConfigError, match=r"env.train_path: no data file 'math/dapo_evolve.jsonl' under \$ESOPT_DATA"):
        build_config(compose_config("+experiment=math_4b"), 1)
    for split, first in (("dapo_evolve", 0), ("dapo_test", 100)):
        rows = [{"id": f"q{i}", "question": f"What is {i} + 1?", "answer": str(i + 1)}
                for i in range(first, first + 20)]
        path = tmp_path / "mine" / "math" / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = build_config(compose_config("+experiment=math_4b", "env.n_train=16", "env.n_eval=4"), 1)
    assert resolve(cfg.env.train_path) == str(tmp_path / "mine" / "math" / "dapo_evolve.jsonl")
    train, _ = load_tasks(cfg.env)
    assert [t["id"] for t in train] == [f"q{i}" for i in range(16)]


def test_webarena_profiles_validate():
    """The paper's setting (G=8, sigma 1.5e-3 constant, alpha 2.5e-4, 70 steps) and the CPU demo variant."""
    cfg = build_config(compose_config("+experiment=webarena_27b"), 4)
    assert (cfg.env.name, cfg.es.population, cfg.es.steps, cfg.es.mirrored) == ("webarena_lite", 8, 70, False)
    assert (cfg.es.sigma.kind, cfg.es.sigma.start, cfg.es.alpha.start) == ("constant", 1.5e-3, 2.5e-4)
    assert (cfg.env.webarena_lite.suite, cfg.env.webarena_lite.split, cfg.env.webarena_lite.max_browsers) == ("webarena_lite", "all", 8)
    tiny = build_config(compose_config("+experiment=webarena_tiny"), 1)
    assert (tiny.env.webarena_lite.suite, tiny.model.path) == ("demo", "builtin:tiny_agent")
    train, held = load_tasks(tiny.env)
    assert len(train) == 4 and len(held) == 2 and not {t["id"] for t in train} & {t["id"] for t in held}


def test_env_sections_and_absent_keys_compose_from_plain_overrides():
    """``env.name=docvqa env.docvqa.tesseract=...`` (any environment's section, present in the tree or not) and any
    dataclass field the YAML does not write (its default) are plain overrides, not "Key ... is not in struct"."""
    raw = compose_config("env.name=docvqa", "env.docvqa.observation_chars=123", "env.webarena_lite.max_browsers=2",
                   "env.sandbox.wall_s=5", "env.episode_timeout_s=900", "env.env_workers=3", "es.weight_decay=0.1",
                   "run.keep_checkpoints=0", "run.seed=7", "parallel.timeout_s=60", "model.tiny.head_dim=32")
    assert (raw["env"]["docvqa"]["observation_chars"], raw["env"]["webarena_lite"]["max_browsers"],
            raw["env"]["sandbox"]["wall_s"], raw["env"]["episode_timeout_s"], raw["es"]["weight_decay"],
            raw["run"]["keep_checkpoints"], raw["run"]["seed"], raw["parallel"]["timeout_s"],
            raw["model"]["tiny"]["head_dim"]) == (123, 2, 5, 900, 0.1, 0, 7, 60, 32)
    cfg = build_config(compose_config("env.name=math_react"), 1)
    assert config_hash(build_config(cfg.to_dict(), 1)) == config_hash(cfg)  # config.json rebuilds the run


def test_group_files_write_only_what_differs_from_the_dataclass_defaults():
    """Defaults are written once, in the dataclasses: a group file that repeats one would drift from it unseen."""
    import dataclasses
    import glob

    from esopt_mp.config import TrainConfig

    defaults = TrainConfig().to_dict()
    kept = {"name", "run.dir"}  # a group's name says which it is; config.yaml names the default run.dir
    whole = {".es.sigma", ".es.alpha"}  # a schedule is one value: a partial one would fill from another default

    def repeated(tree, dflt, prefix):
        for k, v in tree.items():
            key = f"{prefix}.{k}"
            if isinstance(v, dict) and isinstance(dflt.get(k), dict) and key not in whole:
                yield from repeated(v, dflt[k], key)
            elif k in dflt and v == dflt[k] and key.split(".", 1)[1] not in kept and k != "name":
                yield key

    found = []
    for path in glob.glob(os.path.join(CONFIGS, "*", "*.yaml")) + [os.path.join(CONFIGS, "config.yaml")]:
        group = os.path.basename(os.path.dirname(path))
        if group == "experiment":  # a profile states a paper's settings whole, defaults included
            continue
        tree = OmegaConf.to_container(OmegaConf.load(path)) or {}
        tree = {k: v for k, v in tree.items() if k not in ("defaults", "hydra")}
        if group == "configs":
            found += [f"config.yaml:{k[1:]}" for k in repeated(tree, defaults, "")]
        else:
            found += [f"{group}/{os.path.basename(path)}:{k[1:]}" for k in repeated({group: tree}, defaults, "")]
    found = [f for f in found if not f.endswith("env.sudoku.size")]  # kept: the unused section other envs carry
    assert not found, f"YAML repeats dataclass defaults: {found}"
    assert dataclasses.asdict(build_config(compose_config(), 1).prompt) == dataclasses.asdict(
        __import__("esopt_mp.prompt.config", fromlist=["PromptConfig"]).PromptConfig())


def test_es_seed_is_refused_naming_run_seed():
    """The run seed is every trainer's (ES members, tasks, episodes, evaluation): ``run.seed``, hashed as before."""
    for call in (lambda: open_sections(["es.seed=3"]), lambda: open_sections(["++es.seed=3"]),
                 lambda: build_config({"es": {"seed": 3}})):
        with pytest.raises(ConfigError, match=r"^es\.seed is now run\.seed \(the run seed of every trainer"):
            call()
    assert config_hash(build_config({"run": {"seed": 0}})) == "c999d5ed83fd066a"  # runs from before keep theirs
    assert config_hash(build_config({"run": {"seed": 3}})) != "c999d5ed83fd066a"
    assert build_config(compose_config("run.seed=3"), 1).run.seed == 3


def test_a_key_that_moved_into_its_environments_section_names_the_new_spelling():
    from esopt_mp.envs.config import EnvConfig

    for old, new in (("env.mask_count=5", "env.sudoku.mask_count"), ("env.problem=tsp_aco", "env.heuristic.problem"),
                     ("env.web.max_browsers=2", "env.webarena_lite.max_browsers")):
        with pytest.raises(ConfigError, match=f"is now {new}"):
            open_sections([old])
    with pytest.raises(ConfigError, match=r"env.hints is now env.sudoku.hints"):
        build_config({"env": {"hints": True}})
    with pytest.raises(ConfigError, match=r"env.web is now env.webarena_lite"):
        build_config({"env": {"web": {"max_browsers": 2}}})
    with pytest.raises(ConfigError, match=r"unknown config key 'env.sudoku.sizes'"):
        build_config({"env": {"sudoku": {"sizes": 9}}})
    assert build_config({"env": {"sudoku": {"size": 9, "mask_count": 5}}}).env.sudoku.size == 9
    assert EnvConfig().sudoku.mask_count == 4


def test_prompt_section_composes_from_plain_overrides():
    """``prompt.optimiser=skill prompt.skill.url=...`` are plain overrides though no YAML writes the section."""
    assert "prompt" not in compose_config()  # its defaults are PromptConfig's, written once
    cfg = build_config(compose_config("prompt.optimiser=skill", "prompt.skill.proposer=endpoint", "prompt.skill.model=m",
                                "prompt.skill.url=http://127.0.0.1:9", "prompt.skill.timeout_s=5"), 1)
    assert (cfg.prompt.optimiser, cfg.prompt.skill.url, cfg.prompt.skill.timeout_s) == ("skill", "http://127.0.0.1:9", 5)
    assert config_hash(build_config(compose_config(), 1)) == config_hash(build_config(compose_config("prompt.optimiser=none"), 1))


def test_an_env_docvqa_override_reaches_the_config_check():
    """``env.name=docvqa env.docvqa.tesseract=...`` as launch/train.py takes it (open_sections, Hydra, build_config):
    the key reaches the check that names it, not Hydra's "not in struct"."""
    with pytest.raises(ConfigError, match=r"^env\.docvqa\.tesseract: '/nonexistent/tesseract' not found; install it"):
        build_config(compose_config("env.name=docvqa", "env.docvqa.tesseract=/nonexistent/tesseract"), 1)


def test_greedy_repeats_are_refused_naming_the_keys():
    with pytest.raises(ConfigError, match=r"env\.eval_repeats: 4 samples per question with env\.eval_temperature=0"):
        build_config(compose_config("env.eval_repeats=4"), 1)
    assert build_config(compose_config("env.eval_repeats=4", "env.eval_temperature=0.7"), 1).env.eval_repeats == 4


@pytest.mark.parametrize("arg, known", [("engine.top_pp=0.9", "engine.top_p"), ("env.sandbox.wal_s=5",
                                        "env.sandbox.wall_s"), ("es.sigma.strat=0.1", "es.sigma.start"),
                                        ("es.populaton=8", "es.population")])
def test_a_misspelt_key_of_a_section_is_refused_by_name_not_by_hydras_struct_error(arg, known):
    """One line naming the key and the closest spelling, then the section's keys."""
    key = re.escape(arg.split("=")[0])
    with pytest.raises(ConfigError, match=rf"^unknown config key '{key}' \(did you mean '{re.escape(known)}'\?\); "
                                          rf"known keys here: \[.*'{known.rsplit('.', 1)[1]}'"):
        build_config(compose_config(arg), 1)


def test_the_real_model_profile_builds_and_scores_the_answer_line():
    """smollm2_arith: SmolLM2 from its PyPI package on one-digit arithmetic read from an "Answer:" line."""
    pytest.importorskip("reasoning_gym")
    cfg = build_config(compose_config("+experiment=smollm2_arith"), 1)
    assert cfg.model.path == "pypi:smollm2-135m-instruct" and cfg.env.name == "reasoning_gym"
    section = cfg.env.sections["reasoning_gym"]
    assert section.answer_format == "lenient" and section.config["max_digits"] == 1
    assert (cfg.es.population, cfg.env.episodes_per_step, cfg.env.max_turns) == (8, 8, 1)
    gcd = build_config(compose_config("+experiment=smollm2_gcd"), 1)  # the second dataset, the same ES settings
    section = gcd.env.sections["reasoning_gym"]
    assert section.dataset == "gcd" and section.config["max_value"] == 20 and section.answer_format == "lenient"
    assert (gcd.es.population, gcd.es.sigma.start, gcd.es.alpha.start) == (8, cfg.es.sigma.start, cfg.es.alpha.start)
    letters = build_config(compose_config("+experiment=smollm2_letters"), 1)  # the third: the library's default sizes
    section = letters.env.sections["reasoning_gym"]
    assert section.dataset == "letter_counting" and not section.config and section.answer_format == "lenient"
    assert (letters.es.population, letters.es.sigma.start) == (8, cfg.es.sigma.start)
    products = build_config(compose_config("+experiment=smollm2_products"), 1)  # the fourth: one-digit factors
    section = products.env.sections["reasoning_gym"]
    assert section.dataset == "products" and section.config["max_digits"] == 1 and section.answer_format == "lenient"
    assert (products.es.population, products.env.n_train, products.es.sigma.start) == (8, 48, cfg.es.sigma.start)


def test_the_real_model_game_and_sudoku_profiles_build():
    """smollm2_guess (TextArena's GuessTheNumber, the game announcing the run's 5 turns), smollm2_guess10 and
    smollm2_sudoku4 (the paper's task on the 4x4 board, candidates listed)."""
    pytest.importorskip("textarena")
    cfg = build_config(compose_config("+experiment=smollm2_guess"), 1)
    assert cfg.model.path == "pypi:smollm2-135m-instruct" and cfg.env.name == "textarena"
    game = cfg.env.sections["textarena"]
    assert game.game == "GuessTheNumber-v0" and game.game_kwargs["max_turns"] == cfg.env.max_turns == 5
    cfg = build_config(compose_config("+experiment=smollm2_guess10"), 1)  # 1 to 10 in 4 turns, only a win scoring
    game = cfg.env.sections["textarena"]
    assert game.game_kwargs["max_number"] == 10 and game.game_kwargs["max_turns"] == cfg.env.max_turns == 4
    assert not game.partial_credit and cfg.env.common_draws
    assert (cfg.es.noise, cfg.es.member_batch, cfg.es.population * cfg.env.episodes_per_step) == ("lowrank", True, 64)
    cfg = build_config(compose_config("+experiment=smollm2_sudoku4"), 1)
    board = cfg.env.sections["sudoku"]
    assert cfg.env.name == "sudoku" and (board.size, board.mask_count, board.hints) == (4, 2, True)

"""The command line explains itself: --help, one line per bad override, the start-up checks, the thread policy,
dp=auto, and plain step lines where stderr is not a terminal."""
import json
import logging
import os

import pytest

from esopt_mp.cli import MAIN_KEYS, check_overrides, describe, field_defaults, help_text, options
from esopt_mp.config import ConfigError, ParallelConfig, build_config
from esopt_mp.envs.base import StartupError
from esopt_mp.parallel import cpu_threads
from esopt_mp.progress import StepProgress, eta, step_line
from esopt_mp.startup import check_model_dir, check_run_dir, check_run_to_read, dry_run
from tests.fixtures.configs import CONFIGS, compose_config

ASSET = os.path.join(os.path.dirname(CONFIGS), "esopt_mp", "assets", "tiny_agent")


@pytest.mark.parametrize("arg, line", [
    ("experiment=sudoku_4b", r"^experiment: a profile is added to the defaults: write \+experiment=sudoku_4b "
                             r"\(profiles: ahd_bpp, .*sudoku_4b_h10"),
    ("+experiment=sudoku4b", r"^experiment: unknown profile 'sudoku4b' \(did you mean 'sudoku_4b'\?\); profiles: "),
    ("algo=gpro", r"^algo: unknown algorithm 'gpro' \(did you mean 'grpo'\?\); known: es, grpo, ppo$"),
    ("env=sudoku", r"^env: unknown option 'sudoku' \(did you mean 'sudoku4'\?\); known: sudoku4 \(an environment "
                   r"is chosen with env.name=NAME\)$"),
    ("esx.population=8", r"^unknown config key 'esx.population' \(did you mean 'es.population'\?\); the sections"),
    ("+sead=3", r"^unknown config key 'sead'"),
    ("runn.loggers=[tensorboard]", r"^unknown config key 'runn.loggers' \(did you mean 'run.loggers'\?\)"),
    ("run.loggers=tensorboard,wandb", r"^run.loggers=tensorboard,wandb: a comma list is a sweep \(for --multirun\); "
                                      r"a list value is written run.loggers=\[tensorboard,wandb\]$"),
    ("run.loggers=[tensorboard", r"^run.loggers=\[tensorboard: unbalanced brackets"),
    ("foo", r"^'foo': an override is KEY=VALUE"),
])
def test_an_override_hydra_would_answer_with_a_traceback_is_one_line(arg, line):
    with pytest.raises(ConfigError, match=line):
        check_overrides([arg], CONFIGS)


@pytest.mark.parametrize("arg", ["+experiment=sudoku_4b", "algo=grpo", "es.population=4", "env.sudoku.size=4",
                                 "hydra.verbose=true", "~env.sudoku", "--multirun", "parallel.dp=auto",
                                 "run.loggers=[tensorboard,wandb]", "es.include=[model.*]"])
def test_what_hydra_takes_passes(arg):
    check_overrides([arg], CONFIGS)
    check_overrides(["--multirun", "algo=es,grpo"], CONFIGS)  # a sweep where it is one


def test_a_plus_on_a_key_the_config_has_sets_it():
    assert build_config(compose_config("+es.population=4"), 1).es.population == 4


def test_an_empty_model_path_is_refused_not_the_tiny_model():
    with pytest.raises(ConfigError, match=r"^model.path: is empty \(an unset variable\?\): a model directory, "
                                          r"a \.gguf file, pypi:NAME, builtin:NAME, or null for the tiny model$"):
        build_config(compose_config("+experiment=sudoku_4b", "model.path="), 1)
    assert build_config(compose_config("model.path=null"), 1).model.path is None


def test_a_string_for_a_list_says_how_to_write_the_list():
    with pytest.raises(ConfigError, match=r"^run.loggers: expected a list, got 'tensorboard' \(write "
                                          r"run.loggers=\[tensorboard\]\)$"):
        build_config(compose_config("run.loggers=tensorboard"), 1)


def test_help_lists_every_group_option_profile_and_main_key_with_its_default():
    composed = {k: v for k, v in compose_config().items() if k != "hydra"}
    text = help_text(CONFIGS, composed=composed)
    for group in ("algo", "engine", "env", "model", "objective", "parallel"):
        for opt in options(CONFIGS, group):
            assert f"    {opt} " in text, (group, opt)
    for profile in options(CONFIGS, "experiment"):
        assert f"  {profile} " in text
    for key, _ in MAIN_KEYS:
        assert f"  {key} " in text
    # the embedded default's values (the composed config), not only the dataclasses'
    assert text.split("  objective.name", 1)[1].split()[0] == "agent"
    assert text.split("  env.max_turns", 1)[1].split()[0] == "6"
    assert text.split("  run.loggers", 1)[1].split()[0] == "[]"
    assert max(len(line) for line in text.splitlines()) <= 110


def test_every_main_key_is_a_field_of_the_config():
    fields = field_defaults()
    assert [k for k, _ in MAIN_KEYS if k not in fields] == []


def test_describe_takes_the_first_sentence_of_the_leading_comment(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("# @package _global_\n# A profile for this. And more\n# text.\nkey: 1\n# later\n")
    assert describe(str(p)) == "A profile for this."
    p.write_text("# " + "word " * 40 + "\nkey: 1\n")
    assert describe(str(p), width=30).endswith("...") and len(describe(str(p), width=30)) <= 30


def test_a_run_dir_that_cannot_be_written_is_one_line(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("")
    with pytest.raises(StartupError, match=r"^run.dir: cannot write .*a_file/run \(.*\): set run.dir=PATH"):
        check_run_dir(str(f / "run"))
    with pytest.raises(StartupError, match=r"^run.dir: .*a_file is a file, not a directory"):
        check_run_dir(str(f))
    with pytest.raises(StartupError, match=r"^run.dir: cannot write .*a_file/run \(.*a_file is not a writable "
                                           r"directory\)"):
        check_run_dir(str(f / "run"), create=False)
    check_run_dir(str(tmp_path / "later" / "run"), create=False)
    assert not (tmp_path / "later").exists()  # a dry run makes nothing
    check_run_dir(str(tmp_path / "new" / "run"))
    assert os.listdir(tmp_path / "new" / "run") == []  # the write check leaves nothing behind


def test_a_model_path_that_is_not_a_model_is_one_line(tmp_path):
    with pytest.raises(StartupError, match=r"^model.path: /nonexistent/m does not exist: point model.path at a "
                                           r"local Hugging Face model directory"):
        check_model_dir("/nonexistent/m")
    (tmp_path / "file").write_text("")
    with pytest.raises(StartupError, match="is a file, not a directory"):
        check_model_dir(str(tmp_path / "file"))
    with pytest.raises(StartupError, match=r"is not a model directory \(no config.json\)"):
        check_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(StartupError, match="has no model_type"):
        check_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(StartupError, match=r"has a config.json but no weights \(\*.safetensors\)"):
        check_model_dir(str(tmp_path))
    with pytest.raises(StartupError, match=r"^model.path: builtin:nope is not shipped: the builtin models are "
                                           r"builtin:tiny_agent"):
        check_model_dir("builtin:nope")
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_model_dir(str(tmp_path))  # enough for a non-agent objective
    with pytest.raises(StartupError, match=r"has no tokenizer \(tokenizer.json or tokenizer_config.json\): an "
                                           r"agent needs its chat template"):
        check_model_dir(str(tmp_path), tokenizer=True)
    assert "Qwen3_5ForCausalLM" in check_model_dir("builtin:tiny_agent")
    assert "tiny model" in check_model_dir(None)


def test_a_tool_on_a_directory_that_is_not_a_run_is_one_line(tmp_path):
    with pytest.raises(StartupError, match=r"no such run directory: pass --run-dir"):
        check_run_to_read(str(tmp_path / "nope"))
    with pytest.raises(StartupError, match=r"is not a run directory \(no config.json\)"):
        check_run_to_read(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"base_model": str(tmp_path / "gone")}))
    with pytest.raises(StartupError, match=r"the run's base model .*gone is gone: pass --base DIR"):
        check_run_to_read(str(tmp_path))
    assert check_run_to_read(str(tmp_path), base=ASSET)["base_model"].endswith("gone")


def test_dry_run_checks_everything_a_start_would_and_trains_nothing(tmp_path):
    cfg = build_config(compose_config(f"run.dir={tmp_path / 'run'}", "run.dry_run=true"), 1)
    lines = dry_run(cfg, 1)
    assert lines[1] == "world: 1 rank(s) = dp 1 x tp 1"
    assert any(line.startswith("model: ") and "qwen3_5" in line for line in lines)
    assert "env: sudoku start-up check passed" in lines and "tasks: 256 training, 128 held-out" in lines
    assert not (tmp_path / "run").exists()  # nothing made: no run.dir, config, ledger, model or metrics
    (tmp_path / "tasks.jsonl").write_text("not json\n")
    bad = build_config(compose_config(f"run.dir={tmp_path / 'run'}", f"env.train_path={tmp_path / 'tasks.jsonl'}"), 1)
    with pytest.raises(StartupError, match=r"^env.name=sudoku: its tasks: "):
        dry_run(bad, 1)


def test_a_run_dir_holding_another_run_is_refused_before_anything_starts(tmp_path):
    from esopt_mp.identity import config_identity
    from esopt_mp.startup import check_same_run

    run = tmp_path / "run"
    cfg = build_config(compose_config(f"run.dir={run}"), 1)
    assert check_same_run(cfg) is None  # a new run.dir
    run.mkdir()
    ident = config_identity(cfg, ASSET)
    (run / "config.json").write_text(json.dumps({"config_hash": ident["hash"], "identity": ident["fields"]}))
    assert check_same_run(cfg).endswith("it resumes")
    other = build_config(compose_config(f"run.dir={run}", "es.population=8"), 1)
    with pytest.raises(StartupError, match=r"^run.dir: .*run holds another run \(it differs in: es.population 16 -> "
                                           r"8\): rerun with that run's settings to resume it, or set run.dir to a "
                                           r"new directory$"):
        check_same_run(other)
    with pytest.raises(StartupError, match="holds another run"):
        dry_run(other, 1)


def test_parallel_dp_auto_is_world_size_over_tp():
    assert ParallelConfig().dp == "auto"
    assert build_config(compose_config("parallel.tp=2"), 4).parallel.dp == 2
    assert build_config(compose_config(), 3).parallel.dp == 3
    assert build_config(compose_config()).parallel.dp == 1  # no world: a replay, a check of the config alone
    with pytest.raises(ConfigError, match=r"^parallel.tp: parallel.dp=auto takes world size / tp: the world size 4 "
                                          r"is not a multiple of tp=3$"):
        build_config(compose_config("parallel.tp=3"), 4)
    with pytest.raises(ConfigError, match=r"^parallel.dp: must be an integer >= 1 or auto, got 'some'$"):
        build_config(compose_config("parallel.dp=some"), 1)
    assert build_config(compose_config("parallel.dp=2", "parallel.tp=2"), 4).parallel.dp == 2


def test_threads_honour_the_users_settings_in_order():
    assert cpu_threads(2, {}, cores=16) == (8, "16 cores / 2 rank(s) on this node")
    assert cpu_threads(4, {"OMP_NUM_THREADS": "3"}, cores=16) == (3, "OMP_NUM_THREADS")
    assert cpu_threads(4, {"OMP_NUM_THREADS": "3", "ESOPT_THREADS": "5"}, cores=16) == (5, "ESOPT_THREADS")
    assert cpu_threads(32, {}, cores=16) == (1, "16 cores / 32 rank(s) on this node")
    with pytest.raises(RuntimeError, match=r"^OMP_NUM_THREADS='x': expected a number of threads >= 1$"):
        cpu_threads(1, {"OMP_NUM_THREADS": "x"})
    with pytest.raises(RuntimeError, match=r"^ESOPT_THREADS='0'"):
        cpu_threads(1, {"ESOPT_THREADS": "0"})


def test_a_step_line_says_what_a_batch_log_needs():
    rec = {"step": 2, "return_mean": 0.25, "return_max": 0.75, "sigma": 9.8e-4, "step_s": 4.12}
    assert step_line("es", 2, 40, rec, 0.5, 156.4) == \
        "ES step 3/40 | return 0.2500 mean, 0.7500 max | sigma 9.8e-04 | held-out 0.5000 | 4.1 s/step | ETA 2m36s"
    assert "kl 1.0e-02" in step_line("grpo", 0, 2, {"return_mean": 0.0, "return_max": 0.0, "kl": 0.01}, None, 0)
    assert eta(3725) == "1h02m" and eta(59.6) == "1m00s"


def test_off_a_terminal_each_step_is_one_plain_line(caplog):
    p = StepProgress("es", 1, 4, enabled=True, bar=False)
    with caplog.at_level(logging.INFO, logger="esopt_mp.progress"):
        for t in (1, 2, 3):
            p.step(t, {"return_mean": t / 10, "return_max": t / 5, "sigma": 1e-3, "step_s": 1.0})
    p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" | ")[0] for line in lines] == ["ES step 2/4", "ES step 3/4", "ES step 4/4"]
    assert not any("\x1b" in line or "\r" in line for line in lines) and lines[-1].endswith("ETA 0m00s")
    quiet = StepProgress("es", 0, 2, enabled=False)
    with caplog.at_level(logging.INFO, logger="esopt_mp.progress"):
        quiet.step(0, {"return_mean": 0.0})
    assert len(caplog.records) == 3  # another rank says nothing

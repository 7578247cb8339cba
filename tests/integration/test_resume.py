"""Exact resume after SIGKILL, replay from the ledger, HF export, config errors before any rollout."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from esopt_mp.checkpoint import checkpoint_steps
from esopt_mp.parallel.local_world import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["model=tiny", "objective=target_logprob", "es.population=4", "es.steps=6", "objective.batch=2", "run.checkpoint_every=2", "run.export=true"]


def _cmd(world: int, run_dir, extra=()):
    base = [sys.executable, "launch/train.py"]
    if world > 1:
        base = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
                str(free_port()), "launch/train.py", f"parallel.dp={world}"]
    return base + ARGS + [f"run.dir={run_dir}", *extra]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _run(cmd):
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def _ledger(run_dir):
    with open(os.path.join(run_dir, "history.jsonl")) as f:
        return [{k: v for k, v in json.loads(l).items() if k not in ("wall_time", "sha256")} for l in f]


def _weights(d):
    return load_file(os.path.join(d, "model.safetensors"))


# The 1-process runs restore by subtraction in bfloat16: each member's perturb/restore rounding stays in the
# weights, so a resume (the checkpoint + the ledger's steps past it) or a replay (base + the whole ledger) that
# re-applies it in any other way differs bit for bit; the 2-process runs keep the default snapshot restore.
ONE_PROCESS = ["es.restore=subtract", "model.dtype=bfloat16"]


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """One uninterrupted 1-process run of ARGS + ONE_PROCESS: the reference of the 1-process kill test and the
    replayed run."""
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    _run(_cmd(1, run, ONE_PROCESS))
    return run


def _kill_after_3_entries(cmd, run_dir):
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(),
                            start_new_session=True)
    ledger = run_dir / "history.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not ledger.exists() or len(ledger.read_text().splitlines()) < 3):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # mid-step: between ledger entries 3 and 4
    proc.wait()
    assert not (run_dir / "export").exists()


@pytest.mark.parametrize("world", [1, 2])
def test_sigkill_then_rerun_equals_uninterrupted(tmp_path, world, one_process_run):
    """SIGKILL mid-step, then the same command again: the ledger (target_logprob's returns depend on the weights)
    and the exported weights equal the uninterrupted run's."""
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    extra = ONE_PROCESS if world == 1 else []
    if world == 1:
        ref = one_process_run
    else:
        _run(_cmd(world, ref))
    _kill_after_3_entries(_cmd(world, killed, extra), killed)
    saved = [s for s, _ in checkpoint_steps(str(killed))]
    assert max(saved, default=0) < len(_ledger(killed))  # the rerun replays ledger steps past the checkpoint
    _run(_cmd(world, killed, extra))
    assert _ledger(killed) == _ledger(ref)
    a, b = _weights(ref / "export"), _weights(killed / "export")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], v) for k, v in _weights(ref / "base_model").items())


def test_replay_reproduces_export_and_export_loads(tmp_path, one_process_run):
    """esopt replay (base + the whole ledger, subtract restore in bfloat16) and esopt export rebuild the
    run's export bit for bit; it loads and generates; a planted checkpoint runs no code."""
    run = one_process_run
    out = subprocess.run([sys.executable, "-m", "esopt_mp.commands", "replay", "--run-dir", str(run), "--out", str(tmp_path / "rep")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    a, b = _weights(run / "export"), _weights(tmp_path / "rep")
    base = _weights(run / "base_model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], base[k]) for k in a)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "export")
    gen = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 7)
    ex = subprocess.run([sys.executable, "-m", "esopt_mp.commands", "export", "--run-dir", str(run), "--out", str(tmp_path / "ex")],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ex.returncode == 0, ex.stderr[-2000:]
    c = _weights(tmp_path / "ex")
    assert all(torch.equal(a[k], c[k]) for k in a)
    from tests.fixtures.checkpoints import _plant  # a code-running .metadata in every checkpoint of a copy of the run

    planted, marker = tmp_path / "planted", tmp_path / "code_ran"
    shutil.copytree(run, planted)
    for d in (planted / "ckpt").iterdir():
        _plant(str(d), str(marker), manifest_too=True)
    ex = subprocess.run([sys.executable, "-m", "esopt_mp.commands", "export", "--run-dir", str(planted), "--out",
                         str(tmp_path / "ex2")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ex.returncode == 0, ex.stderr[-2000:]
    c = _weights(tmp_path / "ex2")
    assert all(torch.equal(a[k], c[k]) for k in a) and not marker.exists()


def test_subtract_restore_at_dp2_equals_one_process_and_replays(tmp_path):
    """With es.restore=subtract every rank applies every member's perturb/restore (other dp groups' as noise passes
    only): the dp=2 replicas stay identical (checked after every step), equal a 1-process run bit for bit, returns
    included, and the ledger replays to the same weights."""
    from esopt_mp.models import build_tiny_qwen35
    from esopt_mp.parallel import ParallelDims
    from esopt_mp.parallel.local_world import run_world
    from tests.integration.resume_workers import subtract_worker
    from esopt_mp.replay import replay

    model = build_tiny_qwen35(str(tmp_path / "tiny"), seed=3, arch="qwen3")  # attention layers: target_logprob runs
    subtract_worker(0, 1, 1, model, str(tmp_path / "one"), str(tmp_path / "one.pt"), 3, ParallelDims(1, 1, 1))
    run_world(2, subtract_worker, 2, model, str(tmp_path / "dp2"), str(tmp_path / "dp2.pt"), 3)
    one, dp2 = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "dp2.pt")
    assert dp2["returns"] == one["returns"] and not any(math.isnan(r) for r in one["returns"])
    assert all(torch.equal(dp2["state"][k], v) for k, v in one["state"].items())
    replay(str(tmp_path / "dp2"), str(tmp_path / "rep"))
    rep = _weights(tmp_path / "rep")
    assert all(torch.equal(rep[k], one["state"][k]) for k in rep)
    assert any(not torch.equal(rep[k], v) for k, v in load_file(os.path.join(model, "model.safetensors")).items())


def test_another_config_in_the_same_run_dir_is_one_line_before_any_rollout(tmp_path):
    """A wrong world size, sigma = 0 and an unknown environment fail before anything is built: test_launch's and
    test_env_plugin's launches; the refusal's own wording: test_resume_with_another_es_config_is_refused."""
    run = tmp_path / "run"
    _run(_cmd(1, run, ["es.steps=1"]))
    before = (run / "history.jsonl").read_text()
    p = subprocess.run(_cmd(1, run, ["es.steps=1", "run.seed=99"]), cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=_env())
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith("error: ") and "holds another run" in last, p.stderr[-1500:]
    assert p.stderr.strip().count("\n") == 0  # refused before a model, a tracker or a process group: one line only
    assert (run / "history.jsonl").read_text() == before  # nothing played, nothing appended


def test_resume_at_other_layouts_equals_uninterrupted_run(tmp_path):
    """tp2/dp1 -> tp1/dp2 -> tp2/dp1 -> tp2/dp2 -> 1x1, each segment resuming the previous one's DCP checkpoint
    (elastic load, same config hash; async saves mid-segment): bit-identical to one uninterrupted 1x1 run
    (seed_hash objective: returns depend on the seed only), the ledger's seeds and returns equal."""
    from tests.integration.resume_workers import resume_chain

    def pruned_and_described(i, dp, tp, stop, run):
        assert sorted(os.listdir(os.path.join(run, "ckpt"))) == [f"step_{stop:06d}"]  # keep=1 pruned the rest
        man = json.load(open(os.path.join(run, "ckpt", f"step_{stop:06d}", "manifest.json")))
        assert man["layout"] == {"dp": dp, "tp": tp} and man["format"] == 3

    chain = [(1, 2, 1, 0), (2, 1, 2, 1), (1, 2, 4, 2), (2, 2, 6, 4)]  # (dp, tp, stop_at, step the resume starts from)
    out = resume_chain(tmp_path, chain, segment=pruned_and_described)  # then tp=2's checkpoint at 1x1
    want = out["want"]
    for got in (out["segments"][-1]["state"], out["last"]["state"]):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert _ledger(out["run"]) == _ledger(out["ref"])
    base = load_file(os.path.join(out["model"], "model.safetensors"))
    assert any(not torch.equal(want[k], v) for k, v in base.items())


def test_resume_with_another_es_config_is_refused(tmp_path):
    from esopt_mp.ledger import LedgerError
    from esopt_mp.models import build_tiny_qwen35
    from esopt_mp.parallel import ParallelDims
    from esopt_mp.trainer import ESTrainer
    from tests.distributed.workers import _cfg

    model = build_tiny_qwen35(str(tmp_path / "tiny"), seed=3, num_hidden_layers=2)
    run = str(tmp_path / "run")
    tr = ESTrainer(_cfg(1, 1, model, run, "seed_hash", 2), ParallelDims(1, 1, 1))
    tr.step(0)
    tr.close()
    with pytest.raises(LedgerError, match="different configuration .*use a new run.dir or the original config"
                                          ".*it differs in: es.population 8 -> 4$"):
        ESTrainer(_cfg(1, 1, model, run, "seed_hash", 2, population=4), ParallelDims(1, 1, 1))
    other = build_tiny_qwen35(str(tmp_path / "tiny2"), seed=4, num_hidden_layers=2)  # another model's weights
    with pytest.raises(LedgerError, match=r"it differs in: model.content [0-9a-f]{16}\.\.\. -> [0-9a-f]{16}\.\.\.$"):
        ESTrainer(_cfg(1, 1, other, run, "seed_hash", 2), ParallelDims(1, 1, 1))
    again = ESTrainer(_cfg(1, 1, model, run, "seed_hash", 2, chunk_elems=4096), ParallelDims(1, 1, 1))
    assert again.start_step == 1

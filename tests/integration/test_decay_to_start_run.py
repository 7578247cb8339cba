"""es.decay_to=start through whole runs: theta0 is the run's start after a resume from a mid-run checkpoint, and a
replay from the ledger (base model + every step) rebuilds the same weights, bit for bit.

In-process trainers (model=tiny objective=target_logprob: the returns depend on the weights, so a wrong theta0 at
the resume would change the later returns as well as the weights). The update rule itself: tests/unit/
test_decay_to_start.py.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from esopt_mp.models import full_state_dict
from tests.fixtures.inprocess import build_trainer, cut_and_resume, ledger_entries, same_weights, weights

STEPS = 4
# alpha 0.005 x wd 20: a pull of 10% of (theta - theta0) per step, far above the step itself
ARGS = ["model=tiny", "objective=target_logprob", "objective.batch=2", "es.population=4", f"es.steps={STEPS}",
        "es.weight_decay=20.0", "es.decay_to=start", "run.eval_every=0"]
MODES = {"fp32_snapshot": [], "bf16_fp32_master": ["model.dtype=bfloat16", "es.master=fp32_host"]}


def _trainer(run_dir, extra):
    return build_trainer(run_dir, *ARGS, *extra)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_resume_from_a_mid_run_checkpoint_and_replay_equal_the_uninterrupted_run(tmp_path, mode):
    from esopt_mp.es import Perturber
    from esopt_mp.models import build_shards, load_model
    from esopt_mp.parallel import ParallelDims
    from esopt_mp.resume import replay_
    from esopt_mp.replay import replay

    extra = MODES[mode]
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    t = _trainer(ref_dir, extra)
    try:
        base = weights(t)
        for step in range(STEPS):
            t.step(step)
        want = weights(t)
    finally:
        t.close()
    assert not same_weights(want, base)
    assert all(e["decay_to"] == "start" and e["weight_decay"] == 20.0 for e in ledger_entries(ref_dir))

    def theta0_is_the_base(t):  # theta0 is the base model, not the checkpoint just loaded
        p = t.perturber
        assert all(torch.equal(t0, base[s.info.name]) for s, t0 in zip(p.shards, p.start_host.tensors))
        assert not all(torch.equal(s.tensor, base[s.info.name]) for s in p.shards)

    # 3 steps, a checkpoint after step 2, then gone (as killed after step 3's entry); the resume loads the
    # checkpoint of step 2 and replays step 2 from the ledger
    got = cut_and_resume(lambda d: _trainer(d, extra), cut_dir, 3, 2, STEPS, theta0_is_the_base)
    assert ledger_entries(cut_dir) == ledger_entries(ref_dir)  # returns included: they depend on the weights
    assert same_weights(got, want)

    for use_checkpoint in (False, True):  # base + the whole ledger; the checkpoint + the ledger past it
        out = tmp_path / f"replayed_{use_checkpoint}"
        replay(str(cut_dir), str(out), use_checkpoint=use_checkpoint)
        rep = load_file(os.path.join(out, "model.safetensors"))
        assert rep.keys() == want.keys() and all(torch.equal(rep[k], want[k]) for k in want), use_checkpoint

    # the ledger drives the rule: a Perturber without theta0 refuses it, and the decay toward zero ends elsewhere
    cfg = json.load(open(cut_dir / "config.json"))
    dtype = "bfloat16" if "model.dtype=bfloat16" in extra else "float32"
    model = load_model(cfg["base_model"], ParallelDims(1, 1, 1), dtype)
    es = cfg["es"]
    zero = Perturber(build_shards(model, es["include"], es["exclude"]), restore=es["restore"], master=es["master"])
    entries = ledger_entries(cut_dir)
    with pytest.raises(RuntimeError, match="starting weights"):
        replay_(zero, entries[:1])
    replay_(zero, [{k: v for k, v in e.items() if k != "decay_to"} for e in entries])
    assert not same_weights(full_state_dict(model), want)

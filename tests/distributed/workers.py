"""Worker bodies for the spawned multi-process tests (importable by spawned children)."""
from __future__ import annotations

import math

import torch

from esopt_mp.config import build_config
from esopt_mp.es import local_noise, population
from esopt_mp.es.shard import ShardInfo
from esopt_mp.models import full_state_dict
from esopt_mp.parallel import ReplicaDriftError, check_replicas, discover, gather_returns, init_distributed
from esopt_mp.trainer import ESTrainer


def _cfg(dp: int, tp: int, model_path: str, run_dir: str, objective: str, steps: int, **es):
    es_cfg = {"population": 8, "steps": steps, "mirrored": True,
              "sigma": {"kind": "cosine", "start": 0.02, "end": 0.01},
              "alpha": {"kind": "constant", "start": 0.01, "end": 0.01}, "restore": "snapshot"}
    es_cfg.update(es)
    return build_config({"run": {"dir": run_dir, "seed": 7}, "model": {"path": model_path},
                         "parallel": {"dp": dp, "tp": tp, "checksum_every": 1},
                         "es": es_cfg, "objective": {"name": objective, "batch": 4}}, dp * tp)


def layout_worker(rank: int, world: int, dp: int, tp: int, model_path: str, run_dir: str, out_path: str,
                  steps: int) -> None:
    le = discover()
    dims = init_distributed(le, dp, tp)
    result = {}
    for objective in ("seed_hash", "target_logprob"):
        trainer = ESTrainer(_cfg(dp, tp, model_path, f"{run_dir}/{objective}", objective, steps), dims)
        if objective == "seed_hash":
            # local eps slices are bit-identical to the same slice of the unsharded eps
            seed = population(7, 0, 8, True)[0][0]
            for shard in trainer.shards:
                info = shard.info
                box = tuple(slice(o, o + n) for o, n in zip(info.offset, info.local_shape))
                full = local_noise(seed, ShardInfo.full(info.name, info.global_shape))
                assert torch.equal(local_noise(seed, info), full[box]), info.name
            result["sharded"] = sorted(s.info.name for s in trainer.shards if not s.info.is_full)
        for t in range(steps):
            trainer.step(t)
        result[objective] = full_state_dict(trainer.model)
        result[f"{objective}_comm"] = trainer.comm_stats.total
        result[f"{objective}_comm_by_op"] = trainer.comm_stats.by_op
        result[f"{objective}_ledger"] = trainer.ledger.read()  # per step: seeds, signs, returns, shaped weights
        result[f"{objective}_shards"] = sorted(s.info.name for s in trainer.shards)
        trainer.close()
    if rank == 0:
        torch.save(result, out_path)


def drift_worker(rank: int, world: int, model_path: str, run_dir: str, out_path: str) -> None:
    dp, tp = 2, world // 2
    dims = init_distributed(discover(), dp, tp)
    trainer = ESTrainer(_cfg(dp, tp, model_path, run_dir, "seed_hash", 1), dims)
    named = [(s.info.name, s.tensor) for s in trainer.shards]
    check_replicas(named, dims)  # identical replicas pass
    victim = "model.layers.1.mlp.down_proj.weight"
    if rank == world - 1:  # dp rank 1, last tp rank: only this tp rank's shard drifts
        t = dict(named)[victim]
        t.view(-1)[17] += 1e-3
    try:
        check_replicas(named, dims)
    except ReplicaDriftError as e:
        msg = str(e)
    else:
        msg = ""
    torch.save(msg, f"{out_path}.{rank}")


def gather_worker(rank: int, world: int, out_path: str) -> None:
    dims = init_distributed(discover(), 2, 2)
    G = 6
    local = {m: (math.nan if m == 3 else float(m * 10 + 1)) for m in dims.members(G)}
    if not dims.is_tp_leader:  # peers' values must be ignored
        local = {m: -999.0 for m in local}
    returns = gather_returns(local, G, dims)
    torch.save((returns.tolist(), dims.comm.stats.total), f"{out_path}.{rank}")


def qwen3_tp_worker(rank: int, world: int, model_path: str, out_path: str) -> None:
    from esopt_mp.models import build_shards, load_model

    dims = init_distributed(discover(), 1, 2)
    model = load_model(model_path, dims)
    shards = build_shards(model, include=["model.layers.*"], exclude=["*norm*"])
    ids = torch.arange(1, 13).view(2, 6)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if rank == 0:
        torch.save({"logits": logits, "shards": [(s.info.name, s.info.offset, s.info.local_shape) for s in shards]},
                   out_path)


def sudoku_tp_worker(rank: int, world: int, model_path: str, out_path: str, budget: int = 0) -> None:
    from transformers import AutoTokenizer

    from esopt_mp.agent.loop import AgentConfig, run_episodes
    from esopt_mp.engine.hf import HFEngine
    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.engine.tp import TPEngine
    from esopt_mp.envs import make
    from esopt_mp.envs.sudoku import generate
    from esopt_mp.models import load_model

    dims = init_distributed(discover(), 1, 2)
    engine = TPEngine(HFEngine(load_model(model_path, dims), AutoTokenizer.from_pretrained(model_path)), dims)
    cfg = AgentConfig(max_turns=4, sampling=SamplingParams(temperature=0, max_new_tokens=8), max_episode_tokens=budget)
    tasks = generate(16, 4, size=4, seed=5)
    eps = engine.lead(lambda: run_episodes(engine, [make("sudoku", max_turns=4) for _ in tasks], tasks,
                                           list(range(16)), cfg), cfg.sampling)
    ids = [e.token_ids for e in eps] if eps is not None else engine.followed  # the peer: what it followed
    torch.save({"ids": ids, "stats": engine.stats.__dict__}, f"{out_path}.{rank}")


def schedule_worker(rank: int, world: int, model_path: str, run_dir: str, out_path: str, steps: int) -> None:
    """ES runs at dp = world under each (schedule, restore): their ledgers and final weights, and which members each
    dp group evaluated. Under the dynamic schedule member 0 of every step is held until every other member of the
    step has been evaluated, so its group evaluates member 0 alone while the others share the rest."""
    import time

    from torch.distributed.distributed_c10d import _get_default_store

    dims = init_distributed(discover(), world, 1)
    store = _get_default_store() if world > 1 else None
    result = {}
    for schedule, restore in (("dynamic", "snapshot"), ("dynamic", "subtract"), ("static", "snapshot")):
        cfg = _cfg(world, 1, model_path, f"{run_dir}/{schedule}_{restore}", "target_logprob", steps, restore=restore)
        cfg.parallel.schedule = schedule
        trainer = ESTrainer(cfg, dims)
        evaluate, ran = trainer.objective.evaluate_member, []

        def held_back(member, evaluate=evaluate, ran=ran, key=f"{schedule}_{restore}"):
            if store is not None and member.index == 0 and schedule == "dynamic":
                deadline = time.monotonic() + 120
                while int(store.add(f"{key}/{member.step}", 0)) < cfg.es.population - 1:
                    assert time.monotonic() < deadline, "the other members were never evaluated"
                    time.sleep(0.01)
            r = evaluate(member)
            ran.append((member.step, member.index))
            if store is not None and member.index != 0:
                store.add(f"{key}/{member.step}", 1)
            return r

        trainer.objective.evaluate_member = held_back
        for t in range(steps):
            trainer.step(t)
        result[(schedule, restore)] = {"ledger": trainer.ledger.read(), "weights": full_state_dict(trainer.model),
                                       "ran": dims.comm.all_gather_object(ran)}
        trainer.close()
    if store is not None:  # every step's queue counter deleted once its returns were gathered
        from esopt_mp.parallel.member_queue import MemberQueue

        epoch = MemberQueue._epoch[1]
        result["queue_keys_left"] = [n for n in range(1, MemberQueue._made + 1)
                                     if store.check([f"esopt_mp/members/{epoch}/{n}"])]
        result["queues"] = MemberQueue._made
    if rank == 0:
        torch.save(result, out_path)


def lowrank_layout_worker(rank: int, world: int, dp: int, tp: int, model_path: str, run_dir: str, out_path: str,
                          steps: int) -> None:
    """seed_hash under es.noise=lowrank: each shard's factors are the rows of the whole tensor's; the weights after
    ``steps`` steps, for the comparison across layouts."""
    from esopt_mp.es import lowrank

    dims = init_distributed(discover(), dp, tp)
    trainer = ESTrainer(_cfg(dp, tp, model_path, run_dir, "seed_hash", steps, noise="lowrank", rank=2), dims)
    seed = population(7, 0, 8, True)[0][0]
    for k, shard in enumerate(trainer.shards):
        if trainer.perturber.kinds[k] != "lowrank":
            continue
        info = shard.info
        whole_a, whole_b = lowrank.factors(seed, ShardInfo.full(info.name, info.global_shape), 2)
        a, b = trainer.perturber.factors(seed, k)
        assert torch.equal(a, whole_a[info.offset[0] : info.offset[0] + info.local_shape[0]]), info.name
        assert torch.equal(b, whole_b[info.offset[1] : info.offset[1] + info.local_shape[1]]), info.name
    for t in range(steps):
        trainer.step(t)
    result = {"weights": full_state_dict(trainer.model),
              "sharded": sorted(s.info.name for s in trainer.shards if not s.info.is_full)}
    trainer.close()
    if rank == 0:
        torch.save(result, out_path)

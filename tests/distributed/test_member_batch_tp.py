"""Members in one batch at tp=2 (spawned gloo worlds): each row of a batched forward gives what its member's in-place
perturbed weights give on the same sharded model, for every way transformers' plan shards a matrix -- column-parallel
(q/k/v, gate/up), row-parallel (o_proj, down_proj: the term must join the partial sum before the layer's all-reduce,
or it would be counted once per rank), biases, uneven shards, a vocab-parallel embedding and a gathered lm_head,
tied or not, a scaled embedding (Gemma-3) -- and equals tp=1's batch up to the reduction order; and a whole batched ES run on the embedded
default at tp=2 (the TP leader plays, its peer follows each conversation as the same member) ends where tp=1's does.

The batched forward at tp=1: tests/unit/engine/test_members.py."""

import pytest
import torch

from esopt_mp.parallel.local_world import run_world

SIGMA = 0.05  # large beside the tiny models' weights (~0.02): a member's logits move far more than rounding
SLOTS = [2, -1, 0, 1]


def _tiny(path: str, arch: str) -> str:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

    small = dict(vocab_size=512, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)
    if arch == "llama_smollm2":  # SmolLM2's head layout (9 heads, 3 KV): attention replicated at tp=2; tied
        cfg = LlamaConfig(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                          **small)
    elif arch == "llama_even":  # heads divisible by 2: q/k/v column-, o_proj row-parallel; lm_head untied; biases
        # (a row-parallel bias is added once, after the reduction) and an MLP width tp=2 does not divide
        cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                          attention_bias=True, mlp_bias=True, **{**small, "intermediate_size": 95})
    else:  # Gemma-3-270M's layout: a scaled, tied embedding; sliding and full attention layers
        cfg = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                               layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                               tie_word_embeddings=True, **small)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.clone()


def _forward_worker(rank: int, world: int, models: dict, out: str) -> None:
    from esopt_mp.engine.members import MemberLinears
    from esopt_mp.es import Perturber, member_seed
    from esopt_mp.models import build_shards, load_model
    from esopt_mp.parallel import discover, init_distributed
    from tests.unit.engine.test_members import inplace_rows

    dims = init_distributed(discover(), 1, world)
    seeds, signs = [member_seed(9, 0, i) for i in range(3)], [1, -1, 1]
    result = {}
    for name, path in models.items():
        model = load_model(path, dims, "float32")
        shards = build_shards(model)
        p = Perturber(shards, noise="lowrank", rank=2)
        ids = torch.randint(0, model.config.vocab_size, (len(SLOTS), 7), generator=torch.Generator().manual_seed(0))
        want = inplace_rows(model, p, ids, SLOTS, seeds, signs, SIGMA)
        base = _logits(model, ids)
        single = torch.cat([_logits(model, ids[row : row + 1]) for row in range(len(SLOTS))])
        batch = MemberLinears(model, p)
        try:
            batch.set_members(seeds, signs, SIGMA)
            batch.set_rows(SLOTS)
            got = _logits(model, ids)
        finally:
            batch.close()
        result[name] = {"want": want, "got": got, "single": single, "base": base,
                        "after": _logits(model, ids), "sharded": sorted(s.info.name for s in shards
                                                                       if not s.info.is_full)}
    if rank == 0:
        torch.save(result, out)


@pytest.fixture(scope="module")
def forwards(tmp_path_factory):
    root = tmp_path_factory.mktemp("member_batch_tp")
    models = {a: _tiny(str(root / a), a) for a in ("llama_smollm2", "llama_even", "gemma3")}
    for tp in (1, 2):
        run_world(tp, _forward_worker, models, str(root / f"tp{tp}.pt"))
    return {tp: torch.load(root / f"tp{tp}.pt") for tp in (1, 2)}


@pytest.mark.parametrize("name", ["llama_smollm2", "llama_even", "gemma3"])
def test_each_row_plays_its_member_at_tp2(forwards, name):
    r = forwards[2][name]
    sharded = r["sharded"]
    assert "model.embed_tokens.weight" in sharded and any("down_proj" in n for n in sharded)
    if name == "llama_even":  # the attention is sharded too, o_proj row-parallel; the lm_head is its own matrix
        assert any("o_proj" in n for n in sharded) and "lm_head.weight" in sharded
    assert torch.equal(r["after"], r["base"])  # the hooks and the wrapped forwards are gone, the weights untouched
    # the same sums in another association order, fp32 through two layers: ~1e-6 of the logits' scale; a member's
    # term counted once per rank, missing, or another member's moves a row by ~1e-2 of it
    scale = r["want"].abs().max()
    assert (r["got"] - r["want"]).abs().max() <= 1e-4 * scale
    for row, slot in enumerate(SLOTS):
        moved = (r["want"][row] - r["single"][row]).abs().max()
        assert (slot < 0 and moved == 0) or (slot >= 0 and moved > 100 * 1e-4 * scale), (row, slot)
    one = forwards[1][name]  # tp=1's batch: the same members, the sums reduced in another order
    assert (r["got"] - one["got"]).abs().max() <= 1e-4 * scale


ARGS = ["es.noise=lowrank", "es.rank=1", "es.member_batch=true", "es.population=4", "es.steps=2",
        "env.episodes_per_step=2", "env.sudoku.mask_count=1", "es.sigma.kind=constant", "es.sigma.start=0.05",
        "run.eval_every=0", "parallel.checksum_every=1"]


def _no_perturb(*a, **k):
    raise AssertionError("a batched step perturbed the weights")


def _run_worker(rank: int, world: int, run_dir: str, out: str) -> None:
    from esopt_mp.config import build_config
    from esopt_mp.models import full_state_dict
    from esopt_mp.parallel import discover, init_distributed
    from esopt_mp.trainer import ESTrainer
    from tests.fixtures.configs import compose_config

    cfg = build_config(compose_config(*ARGS, f"parallel.tp={world}", f"run.dir={run_dir}"), world)
    trainer = ESTrainer(cfg, init_distributed(discover(), 1, world))
    try:
        trainer.perturber.perturb = _no_perturb  # a batched step never perturbs the weights
        for t in range(2):
            trainer.step(t)
        weights = full_state_dict(trainer.model)
        ledger = trainer.ledger.read()
    finally:
        trainer.close()
    if rank == 0:
        torch.save({"weights": weights, "returns": [e["returns"] for e in ledger]}, out)


def test_a_batched_run_at_tp2_ends_where_tp1_does(tmp_path):
    for tp in (1, 2):
        run_world(tp, _run_worker, str(tmp_path / f"run{tp}"), str(tmp_path / f"tp{tp}.pt"))
    one, two = (torch.load(tmp_path / f"tp{tp}.pt") for tp in (1, 2))
    assert len(two["returns"]) == 2 and all(len(r) == 4 for r in two["returns"])
    assert any(len(set(r)) > 1 for r in two["returns"])  # the members played differently: an update was made
    # greedy Sudoku moves: tp=2's logits differ from tp=1's by reduction-order rounding, far below the gap between a
    # chosen token and the next, so the same moves, the same returns, and the same update bit for bit
    assert two["returns"] == one["returns"]
    assert one["weights"].keys() == two["weights"].keys()
    assert all(torch.equal(one["weights"][k], two["weights"][k]) for k in one["weights"])

"""Members in one batch (es.noise=lowrank): a batched forward whose rows belong to different members gives each row
what that member's in-place perturbed weights give, and a row of slot -1 the base weights."""
import os

import pytest
import torch

from esopt_mp.engine.members import MemberLinears
from esopt_mp.es import Perturber, member_seed
from esopt_mp.models import build_shards, build_tiny_qwen35, load_model
from esopt_mp.parallel import ParallelDims

SEEDS = [member_seed(9, 0, i) for i in range(3)]
SIGNS = [1, -1, 1]
SIGMA = 0.05  # large beside the tiny model's weights (~0.02): the members' logits differ by far more than rounding


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3", "qwen3_tied"])
def model(request, tmp_path_factory):
    """Two architectures; one with the lm_head tied to the embedding (one shard, two hooked modules), as SmolLM2."""
    arch, tied = request.param.removesuffix("_tied"), request.param.endswith("_tied")
    path = build_tiny_qwen35(str(tmp_path_factory.mktemp(request.param) / "m"), seed=1, arch=arch,
                             tie_word_embeddings=tied)
    model = load_model(path, ParallelDims(1, 1, 1), "float32")
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def inplace_rows(model, p, ids, slots, seeds, signs, sigma):
    """Each row's logits from its own forward with its member perturbed in place (slot -1: the base weights)."""
    want = []
    for row, slot in enumerate(slots):  # the in-place path: perturb, forward, restore
        if slot >= 0:
            p.perturb(seeds[slot], sigma, signs[slot])
        want.append(_logits(model, ids[row : row + 1]))
        if slot >= 0:
            p.restore()
    return torch.cat(want)


def test_each_row_plays_its_member(model):
    p = Perturber(build_shards(model), noise="lowrank", rank=2)
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 7))
    slots = [2, -1, 0, 1]
    want = inplace_rows(model, p, ids, slots, SEEDS, SIGNS, SIGMA)
    base = _logits(model, ids)
    batch = MemberLinears(model, p)
    try:
        batch.set_members(SEEDS, SIGNS, SIGMA)
        batch.set_rows(slots)
        got = _logits(model, ids)
    finally:
        batch.close()
    assert torch.equal(_logits(model, ids), base)  # the hooks are gone and the weights were never touched
    # the same sums in two association orders, fp32 through a few layers: differences ~1e-6 of the logits' scale,
    # while a wrong member (or none) moves them by ~1e-2 of it
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-4 * scale
    for row, slot in enumerate(slots):  # each row against the base weights' forward of that row alone (a batch of
        # one, as ``want``'s rows were made: a batched product need not round as a single row's does)
        moved = (want[row] - _logits(model, ids[row : row + 1])[0]).abs().max()
        assert (slot < 0 and moved == 0) or (slot >= 0 and moved > 100 * 1e-4 * scale), (row, slot)


def test_bad_use_is_one_line(model):
    with pytest.raises(ValueError, match="es.noise=lowrank"):
        MemberLinears(model, Perturber(build_shards(model)))
    batch = MemberLinears(model, Perturber(build_shards(model), noise="lowrank"))
    try:
        with pytest.raises(RuntimeError, match="set_members"):
            batch.set_rows([0])
        batch.set_members(SEEDS, SIGNS, SIGMA)
        with pytest.raises(ValueError, match="-1..2"):
            batch.set_rows([0, 3])
        batch.set_rows([0, 1])
        with pytest.raises(RuntimeError, match="3 rows, 2 member slots"):
            _logits(model, torch.zeros(3, 2, dtype=torch.long))
    finally:
        batch.close()


def test_the_engine_plays_each_conversation_as_its_member():
    """Greedy replies of conversations on three member slots in one batch (the tiny agent, prefill and decode) equal
    each member's replies generated alone on its in-place perturbed weights (logits within ~1e-6 of each other: the
    argmax does not move)."""
    from transformers import AutoTokenizer

    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.engine.hf import HFEngine
    from esopt_mp.models.paths import ASSETS

    agent = os.path.join(ASSETS, "tiny_agent")

    model = load_model(agent, ParallelDims(1, 1, 1), "float32")
    tok = AutoTokenizer.from_pretrained(agent)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompts = [list(range(5, 12)), list(range(20, 24)), list(range(30, 39))]
    slots = [1, -1, 0]
    p = Perturber(build_shards(model), noise="lowrank", rank=2)

    def alone(ids, members=None, slot=-1):
        eng = HFEngine(model, tok, members=members)
        eng.eos = set()  # six tokens each, whatever they are
        return eng.generate([eng.new_conversation(0, 1, member=slot)], [ids], params)[0].token_ids

    want = []
    for ids, slot in zip(prompts, slots):
        if slot >= 0:
            p.perturb(SEEDS[slot], SIGMA, SIGNS[slot])
        want.append(alone(ids))
        if slot >= 0:
            p.restore()
    batch = MemberLinears(model, p)
    try:
        batch.set_members(SEEDS, SIGNS, SIGMA)
        eng = HFEngine(model, tok, members=batch)
        eng.eos = set()
        convs = [eng.new_conversation(i, 1, member=s) for i, s in enumerate(slots)]
        got = [g.token_ids for g in eng.generate(convs, prompts, params)]
    finally:
        batch.close()
    assert got == want
    assert alone(prompts[0]) != want[0] or alone(prompts[2]) != want[2]  # the members' replies are not the base's
    with pytest.raises(ValueError, match="es.member_batch"):
        alone(prompts[0], slot=0)


def test_a_matrix_no_hook_can_play_is_refused():
    """A low-rank matrix outside nn.Linear / nn.Embedding would be updated but never played: refused, named."""
    class Raw(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return torch.nn.functional.linear(x, self.proj)

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), Raw())
    from esopt_mp.es import build_local_shards
    with pytest.raises(ValueError, match="1 low-rank matrices.*1.proj"):
        MemberLinears(net, Perturber(build_local_shards(net), noise="lowrank"))

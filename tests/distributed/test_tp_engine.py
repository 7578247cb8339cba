"""The TP-replicated engine (esopt_mp.engine.tp.TPEngine) in a spawned gloo world of one tp pair, on a fake engine
whose sampling depends only on each conversation's seed and history, as a sharded model's does on every tp rank.

The leader's generations inside ``lead`` and the ones its peer follows are equal, turn by turn (the checksum passes);
a peer whose engine samples otherwise makes both ranks raise; a leader failing before the first forward releases its
peer at once (the peer's ``lead`` returns, and the next ``lead`` of both ranks works), instead of leaving it waiting
for a message until the collective timeout."""
import json
import time

import torch

from esopt_mp.parallel.local_world import run_world


class FakeEngine:
    """Each reply: ``n`` tokens drawn from the conversation's own generator (seeded by its seed), offset by ``bias``."""

    tokenizer, pad_id = None, 0

    def __init__(self, bias: int = 0):
        from esopt_mp.engine.base import EngineStats

        self.bias, self.stats = bias, EngineStats()

    def new_conversation(self, cid, seed):
        g = torch.Generator().manual_seed(seed)
        return type("Conv", (), {"ids": [], "g": g})()

    def generate(self, convs, new_ids, params, max_new=None):
        from esopt_mp.core.types import Generation

        out = []
        for i, (c, ids) in enumerate(zip(convs, new_ids)):
            n = params.max_new_tokens if max_new is None else max_new[i]
            toks = [int(t) + self.bias for t in torch.randint(0, 1000, (n,), generator=c.g)]
            c.ids += list(ids) + toks
            out.append(Generation(toks, str(toks), "length", len(ids), 0.0))
            self.stats.decode_tokens += n
        return out

    def close(self):
        pass


def _episodes(engine, seeds, sampling):
    """Two turns for every conversation, the second only for the even ones, capped at 2 tokens."""
    convs = [engine.new_conversation(i, s) for i, s in enumerate(seeds)]
    first = engine.generate(convs, [[1, 2]] * len(convs), sampling)
    second = engine.generate(convs[::2], [[3]] * len(convs[::2]), sampling, max_new=[2] * len(convs[::2]))
    return [g.token_ids for g in first + second], [list(c.ids) for c in convs]


def _worker(rank, world, out, bias):
    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.engine.tp import TPEngine
    from esopt_mp.parallel import discover, init_distributed

    dims = init_distributed(discover(), 1, 2, timeout_s=60)
    engine = TPEngine(FakeEngine(bias if rank == 1 else 0), dims)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4)
    got = {"rank": rank}
    try:
        gens = engine.lead(lambda: _episodes(engine, [11, 12, 13], sampling), sampling)
        got["ids"] = gens[1] if gens is not None else engine.followed
        got["decoded"] = engine.stats.decode_tokens

        def broken():  # a tokenizer error, say: conversations made, no forward yet
            engine.new_conversation(0, 5)
            raise ValueError("cannot encode")

        t0 = time.time()
        try:
            got["after_failure"] = engine.lead(broken, sampling, default="released")
        except ValueError as e:
            got["after_failure"] = f"raised: {e}"
        got["waited_s"] = time.time() - t0
        again = engine.lead(lambda: _episodes(engine, [7], sampling), sampling)  # the channel is still in step
        got["again"] = again[1] if again is not None else engine.followed
    except RuntimeError as e:
        got["error"] = str(e)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(got, f)


def test_leader_and_peer_generate_the_same_and_a_failure_before_the_forward_releases_the_peer(tmp_path):
    run_world(2, _worker, str(tmp_path / "out"), 0, timeout=120)
    lead, peer = (json.load(open(tmp_path / f"out.{r}")) for r in range(2))
    assert "error" not in lead and "error" not in peer
    assert lead["ids"] == peer["ids"] and len(lead["ids"]) == 3 and len(lead["ids"][0]) == 2 + 4 + 1 + 2
    assert len(lead["ids"][1]) == 2 + 4  # the odd conversation played one turn
    assert lead["decoded"] == peer["decoded"] == 3 * 4 + 2 * 2  # the peer joined every generation, capped alike
    assert lead["after_failure"] == "raised: cannot encode" and peer["after_failure"] == "released"
    assert peer["waited_s"] < 30  # released by the leader, not by the 60 s collective timeout
    assert lead["again"] == peer["again"] and len(lead["again"]) == 1


def test_a_peer_that_samples_other_tokens_makes_both_ranks_raise(tmp_path):
    run_world(2, _worker, str(tmp_path / "out"), 1, timeout=120)
    got = [json.load(open(tmp_path / f"out.{r}")) for r in range(2)]
    assert all("tp ranks sampled different tokens" in g.get("error", "") for g in got)

"""Batched prefill: exact against model.generate and against one-conversation-at-a-time prefill."""
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from esopt_mp.agent.loop import AgentConfig, run_episodes
from esopt_mp.engine.hf import HFEngine
from esopt_mp.engine.hf import plan_prefill
from esopt_mp.engine.base import SamplingParams
from esopt_mp.envs import make
from esopt_mp.envs.sudoku import generate

AGENT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "esopt_mp", "assets", "tiny_agent")
GREEDY = SamplingParams(temperature=0, presence_penalty=0.0, max_new_tokens=10, stop=("\n",))


@pytest.fixture(scope="module")
def agent():
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(AGENT).eval(), AutoTokenizer.from_pretrained(AGENT)


class _GenerateEngine(HFEngine):
    """The reference: every conversation's whole history through ``model.generate`` alone, trimmed as the engine ends."""

    @torch.no_grad()
    def generate(self, convs, new_ids, params):
        from esopt_mp.core.types import Generation

        out = []
        for conv, ids in zip(convs, new_ids):
            conv.ids.extend(ids)
            full = self.model.generate(torch.tensor([conv.ids]), max_new_tokens=params.max_new_tokens,
                                       do_sample=False, eos_token_id=sorted(self.eos),
                                       pad_token_id=self.pad_id)[0, len(conv.ids):].tolist()
            reply, finish = full, "length"
            for k, t in enumerate(full):
                if t in self.eos:
                    reply, finish = full[:k + 1], "eos"
                    break
                if any(s in self.tokenizer.decode(full[:k + 1]) for s in params.stop):
                    reply, finish = full[:k + 1], "stop"
                    break
            conv.ids.extend(reply)
            out.append(Generation(reply, self._text(reply, params), finish, len(conv.ids), 0.0))
        return out


def _play(engine, n=10, turns=5, one_at_a_time=False):
    tasks = generate(n, 3, size=4, seed=0)
    cfg = AgentConfig(max_turns=turns, sampling=GREEDY)
    envs = [make("sudoku", max_turns=turns, show_original=False, hints=True) for _ in tasks]
    if one_at_a_time:  # each conversation prefilled and decoded at batch 1 (the engine before batched prefill)
        return [run_episodes(engine, [e], [t], [i], cfg)[0] for i, (e, t) in enumerate(zip(envs, tasks))]
    return run_episodes(engine, envs, tasks, list(range(n)), cfg)


def test_batched_prefill_plays_the_games_of_generate_and_of_batch_one(agent):
    model, tok = agent
    ref = _play(_GenerateEngine(model, tok))
    ids = [e.token_ids for e in ref]
    turns = sorted({len(e.turns) for e in ref})
    assert len(turns) > 1, "episodes should end at different turns (a shrinking batch)"
    single = HFEngine(model, tok)
    assert [e.token_ids for e in _play(single, one_at_a_time=True)] == ids
    for call_tokens, mode in ((0, "delta"), (256, None), (10 ** 9, "reencode")):
        eng = HFEngine(model, tok, prefill_call_tokens=call_tokens)
        assert [e.token_ids for e in _play(eng)] == ids, (call_tokens, eng.stats)
        assert eng.stats.prefill_calls < single.stats.prefill_calls
        if mode == "delta":  # only the first turn re-encodes; later turns feed the new tokens
            assert eng.stats.reencoded_rows == len(ref) and eng.stats.delta_rows > 0
            assert eng.stats.prefill_tokens == eng.stats.prefill_padded_tokens - _first_turn_pads(ref)
        if mode == "reencode":  # one call per turn (a single delta group when all rows add as much, else re-encoding)
            assert eng.stats.prefill_calls == max(turns) and eng.stats.reencoded_rows > len(ref)
    eng = HFEngine(model, tok, prefix_reuse=False)
    assert [e.token_ids for e in _play(eng)] == ids
    assert eng.stats.delta_rows == 0 and eng.stats.prefill_calls == max(turns)


def _first_turn_pads(episodes):
    lengths = [e.turns[0]["prompt_tokens"] for e in episodes]
    return sum(max(lengths) - n for n in lengths)


def test_mixed_lengths_and_early_finishers_match_generate(agent):
    """Different history lengths, new-token counts equal for some rows and not others, rows leaving each turn."""
    model, tok = agent
    text = ["<|im_start|>user\nBoard:\n1 2 . .\n. . 3 4\n<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>user\nPlace a digit.\n<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>user\nRow 1: 1 . . 4\nRow 2: . 3 . .\n<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>user\nHi\n<|im_end|>\n<|im_start|>assistant\n"]
    follow = ["\n<|im_start|>user\nInvalid.\n<|im_end|>\n<|im_start|>assistant\n",
              "\n<|im_start|>user\nOK, next: 2 . . 1\n<|im_end|>\n<|im_start|>assistant\n"]
    for call_tokens in (0, 10 ** 9):
        eng, ref = HFEngine(model, tok, prefill_call_tokens=call_tokens), _GenerateEngine(model, tok)
        convs = [eng.new_conversation(i, i) for i in range(4)]
        rconvs = [ref.new_conversation(i, i) for i in range(4)]
        live, finished_at = [0, 1, 2, 3], set()
        for turn in range(4):
            new = [tok.encode(text[i] if turn == 0 else follow[(i + turn) % 2], add_special_tokens=False)
                   for i in live]
            # replies "set r c v": the stop string "1" ends rows after 2, 3 or 4 tokens, the cap ends others
            params = SamplingParams(temperature=0, presence_penalty=0.0, max_new_tokens=3 + turn, stop=("1",))
            got = eng.generate([convs[i] for i in live], new, params)
            want = ref.generate([rconvs[i] for i in live], new, params)
            assert [(g.token_ids, g.finish) for g in got] == [(w.token_ids, w.finish) for w in want]
            finished_at |= {len(g.token_ids) for g in got}
            live = live[: len(live) - 1] if turn else live  # the last row leaves after turns 1, 2, 3
        assert [c.ids for c in convs] == [c.ids for c in rconvs]
        assert len(finished_at) >= 3  # rows left the decode batch at different steps
        assert eng.stats.delta_rows > 0 if call_tokens == 0 else eng.stats.delta_rows == 0


def test_plan_prefill_groups_equal_deltas_and_reencodes_when_cheaper():
    # rows 0, 1 add 5 tokens, row 2 adds 7, row 3 has no cache
    plan = plan_prefill([105, 205, 57, 40], [100, 200, 50, 0], call_tokens=10)
    assert plan.reencode == [3] and plan.groups == [(5, [0, 1]), (7, [2])]
    # a forward costing more than re-encoding row 2's whole history folds row 2 into the re-encoded batch
    plan = plan_prefill([105, 205, 57, 40], [100, 200, 50, 0], call_tokens=100)
    assert plan.reencode == [2, 3] and plan.groups == [(5, [0, 1])]
    assert plan_prefill([105, 207], [100, 200], call_tokens=10 ** 6).reencode == [0, 1]  # 2 calls -> 1
    assert plan_prefill([105, 205], [100, 200], call_tokens=10 ** 6).groups == [(5, [0, 1])]  # 1 call either way
    assert plan_prefill([105, 205], [0, 0], call_tokens=0).groups == []
    with pytest.raises(ValueError, match="plan_prefill: call_tokens must be >= 0"):
        plan_prefill([5], [0], call_tokens=-1)
    with pytest.raises(ValueError, match="nothing new"):
        plan_prefill([5], [5], call_tokens=1)
    with pytest.raises(ValueError, match="HFEngine: prefill_call_tokens"):  # an argument, not a config key
        HFEngine(None, None, prefill_call_tokens=-1)

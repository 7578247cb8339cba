
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from esopt_mp.agent.loop import AgentConfig, run_episodes, write_trajectories
from esopt_mp.engine.hf import HFEngine
from esopt_mp.engine.base import SamplingParams, process_logits, sample
from esopt_mp.envs import make
from esopt_mp.envs.sudoku import generate
from esopt_mp.models.tiny import build_tiny_agent_base


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    path = build_tiny_agent_base(str(tmp_path_factory.mktemp("agent") / "base"))
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _play(model, tok, n=6, reuse=True, temperature=0.0, seeds=None, max_turns=5):
    eng = HFEngine(model, tok, prefix_reuse=reuse)
    tasks = generate(n, 4, size=4, seed=11)
    envs = [make("sudoku", max_turns=max_turns) for _ in tasks]
    cfg = AgentConfig(max_turns=max_turns, sampling=SamplingParams(temperature=temperature, max_new_tokens=10))
    eps = run_episodes(eng, envs, tasks, seeds or list(range(n)), cfg)
    return eps, eng.stats


def test_sampling_processors():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    p = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, presence_penalty=0.0)
    assert torch.isinf(process_logits(logits, [[]], p)[0, :2]).all()
    p = SamplingParams(temperature=1.0, top_k=0, top_p=0.5, presence_penalty=0.0)
    assert torch.isfinite(process_logits(logits, [[]], p)[0]).tolist() == [False, False, False, True]
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.3, presence_penalty=0.0)
    assert torch.isfinite(process_logits(logits, [[]], p)[0]).tolist() == [False, False, True, True]
    p = SamplingParams(temperature=0.0, presence_penalty=5.0)
    assert sample(logits, [[3]], p, [torch.Generator()]) == [2]  # penalised token loses the argmax
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, presence_penalty=0.0)
    assert sample(logits, [[]], p, [g1]) == sample(logits, [[]], p, [g2])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_prefix_reuse_gives_the_same_tokens_with_fewer_prefill_tokens(agent):
    model, tok = agent
    reuse, s_reuse = _play(model, tok, reuse=True)
    again, s_full = _play(model, tok, reuse=False)
    assert [e.token_ids for e in reuse] == [e.token_ids for e in again]
    assert s_reuse.decode_tokens == s_full.decode_tokens
    assert s_reuse.prefill_tokens < 0.5 * s_full.prefill_tokens
    assert all(len(e.turns) == 5 and e.ended == "truncated" for e in reuse)


def test_sampling_is_deterministic_per_episode_seed(agent):
    model, tok = agent
    a, _ = _play(model, tok, n=3, temperature=1.0, seeds=[1, 2, 3], max_turns=2)
    b, _ = _play(model, tok, n=3, temperature=1.0, seeds=[1, 2, 3], max_turns=2)
    c, _ = _play(model, tok, n=3, temperature=1.0, seeds=[4, 5, 6], max_turns=2)
    assert [e.token_ids for e in a] == [e.token_ids for e in b]
    assert [e.token_ids for e in a] != [e.token_ids for e in c]


class _Exploding:
    max_turns = 5

    def __init__(self, inner, when):
        self.inner, self.when, self.n = inner, when, 0

    def reset(self, task):
        return self.inner.reset(task)

    def step(self, text):
        self.n += 1
        if self.n == self.when:
            raise RuntimeError("environment crashed")
        return self.inner.step(text)


def test_an_env_crash_is_the_models_failure_and_the_rest_go_on(agent, tmp_path):
    """The env raised on the model's reply: the episode fails with the env's failure return (0), not NaN."""
    model, tok = agent
    tasks = generate(3, 4, size=4, seed=2)
    envs = [make("sudoku", max_turns=3), _Exploding(make("sudoku"), 2), make("sudoku", max_turns=3)]
    eps = run_episodes(HFEngine(model, tok), envs, tasks, [0, 1, 2],
                       AgentConfig(max_turns=3, sampling=SamplingParams(temperature=0, max_new_tokens=8)))
    assert eps[1].ret == 0.0 and eps[1].ended == "failed" and eps[1].failure == "model"
    assert "environment crashed" in eps[1].error
    assert eps[0].ended == eps[2].ended == "truncated" and eps[0].ret == 0.0
    write_trajectories(tmp_path / "t.jsonl", eps, step=0, member=1)
    import json

    rows = [json.loads(l) for l in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert rows[1]["return"] == 0.0 and rows[1]["failure"] == "model" and rows[0]["turns"][0]["response_tokens"] >= 1 and rows[0]["member"] == 1
    assert "Current board" in rows[0]["turns"][0]["prompt"] and "<|im_start|>user" in rows[0]["turns"][1]["prompt"]


def test_both_engines_and_the_tp_wrapper_are_engines_and_tp1_passes_through(agent):
    """HFEngine and TPEngine satisfy the Engine protocol (VLLMEngine's methods are checked by name: building one needs
    vLLM); at tp = 1 the wrapper's episodes are the bare engine's, token for token, and lead needs no peers."""
    from esopt_mp.engine.base import Engine
    from esopt_mp.engine.tp import TPEngine
    from esopt_mp.engine.vllm import VLLMEngine

    model, tok = agent
    bare = HFEngine(model, tok)
    wrapped = TPEngine(HFEngine(model, tok))
    assert isinstance(bare, Engine) and isinstance(wrapped, Engine) and wrapped.pad_id == bare.pad_id
    assert all(callable(getattr(VLLMEngine, m, None)) for m in ("new_conversation", "generate", "close"))
    tasks = generate(3, 4, size=4, seed=11)
    cfg = AgentConfig(max_turns=3, sampling=SamplingParams(temperature=1.0, max_new_tokens=10))

    def play(engine):
        return run_episodes(engine, [make("sudoku", max_turns=3) for _ in tasks], tasks, [4, 5, 6], cfg)

    want = play(bare)
    got = wrapped.lead(lambda: play(wrapped), cfg.sampling)
    assert [e.token_ids for e in got] == [e.token_ids for e in want] and wrapped.stats == bare.stats

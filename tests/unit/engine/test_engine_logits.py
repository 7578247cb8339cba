"""The HF engine computes logits for the last position only, without copying the lm_head weight per batch row."""
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from esopt_mp.engine.hf import HFEngine
from esopt_mp.engine.base import SamplingParams

AGENT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "esopt_mp", "assets", "tiny_agent")


@pytest.fixture(scope="module")
def frozen():
    """The tiny agent with frozen weights, as ``load_model`` hands it to the engine."""
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(AGENT).eval()
    model.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(AGENT)


def _two_turns(model, tok):
    """Three conversations: a left-padded first prefill, then a delta prefill of equal new tokens, then decodes."""
    eng = HFEngine(model, tok)
    eng.eos = set()
    convs = [eng.new_conversation(i, i) for i in range(3)]
    params = SamplingParams(temperature=0, max_new_tokens=3)
    eng.generate(convs, [list(range(5, 5 + n)) for n in (7, 12, 9)], params)
    eng.generate(convs, [[20, 21, 22, 23]] * 3, params)
    return eng


def test_lm_head_sees_one_contiguous_position_per_row(frozen):
    model, tok = frozen
    seen = []
    hook = model.get_output_embeddings().register_forward_pre_hook(
        lambda mod, args: seen.append((tuple(args[0].shape), args[0].is_contiguous())))
    try:
        eng = _two_turns(model, tok)
    finally:
        hook.remove()
    assert eng.stats.reencoded_rows == 3 and eng.stats.delta_rows == 3  # both prefill kinds ran
    assert len(seen) == eng.stats.forward_calls
    assert all(shape[1] == 1 and contiguous for shape, contiguous in seen), seen


def test_no_batched_product_over_the_lm_head_weight(frozen):
    """The lm_head runs as one matrix product: no bmm over its weight expanded to [batch, hidden, vocab]."""
    model, tok = frozen
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        _two_turns(model, tok)
    expanded = [(e.name, e.input_shapes) for e in prof.events()
                if any(len(s) == 3 and tuple(s[1:]) == (hidden, vocab) for s in e.input_shapes if s)]
    assert not expanded, expanded[:3]


def test_last_position_logits_match_logits_to_keep_1(frozen):
    model, tok = frozen
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    positions = torch.arange(ids.shape[1])[None].expand(2, -1)
    eng = HFEngine(model, tok)
    with torch.no_grad():
        got = eng._forward(ids, DynamicCache(config=model.config), positions, None)
        ref = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1).logits[:, -1]
    assert got.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(got, ref)  # the same position; one mm instead of a bmm rounds differently

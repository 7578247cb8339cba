"""A model whose chat template is not ChatML: the engine ends a reply where the template starts the next message,
whatever stop strings the generation was given, so the TP leader and its peers (each its own engine on the same
tokenizer) end every row at the same token."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from esopt_mp.engine.base import SamplingParams
from esopt_mp.engine.hf import HFEngine
from esopt_mp.models.gguf import PLAIN_TEMPLATE
from esopt_mp.models.tiny import build_tiny_agent_base


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    torch.set_num_threads(1)
    path = build_tiny_agent_base(str(tmp_path_factory.mktemp("agent") / "base"))
    return AutoModelForCausalLM.from_pretrained(path).eval(), path


def test_the_plain_templates_stop_ends_every_generation_and_chatml_adds_none(agent):
    model, path = agent
    tok = AutoTokenizer.from_pretrained(path)
    assert HFEngine(model, tok).chat_stop == ()
    tok.chat_template = PLAIN_TEMPLATE
    engine = HFEngine(model, tok)
    assert engine.chat_stop == ("\nUser:",)
    ids = tok.encode(" 5\nUser: and then", add_special_tokens=False)
    assert engine._text(ids, SamplingParams()) == " 5"
    assert engine._text(ids, SamplingParams(stop=(" and",))) == " 5"  # the first of either
    # a generation: the tiny model never writes the stop string, so each reply ends by length, as before
    conv = engine.new_conversation(0, 0)
    g = engine.generate([conv], [tok.encode("User: hi\nAssistant:", add_special_tokens=False)],
                        SamplingParams(temperature=0.0, max_new_tokens=4))[0]
    assert g.finish in ("length", "eos", "stop") and ("\nUser:" not in g.text)

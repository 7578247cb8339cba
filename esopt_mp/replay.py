"""Rebuild a run's weights from the base model and the ledger alone; write a plain HF directory.

    esopt replay --run-dir runs/default --out runs/default/replayed     # base + ledger
    esopt export --run-dir runs/default --out runs/default/export       # newest checkpoint + ledger tail

No rollout is run: each ledger entry's update (seeds, signs, shaped weights,
alpha) is re-applied on one process, and with es.restore=subtract (no fp32
master) also each member's perturb and restore, whose rounding the run's
weights carry; a run with a prompt optimiser also gets its context after the
last replayed step (out/context.txt, checked by hash). Noise is layout-invariant,
so a run trained at any dp x tp replays here bit-exactly, in every restore mode.
Export rebuilds the same weights from the newest loadable checkpoint (saved at
any tp layout) plus the ledger tail, and writes config, safetensors and tokenizer.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys


def replay(run_dir: str, out: str, base: str | None = None, steps: int | None = None,
           use_checkpoint: bool = False) -> str:
    """Base + ledger -> HF directory; ``use_checkpoint`` starts from the newest checkpoint (any tp layout) instead."""
    from transformers import AutoTokenizer

    from esopt_mp.checkpoint import Ledger
    from esopt_mp.resume import restore_run_
    from esopt_mp.es import Perturber
    from esopt_mp.models import build_shards, load_model
    from esopt_mp.models.export import export_hf
    from esopt_mp.parallel import ParallelDims

    from esopt_mp.startup import check_run_to_read

    cfg = check_run_to_read(run_dir, base)
    base = base or cfg["base_model"]
    dims = ParallelDims(1, 1, 1)
    model = load_model(base, dims, cfg["model"]["dtype"])
    es = cfg["es"]
    perturber = Perturber(build_shards(model, es["include"], es["exclude"]), restore=es["restore"],
                          master=es["master"], chunk_elems=es["chunk_elems"],
                          decay_to=es.get("decay_to", "zero"), noise=es.get("noise", "full"), rank=es.get("rank", 1))  # theta0 = these base weights
    entries = Ledger(run_dir, cfg["config_hash"], 0).read()[:steps]
    restore_run_(run_dir, perturber, dims, entries, use_checkpoint)
    try:
        tok = AutoTokenizer.from_pretrained(base)
    except (OSError, ValueError):
        tok = None
    export_hf(model, tok, out, dims)
    replay_context(run_dir, entries, out)
    return out


def replay_context(run_dir: str, entries: list[dict], out: str) -> str | None:
    """The context after the replayed steps (prompt.* runs), read from run.dir/contexts into out/context.txt."""
    if not entries or "context_next" not in entries[-1]:
        return None
    from esopt_mp.prompt import ContextStore

    h = entries[-1]["context_next"]
    with open(os.path.join(out, "context.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(ContextStore(run_dir, write=False).get(h))
    return h


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``esopt replay``: base + ledger (or ``--steps N``, the first N steps) -> an HF directory."""
    ap = argparse.ArgumentParser(prog=prog, description="Rebuild a run's weights from its base model and ledger; "
                                 "write a plain Hugging Face directory.")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", help="base model directory (default: the one the run recorded)")
    ap.add_argument("--steps", type=int, help="replay only the first N steps")
    args = ap.parse_args(argv)
    with one_line_errors(ap.prog):
        print(json.dumps({"out": replay(args.run_dir, args.out, args.base, args.steps)}))
    return 0


def main_export(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``esopt export``: the newest checkpoint plus the ledger tail -> an HF directory (exact, any saved layout)."""
    ap = argparse.ArgumentParser(prog=prog, description="Export a run's newest checkpoint (plus the ledger tail) "
                                 "as a plain Hugging Face directory.")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    with one_line_errors(ap.prog):
        print(json.dumps({"out": replay(args.run_dir, args.out, use_checkpoint=True)}))
    return 0


@contextlib.contextmanager
def one_line_errors(prog: str):
    """A run directory that cannot be read (missing, not a run, no checkpoint, a bad ledger): one line, exit 2."""
    from esopt_mp.checkpoint import CheckpointError
    from esopt_mp.core.errors import StartupError
    from esopt_mp.ledger import LedgerError

    from esopt_mp.progress import quiet_libraries

    quiet_libraries()
    try:
        yield
    except (StartupError, CheckpointError, LedgerError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # --out that is a file, a directory that cannot be written
        print(f"{prog}: error: {e.filename or ''}: {e.strerror or e}: pass --out a directory this user can write",
              file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    sys.exit(main())

"""Print the canonical mapping of vLLM's runtime tensors: runtime tensor[start:stop] <- checkpoint name[box].

    .venv-vllm/bin/python tools/runtime_map.py --model DIR                        # tp=1
    .venv-vllm/bin/python -m torch.distributed.run --nproc_per_node 2 tools/runtime_map.py --model DIR --tp 2

Each rank starts its vLLM engine (as engine=vllm does), reads the mapping off
vLLM's own loaders (esopt_mp/engine/runtime_map.py) and prints one line per
piece, prefixed with its tp rank (``--json``: one JSON object per rank).
"""
from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--all", action="store_true", help="also the pieces es.include/es.exclude would skip")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from esopt_mp.engine.config import EngineConfig
    from esopt_mp.es.config import ESConfig
    from esopt_mp.engine.runtime_map import Piece, describe
    from esopt_mp.engine.vllm import build_vllm
    from esopt_mp.parallel import discover, init_distributed

    launch = discover()
    dims = init_distributed(launch, launch.world_size // args.tp, args.tp)
    es = ESConfig(restore="subtract")  # no host snapshot: this only prints the map
    engine, _, summary = build_vllm(EngineConfig(name="vllm", kv_cache_gib=0.25), es, args.model, dims, args.dtype, 0)
    pieces = [Piece.from_json(d) for d in engine.llm.collective_rpc("esopt_pieces", args=(not args.all,))[0]]
    if args.json:
        print(json.dumps({"tp_rank": dims.tp_rank, "summary": summary, "pieces": [p.to_json() for p in pieces]}))
    elif dims.dp_rank == 0:
        print("\n".join(f"[tp{dims.tp_rank}] {line}" for line in describe(pieces).splitlines()))
        print(f"[tp{dims.tp_rank}] {json.dumps(summary)}")
    engine.close()


if __name__ == "__main__":
    main()

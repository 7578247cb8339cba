"""Export a run's newest checkpoint (plus ledger tail) as a plain HF directory.

    python tools/export_hf.py --run-dir runs/default --out runs/default/export

Rebuilds the full weights on one process -- from the newest loadable checkpoint
(saved at any tp layout) plus the ledger tail, exact -- and writes config,
safetensors shards and tokenizer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from tools.replay import one_line_errors, replay

    with one_line_errors(ap.prog):
        print(json.dumps({"out": replay(args.run_dir, args.out, use_checkpoint=True)}))


if __name__ == "__main__":
    main()

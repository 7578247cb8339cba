"""Write the heuristic-design arrays that are not shipped, bit-identical to the reference files.

The four ``tsp_constructive`` test arrays (1000 instances of 20/50/100/200 uniform points,
5.9 MB of float64) are the continuation of one NumPy stream, ``np.random.seed(1234)`` then
``np.random.rand`` in this order: train 64x50, val 64x{20,50,100,200}, test 1000x{20,50,100,200}
(checked against every file of the reference folder). Shipping the generator instead of the
bytes halves the size of the AHD data; each written file is checked against the SHA-256 of the
reference file, so a NumPy that ever changed its legacy stream fails loudly instead of
producing other instances.

    python -m esopt_mp.data.ahd_build                # into the data root in use (package or $ESOPT_DATA)
    python -m esopt_mp.data.ahd_build --out DIR      # into DIR/ahd/datasets/tsp_constructive/
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys

import numpy as np

SUBDIR = os.path.join("ahd", "datasets", "tsp_constructive")
SEED = 1234
# (split, instances, nodes) in stream order
LAYOUT = ([("train", 64, 50)] + [("val", 64, n) for n in (20, 50, 100, 200)]
          + [("test", 1000, n) for n in (20, 50, 100, 200)])
TEST_SHA256 = {
    "test20_dataset.npy": "8806cdd2737bca4684e689acdf915806ea4ae929082c564724ac3ebeffd9bb6f",
    "test50_dataset.npy": "7154aa3e5b8b2e7b4363ea47d71a3a5235ceaadbacbdcda785c66d49bee98232",
    "test100_dataset.npy": "af47bec781fccd3509ae88bc80c8e6e26dd7e38260f88e17e6566bdfed0d28e3",
    "test200_dataset.npy": "ed2325fe4b7cd7d5d49c5d8053d22fd250817611d11d1b786b38230f618859c6",
}


def generate() -> dict[str, bytes]:
    """Every tsp_constructive file of the stream as ``.npy`` bytes, keyed by file name."""
    np.random.seed(SEED)
    out = {}
    for split, count, nodes in LAYOUT:
        buf = io.BytesIO()
        np.save(buf, np.random.rand(count, nodes, 2))
        out[f"{split}{nodes}_dataset.npy"] = buf.getvalue()
    return out


def build(root: str) -> list[str]:
    """Write the test arrays under ``root``; raise if any differs from the reference digest."""
    files = generate()
    bad = [n for n, d in TEST_SHA256.items() if hashlib.sha256(files[n]).hexdigest() != d]
    if bad:
        raise RuntimeError(f"this NumPy does not reproduce the reference stream for {bad}; copy the files instead")
    dest = os.path.join(root, SUBDIR)
    os.makedirs(dest, exist_ok=True)
    written = []
    for name in TEST_SHA256:
        path = os.path.join(dest, name)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(files[name])
        os.replace(tmp, path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    from esopt_mp.data import data_root

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="data root to write into (default: the one `data:` paths use)")
    args = ap.parse_args(argv)
    root = args.out or data_root()
    try:
        written = build(root)
    except PermissionError:
        sys.exit(f"cannot write under {root}: pass --out DIR (a copy of the data root) and set ESOPT_DATA=DIR")
    print(json.dumps({"root": root, "written": written, "bytes": sum(os.path.getsize(p) for p in written)}))


if __name__ == "__main__":
    main()

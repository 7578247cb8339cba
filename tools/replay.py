"""Old spelling of ``esopt replay`` (:mod:`esopt_mp.replay`), kept for one release."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from esopt_mp.replay import main  # noqa: E402

if __name__ == "__main__":
    print("note: tools/replay.py is now 'esopt replay' (same options); this spelling goes in the next release",
          file=sys.stderr)
    sys.exit(main(prog="replay.py"))

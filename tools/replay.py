"""Old spelling of ``esopt replay`` (:mod:`esopt_mp.replay`), kept for one release."""
import sys

from esopt_mp.replay import main

if __name__ == "__main__":
    print("note: tools/replay.py is now 'esopt replay' (same options); this spelling goes in the next release",
          file=sys.stderr)
    sys.exit(main(prog="replay.py"))

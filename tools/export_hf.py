"""Old spelling of ``esopt export`` (:mod:`esopt_mp.replay`), kept for one release."""
import sys

from esopt_mp.replay import main_export

if __name__ == "__main__":
    print("note: tools/export_hf.py is now 'esopt export' (same options); this spelling goes in the next release",
          file=sys.stderr)
    sys.exit(main_export(prog="export_hf.py"))

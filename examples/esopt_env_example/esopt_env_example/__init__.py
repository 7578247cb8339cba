"""An example esopt_mp environment plugin (see guess.py)."""

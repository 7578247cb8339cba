"""The words every layer shares and none owns: the failure kinds and errors an episode, a start-up check and a
trainer all speak of, and the one file digest. This package imports nothing of esopt_mp, so that any layer may
import it."""

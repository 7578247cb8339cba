"""Agent runtime: tool-call parsers, the batched multi-turn loop."""

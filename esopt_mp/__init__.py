"""esopt_mp: model-parallel Evolution Strategies for LLM agents."""
__version__ = "0.1.0"

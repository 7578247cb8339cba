"""Rollout engines behind one protocol (base.py): the hf engine on a transformers model (hf.py, tensor-parallel
through tp.py) and vLLM (vllm.py, its worker extension in vllm_worker.py). Submodules are imported by name: this
package loads nothing on import."""

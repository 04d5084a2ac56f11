"""Test-only CPU workers for vLLM-Omni's two Drama 3 stages.

vLLM-Omni 0.32.0rc1 has no CPU platform: with no accelerator its platform is
``UnspecifiedOmniPlatform``, whose ``get_omni_ar_worker_cls`` /
``get_omni_generation_worker_cls`` raise ``NotImplementedError`` (``platforms/interface.py``),
so a stage without an explicit ``worker_cls`` cannot start. The e2e tier's deploy file names
these classes per stage (this folder is on every process's ``PYTHONPATH``). They are vLLM's own
CPU worker with the model runner vLLM-Omni's GPU workers build:

* stage 0 (``model_runner: v2``): vLLM-Omni's ``OmniARModelRunner`` (Model Runner V2), as
  ``GPUARWorker.init_device`` builds it, plus the warm-up hook vLLM's CPU worker calls;
* stage 1 (``model_runner: v1``): vLLM-Omni's ``GPUGenerationModelRunner`` with the few methods
  vLLM's V1 ``CPUModelRunner`` overrides for a CPU device (no CUDA events or streams, CPU views
  of the device buffers, no device sync).

vLLM-Omni's connector validation reads a ``model_runner_cls`` class attribute
(``worker/omni_connector_validation.py``): each worker names the same runner class vLLM-Omni's
GPU worker for that stage names.
"""

from __future__ import annotations

import sys

import torch
from vllm.v1.worker import cpu_model_runner as vllm_cpu_runner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin
from vllm_omni.worker_v2.omni_ar_model_runner import OmniARModelRunner


PREEMPTED_TAG = "DRAMA3_E2E_PREEMPTED"


class CPUOmniARModelRunner(OmniARModelRunner):
    """Model Runner V2 for the AR stage; vLLM's CPU worker calls ``warming_up_model``.

    vLLM's scheduler logs no line when it preempts a request; the step's scheduler output names
    them (``preempted_req_ids``), and this runner prints one tagged line per such step for the
    tests to count.
    """

    def warming_up_model(self) -> None:
        self.profile_run()

    def execute_model(self, scheduler_output, *args, **kwargs):
        preempted = getattr(scheduler_output, "preempted_req_ids", None)
        if preempted:
            print(f"{PREEMPTED_TAG} {len(preempted)}", file=sys.stderr, flush=True)
        return super().execute_model(scheduler_output, *args, **kwargs)


class CPUGenerationModelRunner(GPUGenerationModelRunner):
    """The generation stage's V1 runner with vLLM's CPU model runner's device handling."""

    def __init__(self, vllm_config, device):
        vllm_cpu_runner._set_torch_accelerator_to_noop()
        with vllm_cpu_runner._torch_cuda_wrapper():
            super().__init__(vllm_config, device)
        self.use_cuda_graph = False
        vllm_cpu_runner.CPUModelRunner._postprocess_tensors(self)

    _sync_device = vllm_cpu_runner.CPUModelRunner._sync_device
    _zero_block_ids = vllm_cpu_runner.CPUModelRunner._zero_block_ids
    warming_up_model = vllm_cpu_runner.CPUModelRunner.warming_up_model

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        return sampled_token_ids.tolist()


class _OmniCPUWorker(OmniWorkerMixin, CPUWorker):
    """vLLM's CPU worker; the runner it built in ``init_device`` is replaced by ``runner``."""

    runner: type

    def init_device(self):
        super().init_device()
        self.model_runner = self.runner(self.vllm_config, self.device)


class CPUARWorker(_OmniCPUWorker):
    model_runner_cls = GPUARModelRunner  # what vLLM-Omni's GPUARWorker declares
    runner = CPUOmniARModelRunner

    def init_device(self):
        if not self.use_v2_model_runner:
            raise RuntimeError("the e2e CPU AR worker runs Model Runner V2 only (deploy model_runner: v2)")
        super().init_device()


class CPUGenerationWorker(_OmniCPUWorker):
    model_runner_cls = GPUGenerationModelRunner
    runner = CPUGenerationModelRunner

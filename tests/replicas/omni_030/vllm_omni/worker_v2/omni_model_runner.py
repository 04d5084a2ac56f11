# Stand-in for vllm-project/vllm-omni 0.30.0 (PyPI wheel), vllm_omni/worker_v2/omni_model_runner.py
# (OmniGPUModelRunner). Kept: the class, its real base (vLLM's MRv2 GPUModelRunner), an __init__
# that calls the parent first, and the call execute_model makes: the batch descriptor carries
# num_active_loras, then `self.prepare_inputs(scheduler_output, batch_req_state, batch_desc)` with
# three arguments. The body around that call (request bookkeeping, data plane, the forward) is
# left out; execute_model returns what prepare_inputs returned.
from __future__ import annotations

from typing import Any

from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
from vllm.v1.worker.gpu.model_runner import GPUModelRunner


class OmniGPUModelRunner(GPUModelRunner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run: bool = False, **kwargs: Any):
        # Stand-in inputs: the scheduler output carries what the upstream body computes.
        num_active_loras = scheduler_output.num_active_loras
        batch_req_state = scheduler_output.batch_req_state
        batch_desc = BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.NONE,
            num_tokens=scheduler_output.total_num_scheduled_tokens,
            num_reqs=len(scheduler_output.num_scheduled_tokens),
            num_active_loras=num_active_loras,
        )
        return self.prepare_inputs(scheduler_output, batch_req_state, batch_desc)

"""The NPU Omni V2 AR runner: vLLM-Omni's Model Runner V2 AR runner on vLLM-Ascend's MR V2.

Not a patch: the class runner-selection builds for an autoregressive stage that asks for
Model Runner V2 on NPU (when the installed vLLM-Omni ships no such runner itself). Importing
this module imports vLLM-Omni's and vLLM-Ascend's V2 runners, so only a worker that is about
to build one (or ``status --import-targets``) imports it.

MRO: NPUOmniARModelRunner -> OmniARModelRunner -> OmniGPUModelRunner -> NPUModelRunner ->
GPUModelRunner. Omni's lifecycle hooks and outputs sit on top; vLLM-Ascend's runner below
them brings the NPU attention metadata, ACL graph capture and its own ``prepare_inputs``.
"""

from __future__ import annotations

from vllm_ascend.worker.v2.model_runner import NPUModelRunner
from vllm_omni.worker_v2.omni_ar_model_runner import OmniARModelRunner


class NPUOmniARModelRunner(OmniARModelRunner, NPUModelRunner):
    """vLLM-Omni's OmniARModelRunner composed on vLLM-Ascend's NPUModelRunner (MR V2)."""

    def prepare_inputs(self, *args, **kwargs):
        # Pass-through; lora-count-forwarding fits the call to the parent's signature.
        return super().prepare_inputs(*args, **kwargs)

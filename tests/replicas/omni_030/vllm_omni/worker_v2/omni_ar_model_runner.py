# Stand-in for vllm-project/vllm-omni 0.30.0 (PyPI wheel), vllm_omni/worker_v2/omni_ar_model_runner.py
# (OmniARModelRunner). Kept: the class and base, and an __init__ that calls the parent first and
# then types its snapshot events with torch.cuda.Event (upstream creates them later, on
# torch.cuda); the stand-in records which class torch.cuda.Event was while it was constructed.
from __future__ import annotations

from typing import Any

import torch

from vllm_omni.worker_v2.omni_model_runner import OmniGPUModelRunner


class OmniARModelRunner(OmniGPUModelRunner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.event_cls_at_init = torch.cuda.Event
        self._async_mm_snapshot_events: list[torch.cuda.Event | None] = [None] * 4

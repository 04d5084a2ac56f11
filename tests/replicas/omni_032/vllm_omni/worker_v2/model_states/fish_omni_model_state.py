# Stand-in for the Drama 3 (fish_omni) MRv2 model state of the in-tree vllm-omni port as used in
# the 0.32.0 serving containers: vllm_omni/worker_v2/model_states/fish_omni_model_state.py
# (FishOmniModelState). Not in any public vllm-omni release: the 0.30.0 wheel's model states
# (omni_model_state.OmniModelState: add_request / remove_request(req_index_or_id)) have no
# preemption hook. Shaped after the port's review notes (UPSTREAM.md "preemption-host-copy"):
# on_request_preempted(req_id, req_index) parks the slot's frame `history` and its `count`,
# add_request restores them on resume, possibly in another slot; with history.is_cuda the park
# is a pinned host copy plus a CUDA event, on any other device a clone() that stays on the
# device, and the resume concatenates the parked frames with host tensors.
# Kept: those names, signatures and behaviours. Left out: the OmniModelState base (building
# vLLM's DefaultModelState needs a full VllmConfig) and everything but the frame history.
from __future__ import annotations

from typing import Any

import torch


class FishOmniModelState:
    def __init__(self, max_num_reqs: int, max_frames: int, num_codebooks: int,
                 device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.max_frames = max_frames
        # Generated frame codes per request slot, and how many frames each slot holds.
        self.history = torch.zeros(max_num_reqs, max_frames, num_codebooks, dtype=torch.int64, device=device)
        self.history_count = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.req_id_to_index: dict[str, int] = {}
        self._suspended: dict[str, dict[str, Any]] = {}

    # -- request lifecycle ---------------------------------------------------------------
    def add_request(self, req_index: int, new_req_data: Any) -> None:
        req_id = new_req_data.req_id
        self.req_id_to_index[req_id] = req_index
        parked = self._suspended.pop(req_id, None)
        if parked is None:
            self.history[req_index].zero_()
            self.history_count[req_index].zero_()
            return
        if parked["event"] is not None:
            parked["event"].synchronize()
        count = int(parked["count"])
        history = parked["history"]
        # The parked frames, then host-side padding up to the slot size.
        pad = torch.zeros(self.max_frames - count, history.shape[-1], dtype=history.dtype)
        restored = torch.cat([history[:count], pad])
        self.history[req_index].copy_(restored)
        self.history_count[req_index].copy_(parked["count"])

    def on_request_preempted(self, req_id: str, req_index: int) -> None:
        history = self.history[req_index]
        count = self.history_count[req_index]
        if history.is_cuda:
            host_history = torch.empty(history.shape, dtype=history.dtype, pin_memory=True)
            host_count = torch.empty(count.shape, dtype=count.dtype, pin_memory=True)
            host_history.copy_(history, non_blocking=True)
            host_count.copy_(count, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._suspended[req_id] = {"history": host_history, "count": host_count, "event": event}
        else:
            self._suspended[req_id] = {"history": history.clone(), "count": count.clone(), "event": None}

    def remove_request(self, req_index_or_id: int | str) -> None:
        if isinstance(req_index_or_id, str):
            # A request that finishes or is aborted while parked drops its parked state.
            self._suspended.pop(req_index_or_id, None)
            req_index = self.req_id_to_index.pop(req_index_or_id, None)
        else:
            req_index = req_index_or_id
            for rid, idx in list(self.req_id_to_index.items()):
                if idx == req_index:
                    del self.req_id_to_index[rid]
        if req_index is not None:
            self.history_count[req_index].zero_()

    # -- what the model's postprocess does each step ---------------------------------------
    def append_frames(self, req_index: int, frames: torch.Tensor) -> None:
        start = int(self.history_count[req_index])
        self.history[req_index, start:start + frames.shape[0]].copy_(frames)
        self.history_count[req_index] += frames.shape[0]

# Stand-in for vllm-project/vllm-ascend, vllm_ascend/worker/v2/utils.py (torch_cuda_wrapper),
# public main of 2026-08-22 (commit 182b75ea84), compared with that file. Upstream points torch.cuda.Event, Stream,
# stream, default_stream, current_stream, graph_pool_handle, CUDAGraph, graph, synchronize,
# set_stream, current_device and mem_get_info at their torch.npu counterparts and never
# restores them (its `finally` is empty). This CPU host has no torch.npu: the stand-in points
# the same names at the stand-in classes below, with the same never-restore behaviour, so a
# test can see what was built inside the wrapper.
from contextlib import contextmanager

import torch

entries = 0  # how many times the wrapper was entered in this process (tests read it)


class NPUEventStandIn:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class NPUStreamStandIn(NPUEventStandIn):
    pass


class NPUGraphStandIn(NPUEventStandIn):
    pass


@contextmanager
def torch_cuda_wrapper():
    global entries
    try:
        torch.cuda.Event = NPUEventStandIn
        torch.cuda.Stream = NPUStreamStandIn
        torch.cuda.CUDAGraph = NPUGraphStandIn
        entries += 1
        yield
    finally:
        pass

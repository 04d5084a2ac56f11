# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/worker/v2/utils.py (torch_cuda_wrapper, :24).
# The release points torch.cuda.Event, Stream, stream, default_stream, current_stream,
# graph_pool_handle, CUDAGraph, graph, synchronize, set_stream, current_device and mem_get_info at
# torch.npu (and vLLM's breakable-cudagraph weak_ref helpers at its own) and never restores them
# (its `finally` is empty). This CPU host has no torch.npu: the stand-in points the same names at
# the stand-in classes below, with the same never-restore behaviour, so a test can see what was
# built inside the wrapper.
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

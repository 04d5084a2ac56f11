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


def tp1_group() -> None:
    """A single-process gloo group with TP = PP = 1, inside a current config (what a worker sets up
    before it builds the model)."""
    import tempfile

    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method="file://" + tempfile.mktemp())
    initialize_model_parallel(1, 1)


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

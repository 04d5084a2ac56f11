# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/quantization/utils.py: is_fused_moe_layer
# (:41), which treats vLLM's MoERunner and RoutedExperts as fused-MoE layers. Left out: the MX
# scale-algorithm helpers and the rest of the module.


def is_fused_moe_layer(layer) -> bool:
    from vllm.model_executor.layers import fused_moe

    kinds = tuple(getattr(fused_moe, n) for n in ("MoERunner", "RoutedExperts") if hasattr(fused_moe, n))
    return isinstance(layer, kinds)

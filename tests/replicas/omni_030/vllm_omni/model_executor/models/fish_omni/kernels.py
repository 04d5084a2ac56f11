# Replica of the Drama 3 model's kernel entry points, module
# vllm_omni/model_executor/models/fish_omni/kernels.py, as described for the
# in-tree vllm-omni port (the fish_omni model code is not in public vllm-omni
# releases; the 0.30.0 wheel ships only fish_speech).  Shaped after
# UPSTREAM.md "tower-sampler-eager": the audio tower norms, the QK norm + RoPE
# + gate split and the frame sampling run as Triton kernels, which need CUDA
# tensors.  Names and signatures are the ones the manifest targets; the bodies
# only model the one behaviour that matters here: a non-CUDA tensor fails the
# way a Triton launch does.
import torch

TRITON_CALLS = []  # (entry point name) per launch, for tests


def _launch(name, *tensors):
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_cuda:
            raise ValueError(
                f"Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?) [{name}]"
            )
    TRITON_CALLS.append(name)
    return name


def gemma_rms_norm(x, weight, eps, residual=None):
    return _launch("gemma_rms_norm", x, weight, residual)


def tower_embed_norm(ids, table, norm_weight, eps, codebook_size=None):
    return _launch("tower_embed_norm", ids, table, norm_weight)


def sigmoid_gate(x, gate):
    return _launch("sigmoid_gate", x, gate)


def qk_norm_rope_gate(qkv, positions, q_weight, k_weight, cos_sin_cache, *, num_heads,
                      num_kv_heads, head_dim, rotary_dim, eps, attn_output_gate=True,
                      is_neox_style=True):
    return _launch("qk_norm_rope_gate", qkv, positions, q_weight, k_weight, cos_sin_cache)


def sample_frame_tokens(logits, top_k=None, top_p=None, temperature=None, generator=None,
                        id_map=None):
    return _launch("sample_frame_tokens", logits)

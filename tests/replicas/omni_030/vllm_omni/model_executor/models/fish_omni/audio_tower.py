# Replica of the Drama 3 audio tower's use of its kernels (module
# vllm_omni/model_executor/models/fish_omni/audio_tower.py of the in-tree
# vllm-omni port; not public).  It binds the entry points with
# `from .kernels import ...` at import time, as model code does, so a patch of
# the kernels module must be in place before this import binds the names.
import torch
from torch import nn

from .kernels import gemma_rms_norm, sample_frame_tokens, tower_embed_norm


class FishOmniAudioTower(nn.Module):
    def __init__(self, num_codebooks=4, codebook_size=4096, hidden_size=64, eps=1e-6):
        super().__init__()
        self.codebook_size = codebook_size
        self.eps = eps
        self.embed = nn.Parameter(torch.randn(num_codebooks * codebook_size, hidden_size) * 0.02)
        self.embed_norm = nn.Parameter(torch.zeros(hidden_size))
        self.out_norm = nn.Parameter(torch.zeros(hidden_size))
        self.head = nn.Parameter(torch.randn(codebook_size, hidden_size) * 0.5)

    def embed_frames(self, codes):
        return tower_embed_norm(codes, self.embed, self.embed_norm, self.eps, self.codebook_size)

    def sample(self, hidden, residual, top_k, top_p, temperature, generator=None, id_map=None):
        hidden, residual = gemma_rms_norm(hidden, self.out_norm, self.eps, residual)
        logits = hidden @ self.head.t()
        return sample_frame_tokens(logits, top_k, top_p, temperature, generator, id_map)

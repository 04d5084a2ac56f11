# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/patch/worker/patch_qwen3_5.py. Kept:
# AscendQwen3NextAttention (:48, a subclass of vLLM's real Qwen3NextAttention) and its forward --
# QKV projection, then for a config whose model_type contains "qwen3_5" one call of vLLM-Ascend's
# Triton-Ascend op torch.ops.vllm.triton_split_qkv_rmsnorm_mrope (weights passed as 1 + w, rotary
# mrope_section, mrope_interleaved and rotary_dim read from self.rotary_emb), else the eager split,
# q/k norm and rotary_emb; then attention, sigmoid gate, o_proj -- and the module-level line (:205)
# that installs that forward on Qwen3NextAttention for every model. Neither branch calls
# _project_qkv_gate. Left out: the decoder-layer, MTP and GDN patches of the same file (:103-226).
import torch
from vllm.model_executor.models.qwen3_next import Qwen3NextAttention


class AscendQwen3NextAttention(Qwen3NextAttention):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, output: torch.Tensor = None):
        qkv, _ = self.qkv_proj(hidden_states)
        if "qwen3_5" in self.config.model_type:
            cos_sin = self.rotary_emb.cos_sin_cache[positions].to(device=qkv.device, dtype=qkv.dtype)
            q, k, v, gate = torch.ops.vllm.triton_split_qkv_rmsnorm_mrope(
                qkv=qkv,
                q_weight=1.0 + self.q_norm.weight,
                k_weight=1.0 + self.k_norm.weight,
                cos_sin=cos_sin,
                num_q_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_size=self.head_dim,
                eps=self.config.rms_norm_eps,
                mrope_section=self.rotary_emb.mrope_section,
                is_interleaved=self.rotary_emb.mrope_interleaved,
                rope_dim=self.rotary_emb.rotary_dim,
                has_gate=self.attn_output_gate,
            )
        else:
            if self.attn_output_gate:
                q_gate, k, v = qkv.split([self.q_size * 2, self.kv_size, self.kv_size], dim=-1)
                lead = q_gate.shape[:-1]
                q, gate = torch.chunk(q_gate.view(*lead, self.num_heads, -1), 2, dim=-1)
                q, gate = q.reshape(*lead, -1), gate.reshape(*lead, -1)
            else:
                q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(-1, self.num_heads, self.head_dim)).view(-1, self.q_size)
            k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim)).view(-1, self.kv_size)
            q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
        if self.attn_output_gate:
            attn_output = attn_output * torch.sigmoid(gate)
        out, _ = self.o_proj(attn_output)
        if output is not None:
            output[:] = out
        return out


Qwen3NextAttention.forward = AscendQwen3NextAttention.forward

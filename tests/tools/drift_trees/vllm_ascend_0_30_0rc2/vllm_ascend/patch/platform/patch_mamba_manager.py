# Replica of vLLM-Ascend 0.30.0rc2 (sdist from PyPI), vllm_ascend/patch/platform/patch_mamba_manager.py:53-88:
# AscendMambaManager.get_num_blocks_to_allocate only, which mamba-prefill-end targets (the drift test
# fingerprints it; its comments are left out, which the fingerprint ignores). The imports and the rest
# of the module are left out; the file is read, never imported.


class AscendMambaManager(MambaManager):
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int | None = None,
        num_tokens_main_model: int | None = None,
        apply_admission_cap: bool = False,
    ) -> int:
        if num_tokens_main_model is None:
            assert num_local_computed_tokens is not None
            num_tokens_main_model = num_local_computed_tokens
        local_hit_tokens = len(new_computed_blocks) * self.block_size
        num_new_blocks = super().get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap=apply_admission_cap,
        )
        has_external_tokens = total_computed_tokens > local_hit_tokens
        has_new_scheduled_tokens = num_tokens_main_model > total_computed_tokens
        if has_external_tokens and has_new_scheduled_tokens:
            num_new_blocks += 1
        return num_new_blocks

# Stand-in for vllm-project/vllm-omni 0.30.0 (PyPI wheel), vllm_omni/worker/mixins.py
# (OmniWorkerMixin). Kept: __init__ passes everything to the next class first. Left out: the
# Omni general-plugin load after it and the KV-connector hook in initialize_from_config.
from typing import Any


class OmniWorkerMixin:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

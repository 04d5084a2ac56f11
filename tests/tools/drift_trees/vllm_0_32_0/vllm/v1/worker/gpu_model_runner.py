# Replica of vLLM 0.32.0 (wheel from PyPI), vllm/v1/worker/gpu_model_runner.py: Model Runner V1.
# Only the module's presence is read (runner-selection looks for it); vLLM 0.34.0 ships without
# it, so the 0.34.0 tree has no such file. Its contents are left out.

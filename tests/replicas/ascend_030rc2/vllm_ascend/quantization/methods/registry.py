# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/quantization/methods/registry.py: a
# process-wide table of scheme classes keyed by (quant type, layer type); register_scheme refuses
# a second class for a key; get_scheme_class answers None for an unknown key. The release's
# methods/__init__.py imports every scheme module (so the table is full once the package is
# imported) and re-exports both functions; replica package __init__ files stay empty, so here the
# FP8 config imports the one scheme module it needs.
_SCHEME_REGISTRY: dict = {}


def register_scheme(quant_type: str, layer_type: str):
    def decorator(cls):
        key = (quant_type, layer_type)
        if key in _SCHEME_REGISTRY:
            raise ValueError(f"Scheme already registered for {quant_type}/{layer_type}: "
                             f"{_SCHEME_REGISTRY[key].__name__}")
        _SCHEME_REGISTRY[key] = cls
        return cls

    return decorator


def get_scheme_class(quant_type: str, layer_type: str):
    return _SCHEME_REGISTRY.get((quant_type, layer_type))

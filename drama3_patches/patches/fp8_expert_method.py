"""fp8-expert-method: Block-FP8 routed experts get an Ascend MoE method on NPU.

Record: ``patches_manifest.yaml``, id ``fp8-expert-method`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

Layout: ``plan`` picks the route once (``choose_route``: ``DRAMA3_PATCHES_FP8_ROUTE``, else by
feature: where vLLM-Ascend keeps ``AscendFp8Config`` (``CONFIG_MODULES``, newest layout first) and
whether a block-FP8 MoE scheme is registered beside it, or the card has MXFP8), names it in
``status`` and wraps ``ExpertFp8Config.get_quant_method`` with ``build``. The wrapper answers
routed-expert layers (``is_routed_experts``) on the native route with ``_ascend_fp8_moe_method``
(vLLM-Ascend's own method; CPU expansion where it refuses), else with a class made by
``expanded_method_class`` on vLLM-Ascend's bf16 method. That class loads through ``_into_host``
(the checkpoint's fp8 data lands in host buffers kept under ``_HOST_ATTR`` on the layer) and
``expand_layer`` writes the bf16 device weights with ``drama3_patches.kernels.fp8``;
``_finish_like_base`` then runs the part of the base method's post-processing that follows its
transposes. Extra keywords (``tid2eid``) go through ``patchlib.call_accepting``. The load peaks of
both routes are modelled by ``drama3-patches plan`` (``drama3_patches.tools.plan.fp8_routes``).
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from drama3_patches import env
from drama3_patches.kernels.fp8 import dequant_experts, expected_scale_shape
from drama3_patches.logger import init_logger
from drama3_patches.patchlib import NotNeeded, PatchContext, call_accepting, wrap

logger = init_logger(__name__)

_WEIGHTS = ("w13_weight", "w2_weight")
_HOST_ATTR = "_drama3_fp8_host"  # name -> (host Parameter, its placeholder) until expanded
_CLASS_CACHE: dict[type, type] = {}


def is_routed_experts(layer: Any) -> bool:
    from vllm.model_executor.layers import fused_moe

    kinds = tuple(getattr(fused_moe, n) for n in ("RoutedExperts", "MoERunner") if hasattr(fused_moe, n))
    return isinstance(layer, kinds)


def has_mxfp8() -> bool:
    """Ascend 950 (A5) has MXFP8 matmuls; the 910B family (A2/A3) does not."""
    try:
        from vllm_ascend.device import device_config
    except ImportError:
        try:  # older vLLM-Ascend kept the device type in utils
            from vllm_ascend.utils import get_ascend_device_type
        except ImportError:
            return False
    else:
        if hasattr(device_config, "is_950"):
            return bool(device_config.is_950())
        get_ascend_device_type = device_config.get_ascend_device_type
    return getattr(get_ascend_device_type(), "name", "") == "A5"


NATIVE, CPU = "native", "cpu"
# Where vLLM-Ascend keeps AscendFp8Config, newest layout first: 0.30.0rc2 has it under
# quantization/configs/, public main of 2026-08-22 directly under quantization/.
CONFIG_MODULES = ("vllm_ascend.quantization.configs.fp8_config", "vllm_ascend.quantization.fp8_config")
# The scheme table AscendFp8Config looks its block-FP8 MoE method up in (0.30.0rc2), and the key.
SCHEME_REGISTRY = "vllm_ascend.quantization.methods.registry"
SCHEME_KEY = ("fp8", "moe")


@dataclass(frozen=True)
class Route:
    """How the routed experts are served: ``name`` native (vLLM-Ascend's own method) or cpu
    (expanded to bf16 on the host); ``why`` is the line ``status`` shows."""

    name: str
    why: str
    config: Any = None  # AscendFp8Config, where one was found
    config_module: str | None = None
    missing: tuple = field(default=())  # "module: cause" of each known path that did not import

    def summary(self) -> str:
        line = f"route {self.name}: {self.why}"
        if self.missing:
            line += "; not imported: " + "; ".join(self.missing)
        return line


def _absent(exc: ImportError, path: str) -> bool:
    """The module (or a package above it) does not exist: another release's layout, not a fault."""
    name = getattr(exc, "name", None) or ""
    return isinstance(exc, ModuleNotFoundError) and bool(name) and (path == name or path.startswith(name + "."))


def find_config() -> tuple[Any, str | None, list[str]]:
    """(AscendFp8Config, its module, what each earlier known path gave instead)."""
    missing = []
    for path in CONFIG_MODULES:
        try:
            module = importlib.import_module(path)
        except ImportError as exc:
            if _absent(exc, path):
                missing.append(f"{path}: absent")
            else:  # the module is there but its import broke: never a quiet fallback
                missing.append(f"{path}: {type(exc).__name__}: {exc}")
                logger.warning("fp8-expert-method: %s is in this vLLM-Ascend but does not import (%s: %s)",
                               path, type(exc).__name__, exc)
            continue
        config = getattr(module, "AscendFp8Config", None)
        if config is None:
            missing.append(f"{path}: no AscendFp8Config")
            continue
        return config, path, missing
    return None, None, missing


def block_fp8_moe_scheme() -> type | None:
    """vLLM-Ascend's registered block-FP8 MoE scheme (AscendFp8BlockFusedMoEMethod in 0.30.0rc2)."""
    try:
        registry = importlib.import_module(SCHEME_REGISTRY)
    except ImportError:
        return None
    lookup = getattr(registry, "get_scheme_class", None)
    return lookup(*SCHEME_KEY) if callable(lookup) else None


def choose_route() -> Route:
    """The route for this process: DRAMA3_PATCHES_FP8_ROUTE when set, else native where vLLM-Ascend
    serves block-FP8 experts itself (a registered block-FP8 MoE scheme, or MXFP8 on the card)."""
    asked = os.environ.get(env.FP8_ROUTE, "").strip().lower()
    if asked not in ("", NATIVE, CPU):
        logger.warning("fp8-expert-method: %s=%r is neither %s nor %s; choosing by feature",
                       env.FP8_ROUTE, asked, NATIVE, CPU)
        asked = ""
    config, path, missing = find_config()
    kw = {"config": config, "config_module": path, "missing": tuple(missing)}
    if asked == CPU:
        return Route(CPU, f"{env.FP8_ROUTE}=cpu", **kw)
    if config is None:
        if asked == NATIVE:
            logger.warning("fp8-expert-method: %s=native, but this vLLM-Ascend has no AscendFp8Config; "
                           "expanding the experts on the CPU", env.FP8_ROUTE)
        return Route(CPU, "no AscendFp8Config in this vLLM-Ascend", **kw)
    scheme = block_fp8_moe_scheme()
    by = f" ({env.FP8_ROUTE}=native)" if asked == NATIVE else ""
    if scheme is not None:
        return Route(NATIVE, f"{path}.AscendFp8Config -> {scheme.__name__}{by}", **kw)
    if has_mxfp8() or asked == NATIVE:
        return Route(NATIVE, f"{path}.AscendFp8Config asked for each layer{by} (CPU expansion where it "
                     "refuses)", **kw)
    return Route(CPU, f"{path}.AscendFp8Config has no block-FP8 MoE scheme and the card has no MXFP8", **kw)


def _ascend_fp8_moe_method(AscendFp8Config, config, layer, prefix: str, *args, **kwargs):
    """vLLM-Ascend's own FP8 MoE method, or None where it refuses this layer."""
    ascend = AscendFp8Config(
        is_checkpoint_fp8_serialized=True,
        activation_scheme=config.activation_scheme,
        ignored_layers=config.ignored_layers,
        weight_block_size=config.weight_block_size,
    )
    ascend.packed_modules_mapping = getattr(config, "packed_modules_mapping", {})
    try:
        return call_accepting(ascend.get_quant_method, layer, prefix, *args, **kwargs)
    except NotImplementedError:
        logger.info("vLLM-Ascend's AscendFp8Config has no MoE method here; expanding %s on the CPU", prefix)
        return None


def expanded_method_class(base: type) -> type:
    """``base`` (vLLM-Ascend's bf16 MoE method) fed from block-FP8 weights expanded on the CPU."""
    if base in _CLASS_CACHE:
        return _CLASS_CACHE[base]

    class ExpandedFp8MoEMethod(base):
        def __init__(self, moe, weight_block_size, **base_kwargs) -> None:
            # base_kwargs: what vLLM-Ascend's own method takes besides moe (tid2eid on main).
            call_accepting(super().__init__, moe, **base_kwargs)
            self.weight_block_size = tuple(weight_block_size or (128, 128))

        def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                           params_dtype, **extra_weight_attrs):
            from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported
            from vllm.model_executor.utils import set_weight_attrs

            shards = getattr(self.moe, "w13_num_shards", 2)
            inter, hidden = intermediate_size_per_partition, hidden_size
            bn, bk = self.weight_block_size
            layer.num_experts, layer.orig_dtype = num_experts, params_dtype
            layer.weight_block_size = list(self.weight_block_size)
            # The device the model is built on (vLLM builds it under `with torch.device(...)`).
            layer._drama3_target_device = torch.empty(0).device
            loader = extra_weight_attrs.pop("weight_loader", None)
            block = {"quant_method": FusedMoeWeightScaleSupported.BLOCK.value}
            specs = {
                "w13_weight": ((num_experts, shards * inter, hidden), torch.float8_e4m3fn, {}),
                "w2_weight": ((num_experts, hidden, inter), torch.float8_e4m3fn, {}),
                # Per shard, as vLLM's Fp8MoEMethod lays them out (gate blocks, then up blocks).
                "w13_weight_scale_inv": ((num_experts, shards * -(-inter // bn), -(-hidden // bk)), torch.float32, block),
                "w2_weight_scale_inv": ((num_experts, -(-hidden // bn), -(-inter // bk)), torch.float32, block),
            }
            host = {}
            for name, (shape, dtype, extra) in specs.items():
                data = torch.empty(shape, dtype=dtype, device="cpu")
                shadow = torch.nn.Parameter(data, requires_grad=False)
                set_weight_attrs(shadow, {**extra_weight_attrs, **extra})
                # What the model registers: a data-less stand-in, so that neither the loader nor
                # vLLM's device_loading_context ever puts fp8 data on the device.
                placeholder = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
                set_weight_attrs(placeholder, {**extra_weight_attrs, **extra})
                if loader is not None:
                    placeholder.weight_loader = _into_host(loader, shadow)
                layer.register_parameter(name, placeholder)
                host[name] = shadow
            setattr(layer, _HOST_ATTR, host)
            if getattr(self.moe, "has_bias", False):
                for name, shape in (("w13_bias", (num_experts, shards * inter)), ("w2_bias", (num_experts, hidden))):
                    bias = torch.nn.Parameter(torch.zeros(shape, dtype=params_dtype), requires_grad=False)
                    if loader is not None:
                        bias.weight_loader = loader
                    set_weight_attrs(bias, extra_weight_attrs)
                    layer.register_parameter(name, bias)

        def process_weights_after_loading(self, layer) -> None:
            host = getattr(layer, _HOST_ATTR, None)
            if host is None:
                return super().process_weights_after_loading(layer)
            expand_layer(layer, host, self.weight_block_size, getattr(self.moe, "w13_num_shards", 2))
            delattr(layer, _HOST_ATTR)
            _finish_like_base(layer)

    ExpandedFp8MoEMethod.__qualname__ = ExpandedFp8MoEMethod.__name__
    _CLASS_CACHE[base] = ExpandedFp8MoEMethod
    return ExpandedFp8MoEMethod


class _into_host:
    """Weight loader of a placeholder: vLLM's FusedMoE loader (TP/EP narrowing, shard offsets)
    writes into the host parameter instead.  Holds it only until the layer is expanded."""

    def __init__(self, loader, shadow) -> None:
        self.__wrapped__ = loader
        self.shadow = shadow

    def __call__(self, param, loaded_weight, *args, **kwargs):
        if self.shadow is None:
            raise RuntimeError("fp8-expert-method: these experts are already expanded to bfloat16; "
                               "reloading fp8 weights into them is not supported")
        return self.__wrapped__(self.shadow, loaded_weight, *args, **kwargs)


def expand_layer(layer, host: dict, block_size, w13_shards: int = 2) -> None:
    """Replace the fp8 host weights of ``layer`` by bf16 device weights in the Ascend layout.

    One weight at a time: its device output is allocated, filled expert by expert from the host
    (blocking copies from one CPU staging buffer), then its host fp8 data and scales are dropped
    before the next weight's output is allocated.
    """
    from vllm.model_executor.utils import replace_parameter

    device = getattr(layer, "_drama3_target_device", torch.device("cpu"))
    for name in _WEIGHTS:
        for param_name in (name, f"{name}_scale_inv"):
            loader = getattr(getattr(layer, param_name), "weight_loader", None)
            if isinstance(loader, _into_host):
                loader.shadow = None  # the host copy now lives only in `host` and the locals below
        weight = host.pop(name).data
        scale = host.pop(f"{name}_scale_inv").data
        num_experts, rows, cols = weight.shape
        out = torch.empty((num_experts, cols, rows), dtype=torch.bfloat16, device=device)
        shards = w13_shards if name == "w13_weight" else 1
        per = rows // shards
        scale_rows = scale.shape[1] // shards
        for s in range(shards):
            part_w = weight[:, s * per:(s + 1) * per]
            part_s = scale[:, s * scale_rows:(s + 1) * scale_rows]
            if tuple(part_s.shape[1:]) != expected_scale_shape(part_w.shape[1:], block_size):
                raise ValueError(
                    f"{getattr(layer, 'prefix', 'experts')}.{name}: weight_scale_inv {tuple(scale.shape)} does not "
                    f"match weight {tuple(weight.shape)} with block {tuple(block_size)}"
                )
            dequant_experts(list(part_w.unbind(0)), list(part_s.unbind(0)), out[:, :, s * per:(s + 1) * per],
                            transposed=True, block_size=block_size, name=f"{getattr(layer, 'prefix', '')}.{name}")
        del weight, scale, part_w, part_s
        replace_parameter(layer, name, out)
        delattr(layer, f"{name}_scale_inv")
        del out


def _finish_like_base(layer) -> None:
    """The part of the Ascend method's post-processing that follows its transposes."""
    try:
        from vllm_ascend.ascend_config import get_ascend_config

        fused_mc2 = getattr(get_ascend_config(), "enable_fused_mc2", False)
    except Exception:  # no ascend config here (replicas, or not initialised): the plain path
        fused_mc2 = False
    if fused_mc2:
        # That path wants NZ weights or per-expert weight lists built by the base method.
        raise NotImplementedError(
            "fp8-expert-method: enable_fused_mc2 is not supported for CPU-expanded block-FP8 experts"
        )
    try:
        from vllm_ascend.utils import maybe_trans_nz
    except ImportError:
        try:
            from vllm_ascend.ops.fused_moe.routed_experts import maybe_trans_nz
        except ImportError:
            return
    for name in _WEIGHTS:
        getattr(layer, name).data = maybe_trans_nz(getattr(layer, name).data)


def _ascend_bf16_method_class() -> type:
    from vllm_ascend.ops.fused_moe.routed_experts import AscendUnquantizedFusedMoEMethod

    return AscendUnquantizedFusedMoEMethod


def build(original, route: Route | None = None):
    route = route or choose_route()

    @wrap(original)
    def get_quant_method(self, layer, prefix, *args, **kwargs):
        if not is_routed_experts(layer):
            return call_accepting(original, self, layer, prefix, *args, **kwargs)
        if route.name == NATIVE:
            method = _ascend_fp8_moe_method(route.config, self, layer, prefix, *args, **kwargs)
            if method is not None:
                return method
        cls = expanded_method_class(_ascend_bf16_method_class())
        return cls(layer.moe_config, self.weight_block_size, **kwargs)

    return get_quant_method


def plan(ctx: PatchContext) -> dict:
    replacements = {}
    for target in ctx.targets:
        original = ctx.original(target)
        try:
            source = inspect.getsource(original)
        except (OSError, TypeError):
            source = ""
        if "vllm_ascend" in source or "AscendFp8Config" in source:
            raise NotNeeded(f"{target} already selects a vLLM-Ascend method")
        route = choose_route()
        logger.info("fp8-expert-method: %s", route.summary())
        ctx.note(target, route.summary())
        replacements[target] = build(original, route)
    return replacements

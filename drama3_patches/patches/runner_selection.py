"""runner-selection: each vLLM-Omni stage on NPU runs the model runner its deploy config names.

Record: ``patches_manifest.yaml``, id ``runner-selection`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

Layout: one builder per target in ``_BUILDERS`` (``_deploy_loader``, ``_ar_init``,
``_generation_init``, ``_ar_init_device``). The loader is probed by ``_refuses_v2_on_npu`` and
merges the ``npu`` section under ``NPU_ALIAS``. ``model_runner_v1_removed`` (the absence of
``MODEL_RUNNER_V1``) switches ``plan`` to its V2-only shape (``NO_V1``). The V2 runner class comes from
``shipped_npu_v2_ar_runner`` (one the installed vLLM-Omni ships) or ``npu_omni_ar_runner_class``
(``_npu_omni_ar_runner``, imported only then: it pulls in both V2 runners), and is built inside
vLLM-Ascend's ``torch_cuda_wrapper()`` (``_built_under_cuda_wrapper``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
import sys

from drama3_patches.logger import init_logger
from drama3_patches.patchlib import PatchContext, wrap

logger = init_logger(__name__)

DEPLOY_LOADER = "vllm_omni.config.stage_config:_apply_platform_overrides"
AR_INIT = "vllm_omni.platforms.npu.worker.npu_ar_worker:NPUARWorker.__init__"
AR_INIT_DEVICE = "vllm_omni.platforms.npu.worker.npu_ar_worker:NPUARWorker.init_device"
GENERATION_INIT = "vllm_omni.platforms.npu.worker.npu_generation_worker:NPUGenerationWorker.__init__"

ASCEND_V2_RUNNER = "vllm_ascend.worker.v2.model_runner:NPUModelRunner"
OMNI_V2_AR_RUNNER = "vllm_omni.worker_v2.omni_ar_model_runner:OmniARModelRunner"
CUDA_WRAPPER = "vllm_ascend.worker.v2.utils:torch_cuda_wrapper"
# Where a vLLM-Omni release would put an NPU V2 runner of its own.
SHIPPED_RUNNER_PACKAGES = ("vllm_omni.platforms.npu.worker", "vllm_omni.platforms.npu.worker_v2")

# vLLM's Model Runner V1; vLLM 0.34 removed it (and VllmConfig.use_v2_model_runner with it).
MODEL_RUNNER_V1 = "vllm.v1.worker.gpu_model_runner"
NO_V1 = f"vLLM has no Model Runner V1 ({MODEL_RUNNER_V1}; removed in vLLM 0.34): every stage runs on V2"

# The name the npu section is merged under: any name outside the loader's {"npu", "xpu"} refusal.
NPU_ALIAS = "npu (drama3-patches: model runner v2 allowed)"


# -- the deploy loader ------------------------------------------------------------------------


def _refuses_v2_on_npu(original, module) -> bool:
    """Whether the loader raises NotImplementedError for v2 on npu, asked at deploy or stage level."""
    probes = [lambda: module.DeployConfig(model_runner="v2")]
    if "model_runner" in {f.name for f in dataclasses.fields(module.StageDeployConfig)}:
        probes.append(lambda: module.DeployConfig(
            stages=[module.StageDeployConfig(stage_id=0, model_runner="v2")]))
    for probe in probes:
        try:
            original(probe(), "npu")
        except NotImplementedError:
            return True
    return False


def _current_omni_platform(fallback: str) -> str | None:
    # How the original resolves platform=None; our own platform when vLLM-Omni cannot say.
    try:
        from vllm_omni.platforms import current_omni_platform
    except ImportError:
        return fallback
    name = current_omni_platform.device_name
    return name.lower() if name is not None else None


def _deploy_loader(ctx: PatchContext, original):
    @wrap(original)
    def _apply_platform_overrides(deploy, platform=None):
        resolved = platform if platform is not None else _current_omni_platform(ctx.platform)
        if resolved != "npu":
            return original(deploy, platform)
        platforms = deploy.platforms
        section = (platforms or {}).get("npu")
        if section is not None:
            deploy.platforms = {**platforms, NPU_ALIAS: section}
        try:
            # Upstream's merge of the npu section, word for word; only the refusal keys on the name.
            return original(deploy, NPU_ALIAS)
        finally:
            deploy.platforms = platforms

    return _apply_platform_overrides


# -- the workers' stage flag ------------------------------------------------------------------


def _stage_of(model_config) -> str:
    return f"stage {getattr(model_config, 'stage_id', '?')} ({getattr(model_config, 'model_stage', None) or 'unnamed'})"


def stage_wants_v2(model_config) -> bool:
    return bool(getattr(model_config, "use_v2_model_runner", False))


def _vllm_config_arg(args, kwargs):
    return kwargs["vllm_config"] if "vllm_config" in kwargs else (args[0] if args else None)


def model_runner_v1_removed() -> bool:
    """Whether this vLLM lacks Model Runner V1 (found by its module, not by version)."""
    import importlib.util

    if MODEL_RUNNER_V1 in sys.modules:
        return False
    try:
        return importlib.util.find_spec(MODEL_RUNNER_V1) is None
    except (ImportError, ValueError):
        return True


def _ar_init(ctx: PatchContext, original, v1_removed: bool = False):
    @wrap(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        # The parent set the process-wide choice; the stage's own choice wins (V2 where V1 is gone).
        self.use_v2_model_runner = True if v1_removed else stage_wants_v2(self.vllm_config.model_config)

    return __init__


def _generation_init(ctx: PatchContext, original):
    @wrap(original)
    def __init__(self, *args, **kwargs):
        vllm_config = _vllm_config_arg(args, kwargs)
        model_config = getattr(vllm_config, "model_config", None)
        if stage_wants_v2(model_config):
            raise ValueError(
                f"{_stage_of(model_config)} runs on {type(self).__name__}, which has no Model "
                "Runner V2 on NPU; set `model_runner: v1` for this stage in the deploy config"
            )
        original(self, *args, **kwargs)
        self.use_v2_model_runner = False

    return __init__


# -- the AR worker's runner -------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def shipped_npu_v2_ar_runner():
    """An NPU V2 AR runner that vLLM-Omni itself ships, found by what it is, else None.

    A class counts when it subclasses both vLLM-Omni's OmniARModelRunner and vLLM-Ascend's V2
    NPUModelRunner; only ``*model_runner`` modules of the NPU worker packages are looked at.
    """
    omni_ar, ascend_v2 = pkgutil.resolve_name(OMNI_V2_AR_RUNNER), pkgutil.resolve_name(ASCEND_V2_RUNNER)
    for package_name in SHIPPED_RUNNER_PACKAGES:
        try:
            package = importlib.import_module(package_name)
        except ModuleNotFoundError as exc:
            if exc.name and package_name.startswith(exc.name):
                continue
            raise
        for info in pkgutil.iter_modules(getattr(package, "__path__", [])):
            if not info.name.endswith("model_runner"):
                continue
            module = importlib.import_module(f"{package_name}.{info.name}")
            for value in vars(module).values():
                if (
                    isinstance(value, type)
                    and value.__module__ == module.__name__
                    and issubclass(value, omni_ar)
                    and issubclass(value, ascend_v2)
                ):
                    return value
    return None


def npu_omni_ar_runner_class():
    shipped = shipped_npu_v2_ar_runner()
    if shipped is not None:
        return shipped
    from drama3_patches.patches._npu_omni_ar_runner import NPUOmniARModelRunner

    return NPUOmniARModelRunner


def _built_under_cuda_wrapper(runner_cls):
    torch_cuda_wrapper = pkgutil.resolve_name(CUDA_WRAPPER)

    def build(vllm_config, device):
        # The whole Omni stack, not only vLLM-Ascend's part, creates torch.cuda events/streams.
        with torch_cuda_wrapper():
            return runner_cls(vllm_config, device)

    return build


def _ar_init_device(ctx: PatchContext, original):
    @wrap(original)
    def init_device(self):
        model_config = self.vllm_config.model_config
        if not getattr(self, "use_v2_model_runner", False):
            original(self)
            logger.info("Using MR v1 %s on NPU for %s", type(self.model_runner).__name__, _stage_of(model_config))
            return
        runner_cls = npu_omni_ar_runner_class()
        # The original builds `self.model_runner_cls(vllm_config, device)`; shadow it for this call.
        self.model_runner_cls = _built_under_cuda_wrapper(runner_cls)
        try:
            original(self)
        finally:
            del self.model_runner_cls
        if not isinstance(self.model_runner, runner_cls):
            raise RuntimeError(
                f"{type(self).__qualname__}.init_device built {type(self.model_runner).__qualname__}, "
                f"not {runner_cls.__qualname__}: it no longer builds through model_runner_cls"
            )
        logger.info(
            "Using MR v2 %s (OmniARModelRunner on vLLM-Ascend NPUModelRunner) on NPU for %s",
            runner_cls.__qualname__, _stage_of(model_config),
        )

    return init_device


_BUILDERS = {
    AR_INIT: _ar_init,
    AR_INIT_DEVICE: _ar_init_device,
    GENERATION_INIT: _generation_init,
}


def plan(ctx: PatchContext) -> dict:
    out = {}
    v1_removed = model_runner_v1_removed()
    for target in ctx.targets:
        original = ctx.original(target)
        if v1_removed and target == GENERATION_INIT:
            # Stage 1 (the DAC) must run on V2 there: refusing V2 would block it.
            ctx.leave(target, f"{NO_V1}; nothing to refuse")
            continue
        if v1_removed and target == AR_INIT:
            out[target] = _ar_init(ctx, original, v1_removed=True)
            ctx.note(target, NO_V1)
            continue
        if target == DEPLOY_LOADER:
            if not _refuses_v2_on_npu(original, ctx.owner(target)[0]):
                ctx.leave(target, "the deploy loader already accepts model_runner v2 on npu")
                continue
            out[target] = _deploy_loader(ctx, original)
        else:
            out[target] = _BUILDERS[target](ctx, original)
    return out

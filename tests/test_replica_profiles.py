"""The upstream replica profiles keep their rules: cited sources, empty package __init__ files,
one dist-info per upstream package, and stand-ins that subclass the real vLLM classes."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.replicas import ASCEND_032, ASCEND_MAIN, OMNI_030, REPLICAS, on_sys_path, profile_paths
from tests.support.subproc import run_python

PROFILES = sorted(p.name for p in REPLICAS.iterdir() if p.is_dir())
CITATIONS = ("# Stand-in for", "# SYNTHETIC", "# Replica of")


@pytest.mark.parametrize("name", PROFILES)
def test_each_module_cites_what_it_mirrors_and_packages_stay_empty(name):
    for path in sorted((REPLICAS / name).rglob("*.py")):
        text = path.read_text()
        if path.name == "__init__.py":
            assert text == "", f"{path} must be empty (several suites share the profile trees)"
        else:
            assert text.startswith(CITATIONS), f"{path} does not start by citing what it mirrors"


@pytest.mark.parametrize("name", PROFILES)
def test_one_dist_info_per_upstream_package(name):
    found = {}
    for info in (REPLICAS / name).glob("*.dist-info"):
        fields = dict(
            line.split(": ", 1) for line in (info / "METADATA").read_text().splitlines() if ": " in line
        )
        assert fields["Metadata-Version"] and fields["Version"]
        assert fields["Name"] not in found, f"{name}: two dist-info dirs for {fields['Name']}"
        found[fields["Name"]] = fields["Version"]
        package = fields["Name"].replace("-", "_")
        assert (REPLICAS / name / package).is_dir(), f"{name}: {info.name} without {package}/"
    assert found, f"{name} has no dist-info: version guards could not see it"


def test_on_sys_path_imports_from_the_profile_and_forgets_it_after():
    with on_sys_path(OMNI_030) as roots:
        from vllm_omni.config import stage_config

        assert stage_config.__file__.startswith(roots[0])
        assert stage_config.DeployConfig().model_runner == "v1"
    assert "vllm_omni.config.stage_config" not in sys.modules
    assert roots[0] not in sys.path


@pytest.mark.vllm
@pytest.mark.parametrize("ascend", [ASCEND_MAIN, ASCEND_032])
def test_stand_ins_subclass_the_real_vllm_classes(ascend):
    proc = run_python(
        """
        import json
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as MRV2
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as MRV1
        from vllm.v1.worker.worker_base import WorkerBase
        from vllm_ascend.patch.platform.patch_mamba_manager import AscendMambaManager
        from vllm_ascend.worker.model_runner_v1 import NPUModelRunner as AscendV1
        from vllm_ascend.worker.v2.model_runner import NPUModelRunner as AscendV2
        from vllm_ascend.worker.worker import NPUWorker
        from vllm_omni.platforms.npu.worker.npu_ar_worker import NPUARWorker
        from vllm_omni.worker_v2.omni_ar_model_runner import OmniARModelRunner
        print("RESULT " + json.dumps([
            issubclass(AscendMambaManager, MambaManager), issubclass(AscendV1, MRV1),
            issubclass(AscendV2, MRV2), issubclass(NPUWorker, WorkerBase),
            issubclass(NPUARWorker, NPUWorker), issubclass(OmniARModelRunner, MRV2),
        ]))
        """,
        pythonpath=profile_paths(ascend, OMNI_030),
    )
    assert json.loads(proc.stdout.split("RESULT ")[-1]) == [True] * 6

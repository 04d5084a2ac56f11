"""The e2e tier (`nox -s e2e`): one tiny published-format checkpoint per run, shared by its tests."""

from __future__ import annotations

import pytest

from support import e2e_pipeline as ep
from support.subproc import call


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    problem = ep.problem()
    if problem:
        pytest.skip(problem)
    d = tmp_path_factory.mktemp("fish_omni_cpu")
    return call(ep.write_model, str(d), 0, env=ep.env(patches=False), pythonpath=[ep.SITE], timeout=600)

"""The e2e tier (`nox -s e2e`): one tiny published-format checkpoint per run, shared by its tests."""

from __future__ import annotations

import pytest

from support import e2e_pipeline as ep


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return ep.tiny_model(tmp_path_factory)

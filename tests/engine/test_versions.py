"""Tier 1: distribution lookup under every spelling, and the PEP 440 guard on what it finds."""

from __future__ import annotations

import pytest

from drama3_patches import versions
from support.selftest import write_dist

SPELLINGS = ["vllm-ascend", "vllm_ascend", "vllm.ascend", "VLLM-Ascend"]


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site directory first on sys.path; the lookup cache is cleared before and after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    versions.clear_cache()
    yield tmp_path
    versions.clear_cache()


@pytest.mark.parametrize("asked", SPELLINGS)
def test_any_spelling_finds_a_wheel_installed_dist(site, asked):
    # A wheel's dist-info folder carries the normalised (underscore) name.
    write_dist(site, "vllm_ascend", "0.32.0rc2.dev17+g1234abc", folder_name="vllm_ascend")
    assert versions.installed_version(asked) == "0.32.0rc2.dev17+g1234abc"
    assert versions.check(asked, ">=0.32.0rc0,<0.33") == (True, f"{asked} 0.32.0rc2.dev17+g1234abc matches >=0.32.0rc0,<0.33")


@pytest.mark.parametrize("asked", ["vllm-omni", "vllm_omni"])
def test_vllm_omni_spellings_find_the_first_on_the_path(site, asked):
    write_dist(site, "vllm-omni", "0.99.0rc1", folder_name="vllm_omni")
    assert versions.installed_version(asked) == "0.99.0rc1"
    assert versions.check(asked, ">=0.32.0rc1,<0.33") == (False, f"{asked} 0.99.0rc1 is outside >=0.32.0rc1,<0.33")


def test_absent_dist_is_none_under_every_spelling(site):
    for asked in ["d3p-absent-dist", "d3p_absent_dist"]:
        assert versions.installed_version(asked) is None
        assert versions.check(asked, ">=1") == (False, f"{asked} is not installed")

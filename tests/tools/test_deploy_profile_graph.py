"""The graph-mode 910B profile is the eager one but for stage 0's execution (tests/e2e/test_compiled.py
is the evidence that the patched model traces as one graph)."""

from __future__ import annotations

import copy

from drama3_patches.tools.deploy_config import profiles as deployconf

EXECUTION_KEYS = ("enforce_eager", "compilation_config")


def _without_stage0_execution(doc):
    doc = copy.deepcopy(doc)
    for key in EXECUTION_KEYS:
        doc["stages"][0].pop(key, None)
    return doc


def test_graph_profile_is_the_eager_profile_with_stage0_compiled_piecewise():
    eager, graph = deployconf.load_profile("910b-tp2-ep"), deployconf.load_profile("910b-tp2-ep-graph")
    assert _without_stage0_execution(graph) == _without_stage0_execution(eager)
    assert eager["stages"][0]["enforce_eager"] is True
    stage0 = graph["stages"][0]
    assert stage0["enforce_eager"] is False
    assert stage0["compilation_config"]["cudagraph_mode"] == "PIECEWISE"
    sizes = stage0["compilation_config"]["cudagraph_capture_sizes"]
    assert max(sizes) == stage0["compilation_config"]["max_cudagraph_capture_size"] == stage0["max_num_seqs"]
    assert deployconf.validate(graph) == deployconf.validate(eager)

"""ComputeGraph files are validated on the way in: each malformed file is refused with a
GraphFormatError naming the node at fault, and every public benchmark graph still loads."""

import copy
import json
import math

import pytest

from graphs import ComputeGraph, GraphFormatError
from solver.synthetic import random_training_graph, training_chain
from tests.paths import BENCHMARK_GRAPHS

BENCHMARK_NAMES = [
    "MobileNet_512_224_224_3_train", "ResNet50_256_224_224_3_train", "VGG16_256_224_224_3_train",
    "VGG19_256_224_224_3_train", "fcn_8_vgg_32_416_608_3_train", "segnet_32_416_608_3_train",
    "vgg_unet_32_416_608_3_train", "random_layered_n100_w0.27_nlv0.75_ed0.2_scd0.14",
    "random_layered_n250_w0.43_nlv0.75_ed0.2_scd0.14", "random_layered_n500_w0.36_nlv0.75_ed0.2_scd0.14",
    "random_layered_n1000_w0.31_nlv0.75_ed0.2_scd0.14",
]


def _remat_data() -> dict:
    """A valid remat-schema file: a 3-layer training chain with a parameter source."""
    g = training_chain(3, fwd_bytes=4)
    g.add_node("w", kind="param", bytes=16, phase="forward", op="param")
    g.add_edge("w", "f0")
    return g.to_dict()


def _node(data: dict, node_id) -> dict:
    return next(n for n in data["nodes"] if n["id"] == node_id)


def _random_layered_data() -> dict:
    nodes = [{"id": i, "out_cost": 10 * (i + 1), "duration": float(i), "param_cost": 0} for i in range(4)]
    links = [{"source": 0, "target": 1}, {"source": 1, "target": 2}, {"source": 0, "target": 3},
             {"source": 2, "target": 3}]
    return {"directed": True, "multigraph": False, "graph": {"name": "tiny", "order": [0, 1, 2, 3]},
            "nodes": nodes, "links": links}


def _checkmate_data() -> dict:
    nodes = [{"id": i, "name": f"layer{i}", "backward": i >= 2, "cost_cpu": 5 + i, "cost_ram": 100}
             for i in range(4)]
    links = [{"source": i, "target": i + 1} for i in range(3)] + [{"source": 0, "target": 3}]
    return {"directed": True, "multigraph": False, "graph": {"name": "cm"}, "nodes": nodes, "links": links}


def _load(tmp_path, data, name="g.json") -> ComputeGraph:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return ComputeGraph.load(path)


def _refused(tmp_path, data, *needles) -> str:
    with pytest.raises(GraphFormatError) as info:
        _load(tmp_path, data)
    msg = str(info.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_valid_files_load(tmp_path):
    g = _load(tmp_path, _remat_data())
    assert g.ops == ["f0", "f1", "f2", "loss", "b2", "b1", "b0"] and g.fixed_bytes == 16
    r = _load(tmp_path, _random_layered_data())
    assert r.order == [0, 1, 2, 3] and r[3]["bytes"] == 40 and r[3]["time"] == 3.0
    c = _load(tmp_path, _checkmate_data())
    assert c.backward_nodes() == [2, 3] and isinstance(c[0]["bytes"], int)


def test_round_trip_of_a_random_training_graph(tmp_path):
    g = random_training_graph(6, seed=3)
    g.save(tmp_path / "g.json")
    back = ComputeGraph.load(tmp_path / "g.json")
    assert back.order == g.order and sorted(back.nx.edges) == sorted(g.nx.edges)


def test_validate_returns_the_graph():
    g = training_chain(2)
    assert g.validate() is g


def test_non_topological_order(tmp_path):
    data = _remat_data()
    order = data["graph"]["order"]
    order[0], order[1] = order[1], order[0]  # f1 before f0, which it reads
    msg = _refused(tmp_path, data, "not topological", "'f1'", "'f0'")
    assert msg.startswith(str(tmp_path / "g.json"))


def test_non_topological_order_of_a_benchmark_graph(tmp_path):
    data = _random_layered_data()
    data["graph"]["order"] = [0, 2, 1, 3]
    _refused(tmp_path, data, "not topological", "node 2")


@pytest.mark.parametrize("order,needle", [
    (["f0", "f1", "f2", "loss", "b2", "b1"], "leaves out node 'b0'"),
    (["f0", "f0", "f1", "f2", "loss", "b2", "b1", "b0"], "node 'f0' twice"),
    (["f0", "f1", "f2", "loss", "b2", "b1", "b0", "ghost"], "'ghost', which is not a node"),
])
def test_order_must_name_every_op_once(tmp_path, order, needle):
    data = _remat_data()
    data["graph"]["order"] = order
    _refused(tmp_path, data, needle)


@pytest.mark.parametrize("key,value", [("bytes", -4), ("bytes", math.nan), ("time", -1.0), ("time", math.nan),
                                       ("time", math.inf), ("workspace", -8), ("flops", math.nan),
                                       ("bytes", "4"), ("time", True)])
def test_negative_or_nan_amounts(tmp_path, key, value):
    data = _remat_data()
    _node(data, "f1")[key] = value
    _refused(tmp_path, data, "node 'f1'", f"{key}=")


@pytest.mark.parametrize("make,node_id,key", [(_random_layered_data, 2, "out_cost"),
                                              (_random_layered_data, 1, "duration"),
                                              (_checkmate_data, 3, "cost_cpu"),
                                              (_checkmate_data, 0, "cost_ram")])
def test_negative_or_nan_benchmark_costs(tmp_path, make, node_id, key):
    for bad in (-1, math.nan):
        data = make()
        _node(data, node_id)[key] = bad
        _refused(tmp_path, data, f"node {node_id}")


@pytest.mark.parametrize("key,value,needle", [("bytes", 4.5, "whole number of bytes"),
                                              ("workspace", 0.25, "whole number of bytes"),
                                              ("recomputable", "no", "true or false"),
                                              ("output", 1, "true or false")])
def test_fractional_bytes_and_flags_that_are_not_booleans(tmp_path, key, value, needle):
    # "no" would read as true, and half a byte as a peak no allocator gives
    data = _remat_data()
    _node(data, "f1")[key] = value
    _refused(tmp_path, data, "node 'f1'", f"{key}=", needle)


def test_whole_floats_of_bytes_load():
    data = _remat_data()
    _node(data, "f1")["bytes"] = 4.0
    assert ComputeGraph.from_dict(data).nx.nodes["f1"]["bytes"] == 4


def test_a_repeated_node_id(tmp_path):
    data = _remat_data()
    data["nodes"].append(dict(_node(data, "f1"), bytes=99))  # would silently replace the first
    _refused(tmp_path, data, "repeats the id 'f1'")


def test_an_order_that_is_not_a_list(tmp_path):
    data = _remat_data()
    data["graph"]["order"] = "f0"  # would read as the nodes 'f' and '0'
    _refused(tmp_path, data, "reference order is a str")
    g = training_chain(2)
    with pytest.raises(GraphFormatError, match="give a list of node ids"):
        g.order = "f0"


def test_unknown_kind_and_phase(tmp_path):
    data = _remat_data()
    _node(data, "f2")["kind"] = "activation"
    _refused(tmp_path, data, "node 'f2'", "unknown kind 'activation'")
    data = _remat_data()
    _node(data, "b1")["phase"] = "optimizer"
    _refused(tmp_path, data, "node 'b1'", "unknown phase")


@pytest.mark.parametrize("node_id,key", [("f1", "bytes"), ("b2", "time"), ("w", "bytes")])
def test_missing_bytes_or_time(tmp_path, node_id, key):
    data = _remat_data()
    del _node(data, node_id)[key]
    _refused(tmp_path, data, f"node {node_id!r}", f"no {key!r}")


def test_a_source_needs_no_time(tmp_path):
    data = _remat_data()
    del _node(data, "w")["time"]
    assert _load(tmp_path, data)["w"]["time"] == 0.0


@pytest.mark.parametrize("make,node_id,key", [(_random_layered_data, 2, "out_cost"),
                                              (_random_layered_data, 3, "duration"),
                                              (_checkmate_data, 1, "cost_cpu"),
                                              (_checkmate_data, 2, "cost_ram")])
def test_missing_benchmark_costs(tmp_path, make, node_id, key):
    data = make()
    del _node(data, node_id)[key]
    _refused(tmp_path, data, f"node {node_id}", f"no {key!r}")


def test_cycle(tmp_path):
    data = _remat_data()
    data["links"].append({"source": "b0", "target": "f0"})
    _refused(tmp_path, data, "cycle")
    bench = _random_layered_data()
    bench["links"].append({"source": 3, "target": 0})
    _refused(tmp_path, bench, "cycle")


@pytest.mark.parametrize("data,needle", [
    ([1, 2, 3], "top level is a list"),
    ("graph", "top level is a str"),
    ({"nodes": []}, "'nodes'"),
    ({"nodes": [{"id": 0, "out_cost": 1, "duration": 1}]}, "'links'"),
    ({"nodes": [{"out_cost": 1, "duration": 1}], "links": []}, "no 'id'"),
])
def test_not_a_node_link_graph(tmp_path, data, needle):
    _refused(tmp_path, data, needle)


def test_link_to_an_unknown_node(tmp_path):
    data = _remat_data()
    data["links"].append({"source": "f0", "target": "nowhere"})
    _refused(tmp_path, data, "'nowhere', which is not a node")
    bench = _checkmate_data()
    bench["links"].append({"source": 7, "target": 0})
    _refused(tmp_path, bench, "7, which is not a node")


def test_from_dict_validates_without_a_file():
    data = _remat_data()
    _node(data, "f0")["bytes"] = -1
    with pytest.raises(GraphFormatError, match="node 'f0'"):
        ComputeGraph.from_dict(copy.deepcopy(data))


def test_validate_an_edited_graph():
    g = training_chain(2)
    g.add_edge("b0", "f0")
    with pytest.raises(GraphFormatError, match="cycle"):
        g.validate()


@pytest.mark.skipif(not BENCHMARK_GRAPHS.exists(), reason="public benchmark graphs not present")
@pytest.mark.parametrize("name", BENCHMARK_NAMES)
def test_every_public_benchmark_graph_loads(name):
    g = ComputeGraph.load(BENCHMARK_GRAPHS / f"{name}.json")
    assert len(g.order) == len(g) > 40
    assert all(g[v]["bytes"] >= 0 and math.isfinite(g[v]["time"]) for v in g.order)


@pytest.mark.parametrize("seed", range(4))
def test_a_graph_without_some_edges_reads_as_a_copy_with_them_removed(seed):
    import random

    g = random_training_graph(30, p=0.3, seed=seed)
    rng = random.Random(seed)
    sources = rng.sample(g.ops, 5)
    gone = [(u, w) for u in sources for w in g.nx.successors(u)] + rng.sample(list(g.nx.edges()), 20)
    before = set(g.nx.edges())
    view = g.without_edges(gone)
    copied = g.nx.copy()
    copied.remove_edges_from(gone)
    assert set(view.nx.edges()) == set(copied.edges()) and set(g.nx.edges()) == before
    for v in g.nx.nodes:
        assert set(view.op_preds(v)) == {u for u in copied.predecessors(v) if copied.nodes[u]["kind"] == "op"}
        assert set(view.op_succs(v)) == {w for w in copied.successors(v) if copied.nodes[w]["kind"] == "op"}
    assert view.order == g.order and view.ops == g.ops and view.fixed_bytes == g.fixed_bytes

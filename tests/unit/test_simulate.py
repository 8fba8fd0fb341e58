"""``dcr simulate``: scenario validation, the timeline model's invariants, the shipped scenarios,
calibration on tiny sizes, and validation against records."""

from __future__ import annotations

import copy
import glob
import json
import math
import os
import re
import statistics
import tomllib

import pytest

from dcr_bench import simulate as cli
from dcr_bench.sim import calibrate, measure, validate
from dcr_bench.sim.model import Model, Stage, pipeline, simulate
from dcr_bench.sim.scenario import ScenarioError, load, parse
from flows import PublishOptions

SCENARIOS = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "scenarios")


def base(**over) -> dict:
    d = {
        "model": {"parameters": 1e9, "bytes_per_param": 2, "change_rate": 0.03, "bytes_per_change": 2.0},
        "topology": {"regions": 2, "receivers_per_region": 4},
        "links": {
            "uplink": {"mb_per_s": 1000, "latency_ms": 10},
            "inter_region": {"mb_per_s": 100, "latency_ms": 50},
            "receiver": {"mb_per_s": 1000, "latency_ms": 5, "scope": "per_receiver"},
        },
        "cpu": {"encode_gb_per_s": 1.0, "decode_apply_gb_per_s": 2.0, "digest_gb_per_s": 5.0, "copy_gb_per_s": 4.0},
        "overhead": {"publish_s": 0.5, "receive_s": 0.5, "mirror_s": 0.2},
    }
    for path, value in over.items():
        node = d
        *head, last = path.split("__")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = value
    return d


def totals(sc) -> dict:
    return {(t.mode, t.streaming): t for t in simulate(sc)}


# ---------------------------------------------------------------- scenario files


def test_unknown_key_names_file_and_field(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('[model]\nparameters = 1e9\nbytes_per_param = 2\nchange_rate = 0.03\nbytes_per_change = 2\ncolour = 1\n'
                 '[links.uplink]\nmb_per_s = 1\n[links.inter_region]\nmb_per_s = 1\n[links.receiver]\nmb_per_s = 1\n'
                 '[cpu]\nencode_gb_per_s = 1\ndecode_apply_gb_per_s = 1\ndigest_gb_per_s = 1\ncopy_gb_per_s = 1\n')
    with pytest.raises(ScenarioError) as e:
        load(str(p))
    msg = str(e.value)
    assert str(p) in msg and "model.colour" in msg and "unknown field" in msg and "\n" not in msg


@pytest.mark.parametrize("path,value,field", [
    ("model__change_rate", 1.5, "model.change_rate"),
    ("model__bytes_per_param", 3, "model.bytes_per_param"),
    ("links__uplink__mb_per_s", -1, "links.uplink.mb_per_s"),
    ("links__receiver__scope", "everyone", "links.receiver.scope"),
    ("topology__receivers_per_region", 0, "topology.receivers_per_region"),
    ("run__modes", ["full", "teleport"], "run.modes.1"),
    ("model__layout", "zipped", "model.layout"),
    ("model__pack_bytes", 0, "model.pack_bytes"),
    ("cpu__publish_s_per_tensor", -1e-3, "cpu.publish_s_per_tensor"),
    ("cpu__receiver_processes", 0, "cpu.receiver_processes"),
    ("requests__get_per_s", 0, "requests.get_per_s"),
    ("requests__colour", 1, "requests.colour"),
])
def test_bad_values_are_one_line_errors(path, value, field):
    with pytest.raises(ScenarioError) as e:
        parse(base(**{path: value}), "x.toml")
    assert str(e.value).startswith(f"x.toml: {field}:") and "\n" not in str(e.value)


def test_layout_and_request_fields_parse():
    sc = parse(base(**{"model__layout": "packed", "model__pack_bytes": 16 << 20, "model__tensors": 500,
                       "cpu__publish_s_per_tensor": 2e-3, "cpu__publisher_processes": 4,
                       "requests__put_per_s": 3500, "requests__get_per_s": 5500, "requests__store_ms": 3}))
    assert (sc.model.layout, sc.model.pack_bytes, sc.cpu.publisher_processes) == ("packed", 16 << 20, 4)
    assert (sc.requests.put_per_s, sc.requests.get_per_s, sc.requests.prefixes) == (3500, 5500, 1)
    today = parse(base())
    assert today.model.layout == "packed" and math.isinf(today.requests.get_per_s)  # dcr publish's default
    assert today.cpu.publish_s_per_tensor is None  # literal costs without a calibration: no per-tensor cost


def test_cpu_costs_must_be_complete():
    d = base()
    del d["cpu"]["digest_gb_per_s"]
    with pytest.raises(ScenarioError, match="cpu"):
        parse(d, "x.toml")


def test_missing_calibration_file_is_an_error(tmp_path):
    d = base()
    d["cpu"] = {"from_calibration": "nope.json"}
    with pytest.raises(ScenarioError, match="cpu.from_calibration"):
        parse(d, "x.toml", str(tmp_path))


def test_not_toml(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text("[model\n")
    with pytest.raises(ScenarioError, match="not TOML"):
        load(str(p))


# ---------------------------------------------------------------- the model


def test_request_counts_follow_the_layout():
    # 100 tensors of 20 MB, 8 MiB chunks: 3 chunks each, and at 3% every chunk and tensor changes
    d = base(**{"model__tensors": 100, "model__chunk_bytes": 8 << 20, "model__fixed_objects": 3,
                "model__layout": "per-object"})
    per_object = Model(parse(d)).size
    assert (per_object.objects, per_object.changed_tensors) == (300, 100)
    assert per_object.puts == 3 + 100 + 300  # an array document per changed tensor, an object per chunk
    assert per_object.gets == 3 + 300
    packed = Model(parse(base(**{"model__tensors": 100, "model__chunk_bytes": 8 << 20, "model__fixed_objects": 3,
                                 "model__layout": "packed", "model__pack_bytes": 4 << 20}))).size
    assert packed.objects == 300 and packed.packs == math.ceil(60e6 / (4 << 20))  # D = 1e9 x 3% x 2 B
    assert packed.puts == packed.gets == 3 + packed.packs


def _cpu_bound(**over) -> dict:
    """A refit whose publisher encode, or receiver apply, is by far its slowest stage."""
    return base(**{"model__tensors": 1000, "topology__regions": 1, "topology__receivers_per_region": 1,
                   "io__workers": 64, **over})


@pytest.mark.parametrize("side", ["publish", "receive"])
def test_per_tensor_cpu_adds_tensors_times_its_cost_to_a_cpu_bound_refit(side):
    # sequential direct = commit + discovery + pipeline(fetch, apply) + tail: with the CPU stage the
    # slowest before and after, each of the n objects carries T_c tau / (n processes) more, so the
    # total grows by exactly T_c tau / processes
    slow = {"cpu__encode_gb_per_s": 0.05} if side == "publish" else {"cpu__decode_apply_gb_per_s": 0.05}
    tau, procs = 1e-3, 4
    before = Model(parse(_cpu_bound(**slow)))
    after = Model(parse(_cpu_bound(**slow, **{f"cpu__{side}_s_per_tensor": tau,
                                              f"cpu__{'publisher' if side == 'publish' else 'receiver'}_processes": procs})))
    t_c, n = after.size.changed_tensors, after.size.objects
    assert t_c == 1000
    stage = (lambda m: m.cpu_pub) if side == "publish" else (lambda m: m.cpu_rec)
    assert stage(after).per_item - stage(before).per_item == pytest.approx(t_c * tau / procs / n)
    grown = after.run("direct", False).total_s - before.run("direct", False).total_s
    assert grown == pytest.approx(t_c * tau / procs, rel=1e-9)


def test_request_rate_limit_bounds_a_fetch():
    # 10 receivers share the regional store's 100 GETs per second: one receiver's fetch stage takes
    # GET / n requests per object at 10 / 100 s each, above its wire and latency time
    d = base(**{"topology__regions": 1, "topology__receivers_per_region": 10, "requests__get_per_s": 100})
    m = Model(parse(d))
    fetch = m._delta_stages()["fetch_region"]
    assert fetch.per_item == pytest.approx(m.size.gets / m.size.objects * 10 / 100)
    unlimited = Model(parse(base(**{"topology__regions": 1, "topology__receivers_per_region": 10})))
    assert unlimited._delta_stages()["fetch_region"].per_item < fetch.per_item
    assert m.run("tree", False).total_s > unlimited.run("tree", False).total_s


def test_store_time_per_request_adds_to_latency():
    one = Model(parse(base(**{"requests__store_ms": 0})))
    slow = Model(parse(base(**{"requests__store_ms": 40})))
    up0, up1 = one._delta_stages()["upload"], slow._delta_stages()["upload"]
    q = one.size.puts / one.size.objects
    assert up1.per_item - up0.per_item == pytest.approx(q * 0.040 / one.w)


def test_pipeline_bound():
    a, b = Stage("a", 1.0, 0.5), Stage("b", 3.0)
    assert pipeline(1, [a, b]) == pytest.approx(4.5)
    assert pipeline(10, [a, b]) == pytest.approx(4.5 + 9 * 3.0)


@pytest.mark.parametrize("over", [
    {},
    {"model__change_rate": 0.001},
    {"model__change_rate": 0.5},
    {"links__inter_region__mb_per_s": 10_000, "cpu__encode_gb_per_s": 0.05},  # CPU-bound
    {"io__discovery_s": 2.0, "topology__regions": 1, "topology__receivers_per_region": 1},
    {"links__receiver__scope": "global", "links__uplink__latency_ms": 200, "io__workers": 1},
    {"io__store_mb_per_s": 50},
])
def test_streaming_never_slower_than_sequential(over):
    t = totals(parse(base(**over)))
    for mode in ("direct", "tree"):
        assert t[(mode, True)].total_s <= t[(mode, False)].total_s + 1e-9


def test_streaming_overlaps_on_a_link_bound_refit():
    # upload and download at the same rate, cheap CPU: streaming hides one of the two transfers
    fast = {f"cpu__{k}": 50.0 for k in ("encode_gb_per_s", "decode_apply_gb_per_s", "digest_gb_per_s", "copy_gb_per_s")}
    sc = parse(base(**fast, **{"model__change_rate": 0.2, "io__workers": 64, "topology__regions": 1,
                               "topology__receivers_per_region": 1, "links__uplink__mb_per_s": 100}))
    t = totals(sc)
    assert t[("direct", True)].total_s < 0.65 * t[("direct", False)].total_s


def test_tree_moves_fewer_inter_region_bytes_and_wins_when_that_link_is_the_bottleneck():
    t = totals(parse(base(**{"io__workers": 64, "topology__receivers_per_region": 8})))
    direct, tree = t[("direct", False)], t[("tree", False)]
    assert tree.bytes_per_link["inter_region"] < direct.bytes_per_link["inter_region"]
    assert direct.bytes_per_link["inter_region"] == pytest.approx(8 * tree.bytes_per_link["inter_region"])
    assert tree.total_s < direct.total_s
    # the same bytes reach every receiver either way
    assert tree.bytes_per_link["receiver"] == direct.bytes_per_link["receiver"]


def test_full_is_slower_than_dcr_at_small_change_rates():
    for rate in (0.001, 0.01, 0.03, 0.05):
        t = totals(parse(base(**{"model__change_rate": rate})))
        full = t[("full", False)].total_s
        assert all(v.total_s < full for k, v in t.items() if k[0] != "full"), rate


def test_more_receivers_on_a_shared_link_take_longer():
    one = totals(parse(base(**{"topology__receivers_per_region": 1})))[("direct", False)].total_s
    many = totals(parse(base(**{"topology__receivers_per_region": 8})))[("direct", False)].total_s
    assert many > one


def test_time_grows_with_delta_bytes_and_shrinks_with_bandwidth():
    small = Model(parse(base())).run("direct", False).total_s
    assert Model(parse(base(**{"model__bytes_per_change": 4.0}))).run("direct", False).total_s > small
    assert Model(parse(base(**{"links__inter_region__mb_per_s": 400}))).run("direct", False).total_s < small


def test_full_link_time_matches_bytes_over_bandwidth():
    d = base(**{"topology__regions": 1, "topology__receivers_per_region": 1})
    d["links"] = {k: {"mb_per_s": 100} for k in ("uplink", "inter_region", "receiver")}
    t = Model(parse(d)).run("full", False)
    assert t.total_s == pytest.approx(2 * 2e9 / 100e6, rel=1e-6)  # 2 GB up, then down through the 100 MB/s hop
    assert t.bytes_per_link == {"uplink": 2e9, "inter_region": 2e9, "receiver": 2e9}


def test_segments_are_ordered_and_end_at_the_total():
    for t in simulate(parse(base())):
        assert all(s.end >= s.start >= 0 for s in t.segments)
        assert max(s.end for s in t.segments) == pytest.approx(t.total_s)


# ---------------------------------------------------------------- shipped scenarios and the command


def test_shipped_scenarios_parse_and_run(tmp_path):
    paths = sorted(glob.glob(os.path.join(SCENARIOS, "*.toml")))
    assert len(paths) >= 5
    for p in paths:
        sc = load(p)
        t = totals(sc)
        assert all(v.total_s > 0 for v in t.values()), p


def test_kimi_scenario_counts_the_tensors_its_comments_add_up():
    path = os.path.join(SCENARIOS, "kimi-k2-1t-3pct.toml")
    sc = load(path)
    text = open(path).read()
    items = [int(x.replace(",", "")) for x in re.findall(r"^#.*=\s+([\d,]+)\s*$", text, re.M)]
    total = int(re.search(r"^#\s+-+\s*\n#\s+([\d,]+)\s*$", text, re.M).group(1).replace(",", ""))
    assert items[0] == 60 * 384 * 3 == 69_120  # routed experts: 60 MoE layers x 384 x 3 projections
    assert sum(items) == total == sc.model.tensors == 69_975
    paper = load(os.path.join(SCENARIOS, "paper-1t-3pct.toml"))
    assert (sc.model.parameters, sc.model.change_rate, sc.model.bytes_per_change) == \
        (paper.model.parameters, paper.model.change_rate, paper.model.bytes_per_change)
    assert sc.topology == paper.topology and sc.links == paper.links and sc.requests == paper.requests
    # dcr publish's default layout, with its measured per-tensor costs from the calibration
    assert sc.model.layout == paper.model.layout == "packed"
    packed = json.load(open(os.path.join(SCENARIOS, "calibration.json")))["per_tensor"]
    assert (sc.cpu.publish_s_per_tensor, sc.cpu.receive_s_per_tensor) == \
        (packed["publish_s_per_tensor"], packed["receive_s_per_tensor"]) == (0.00052, 0.0003)
    t = totals(sc)
    assert t[("tree", True)].total_s > totals(paper)[("tree", True)].total_s


def test_paper_scenario_tree_is_minutes_not_hours():
    t = totals(load(os.path.join(SCENARIOS, "paper-1t-3pct.toml")))
    assert t[("tree", True)].total_s < 600 < 3600 < t[("full", False)].total_s


def test_command_writes_json_and_table(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    p = tmp_path / "s.toml"
    p.write_text(open(os.path.join(SCENARIOS, "local-direct-10mbps.toml")).read()
                 .replace('from_calibration = "calibration.json"',
                          'encode_gb_per_s = 1.0\ndecode_apply_gb_per_s = 2.0\ndigest_gb_per_s = 5.0\ncopy_gb_per_s = 3.0'))
    assert cli.main([str(p), "--out", str(tmp_path / "out")]) == 0
    doc = json.loads((tmp_path / "out" / "simulation.json").read_text())
    assert {(r["mode"], r["streaming"]) for r in doc["summary"]} >= {("full", False), ("direct", True), ("tree", False)}
    assert (tmp_path / "out" / "simulation.png").stat().st_size > 0
    assert "ratio to full" in capsys.readouterr().out


def test_command_reports_bad_scenario(tmp_path, capsys):
    p = tmp_path / "s.toml"
    p.write_text("[model]\nparameters = -1\n")
    assert cli.main([str(p), "--out", str(tmp_path)]) == 2
    assert "model.parameters" in capsys.readouterr().err


# ---------------------------------------------------------------- calibration and validation


def test_calibration_on_tiny_sizes(tmp_path):
    doc = calibrate.calibrate(elements=200_000, dtypes=("bfloat16", "float32"), say=lambda m: None)
    for codec in doc["costs"].values():
        for c in codec.values():
            assert all(c[k] > 0 for k in ("encode_gb_per_s", "decode_apply_gb_per_s", "digest_gb_per_s", "copy_gb_per_s"))
            assert 0.5 < c["bytes_per_change"] < 16
    path = tmp_path / "cal.json"
    calibrate.write(doc, str(path))
    d = base()
    d["cpu"] = {"from_calibration": str(path), "codec": next(iter(doc["costs"]))}
    sc = parse(d, "x.toml")
    assert sc.cpu.encode_gb_per_s == doc["costs"][d["cpu"]["codec"]]["bfloat16"]["encode_gb_per_s"]


def test_calibration_keeps_the_per_tensor_costs_it_does_not_measure(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"costs": {}, "per_tensor": {"publish_s_per_tensor": 2e-3, "receive_s_per_tensor": 5e-4},
                                "per_tensor_per_object": {"publish_s_per_tensor": 3e-3}}))
    fresh = {"costs": {"dcr-sparse": {"bfloat16": {k: 1.0 for k in ("encode_gb_per_s", "decode_apply_gb_per_s",
                                                                    "digest_gb_per_s", "copy_gb_per_s")}}}}
    calibrate.write(fresh, str(path))
    doc = json.loads(path.read_text())
    assert doc["costs"] == fresh["costs"] and doc["per_tensor"]["publish_s_per_tensor"] == 2e-3
    assert doc["per_tensor_per_object"] == {"publish_s_per_tensor": 3e-3}  # every layout's costs are kept
    d = base()
    d["cpu"] = {"from_calibration": str(path), "receive_s_per_tensor": 1e-4}  # a literal value wins
    sc = parse(d, "x.toml")
    assert (sc.cpu.publish_s_per_tensor, sc.cpu.receive_s_per_tensor) == (2e-3, 1e-4)


_PER_BYTE = {"dcr-sparse": {"bfloat16": {k: 1.0 for k in ("encode_gb_per_s", "decode_apply_gb_per_s",
                                                         "digest_gb_per_s", "copy_gb_per_s")}}}


@pytest.mark.parametrize("layout,costs", [("packed", (8.7e-4, 4.8e-4)), ("per-object", (1.87e-3, 4.9e-4))])
def test_a_scenario_takes_the_per_tensor_costs_of_its_layout(tmp_path, layout, costs):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"costs": _PER_BYTE,
                                "per_tensor": {"publish_s_per_tensor": 8.7e-4, "receive_s_per_tensor": 4.8e-4},
                                "per_tensor_per_object": {"publish_s_per_tensor": 1.87e-3,
                                                          "receive_s_per_tensor": 4.9e-4}}))
    d = base(**{"model__layout": layout})
    d["cpu"] = {"from_calibration": str(path)}
    sc = parse(d, "x.toml")
    assert (sc.cpu.publish_s_per_tensor, sc.cpu.receive_s_per_tensor) == costs


def test_a_layout_the_calibration_has_no_costs_for_gets_none(tmp_path):
    # a calibration measured only in the packed layout prices per-object tensors at 0, not at packed costs
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"costs": _PER_BYTE, "per_tensor": {"publish_s_per_tensor": 8.7e-4}}))
    d = base(**{"model__layout": "per-object"})
    d["cpu"] = {"from_calibration": str(path)}
    sc = parse(d, "x.toml")
    assert sc.cpu.publish_s_per_tensor is None and sc.cpu.receive_s_per_tensor is None


def test_shipped_calibration_holds_both_layouts_measurements():
    cal = json.load(open(os.path.join(SCENARIOS, "calibration.json")))
    packed, per_object = cal["per_tensor"], cal["per_tensor_per_object"]
    assert (packed["publish_s_per_tensor"], packed["receive_s_per_tensor"]) == (0.00052, 0.0003)
    assert (per_object["publish_s_per_tensor"], per_object["receive_s_per_tensor"]) == (0.00187, 0.00049)
    # each figure is what its runs give: (median with many tensors - median with 8) / (many - 8)
    runs = packed["runs_s"]
    for phase, key in (("publish", "publish_s_per_tensor"), ("receive", "receive_s_per_tensor")):
        slope = (statistics.median(runs["tensors_70000"][phase]) - statistics.median(runs["tensors_8"][phase])) / (70_000 - 8)
        assert round(slope, 5) == packed[key]


def test_per_object_variant_of_a_shipped_scenario_is_priced_with_per_object_costs():
    with open(os.path.join(SCENARIOS, "kimi-k2-1t-3pct.toml"), "rb") as f:
        d = tomllib.load(f)
    d["model"]["layout"] = "per-object"
    per_object = parse(d, "kimi", SCENARIOS)
    packed = load(os.path.join(SCENARIOS, "kimi-k2-1t-3pct.toml"))
    assert (per_object.cpu.publish_s_per_tensor, per_object.cpu.receive_s_per_tensor) == (0.00187, 0.00049)
    assert Model(per_object).size.puts == 2 * 69_975 and Model(packed).size.puts == 7153
    # streaming through the relay tree, packed: within 25% of the paper's 2,000 tensors; per-object: slower
    paper = totals(load(os.path.join(SCENARIOS, "paper-1t-3pct.toml")))[("tree", True)].total_s
    assert totals(packed)[("tree", True)].total_s <= 1.25 * paper
    assert totals(per_object)[("tree", True)].total_s > totals(packed)[("tree", True)].total_s


def test_records_measured_before_packs_name_their_layout():
    # the default layout is packed now: a record measured on the per-object layout must say so, or its
    # prediction would silently change
    root = os.path.join(SCENARIOS, "..", "..")
    for path in ("docs/simulate/measured/records.json", "docs/bench-stream/fp32/validation-records.json"):
        for r in json.load(open(os.path.join(root, path))):
            assert r["scenario"]["model"]["layout"] == "per-object", (path, r["name"])


def test_measured_scenario_names_the_layout_its_publish_used():
    sc = measure.scenario_dict(params=1000, changed=30, stored=60, tensors=2, file_bytes=2000, bandwidth=None,
                               latency_s=0.001, workers=1, store_mb_per_s=100.0,
                               costs={k: 1.0 for k in ("encode_gb_per_s", "decode_apply_gb_per_s",
                                                       "digest_gb_per_s", "copy_gb_per_s")},
                               overhead={"publish_s": 0.1, "receive_s": 0.1})
    assert (sc["model"]["layout"], sc["model"]["pack_bytes"]) == ("packed", PublishOptions().pack_bytes)
    assert parse(sc).model.layout == "packed"


def test_bad_per_tensor_calibration_is_a_one_line_error(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"costs": {"dcr-sparse": {"bfloat16": {k: 1.0 for k in (
        "encode_gb_per_s", "decode_apply_gb_per_s", "digest_gb_per_s", "copy_gb_per_s")}}},
        "per_tensor": {"publish_s_per_tensor": -1}}))
    d = base()
    d["cpu"] = {"from_calibration": str(path)}
    with pytest.raises(ScenarioError) as e:
        parse(d, "x.toml")
    assert str(e.value).startswith(f"x.toml: cpu.from_calibration: {path}: publish_s_per_tensor:")
    assert "\n" not in str(e.value)


def test_fp32_pair_changes_the_asked_fraction():
    old, new = calibrate.fp32_pair(100_000, 0.05, seed=1)
    frac = calibrate.changed_elements(old, new) / sum(t.numel() for t in old.values())
    assert 0.04 < frac < 0.06


def _records(sc: dict, measured: float) -> list[dict]:
    return [{"name": "r", "scenario": sc, "mode": "direct", "streaming": False, "measured_s": measured}]


def test_validate_marks_within_and_outside(tmp_path, capsys):
    sc = base(**{"topology__regions": 1, "topology__receivers_per_region": 1})
    predicted = Model(parse(copy.deepcopy(sc))).run("direct", False).total_s
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_records(sc, predicted * 1.1)))
    assert cli.main(["--validate", str(good), "--out", str(tmp_path / "v1")]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_records(sc, predicted * 2.0)))
    assert cli.main(["--validate", str(bad), "--out", str(tmp_path / "v2")]) == 1
    rows = json.loads((tmp_path / "v2" / "validation.json").read_text())["comparison"]
    assert rows[0]["within"] is False and rows[0]["ratio"] == pytest.approx(0.5)
    assert "NO" in capsys.readouterr().out


def test_validate_rejects_bad_records(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps([{"name": "r", "scenario": base(), "mode": "sideways", "streaming": False, "measured_s": 1}]))
    with pytest.raises(ScenarioError, match="record 0: mode"):
        validate.load_records(str(p))
    p.write_text(json.dumps(_records(base(**{"model__change_rate": 7}), 1.0)))
    with pytest.raises(ScenarioError, match="model.change_rate"):
        validate.compare(validate.load_records(str(p)), str(p))


def test_on_shared_cores_streaming_is_bound_by_its_cpu():
    # CPU-heavy refit on one machine: the streamed pipeline cannot beat the CPU all its stages cost
    slow = {f"cpu__{k}": 0.2 for k in ("encode_gb_per_s", "decode_apply_gb_per_s")}
    free = totals(parse(base(**slow)))
    one = parse(base(**slow, **{"io__shared_cores": 1}))
    shared = totals(one)
    assert shared[("direct", True)].total_s > free[("direct", True)].total_s  # the bound bites
    assert shared[("direct", False)].total_s == pytest.approx(free[("direct", False)].total_s)  # sequential unchanged
    m = Model(one)
    assert shared[("direct", True)].total_s >= m.size.objects * (m.cpu_pub.per_item + m.cpu_rec.per_item)
    with pytest.raises(ScenarioError):
        parse(base(**{"io__shared_cores": 0}))


def test_json_prints_every_prediction(tmp_path, capsys):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "scenarios", "paper-1t-3pct.toml")
    assert cli.main([path, "--json", "--out", str(tmp_path)]) == 0
    docs = json.loads(capsys.readouterr().out)
    assert len(docs) == 1
    with open(tmp_path / "simulation.json") as f:
        assert json.load(f) == json.loads(json.dumps(docs[0]))


# ---------------------------------------------------------------- what the command prints and draws


def test_sizes_print_in_units_never_as_exponents(tmp_path, capsys):
    from dcr_bench.sim.output import fmt_bytes, fmt_count

    assert [fmt_bytes(x) for x in (2e12, 60e9, 9.39e6, 400e6, 1500, 12)] == ["2 TB", "60 GB", "9.39 MB", "400 MB",
                                                                            "1.5 kB", "12 B"]
    assert [fmt_count(x) for x in (1e12, 247e9, 1e8, 5e4)] == ["1T", "247B", "100M", "50k"]
    assert cli.main([os.path.join(SCENARIOS, "paper-1t-3pct.toml"), "--out", str(tmp_path)]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith("paper-1t-3pct: 1T params x 2 B = 2 TB, 3% changed x 2 B = delta 60 GB in "), head
    assert "e+" not in head


def test_plot_one_time_scale_labelled_log_ticks_and_a_colour_per_phase():
    pytest.importorskip("matplotlib")
    import matplotlib.colors
    import matplotlib.pyplot as plt

    from dcr_bench.sim.output import figure

    for name in ("paper-1t-3pct.toml", "local-direct-10mbps.toml"):
        sc = load(os.path.join(SCENARIOS, name))
        timelines = simulate(sc)
        fig = figure(sc, timelines)
        fig.canvas.draw()
        *gantt, totals = fig.axes
        assert len(gantt) == len(timelines)
        assert len({ax.get_xlim() for ax in gantt}) == 1  # one time scale: bar lengths compare across charts
        assert gantt[0].get_xlim()[1] >= max(t.total_s for t in timelines)
        lo, hi = totals.get_xlim()
        labelled = [t.get_text() for t in totals.xaxis.get_ticklabels() if lo <= t.get_position()[0] <= hi and t.get_text()]
        assert len(labelled) >= 3, labelled  # more than the one decade label a narrow log range gets by default
        assert lo <= min(t.total_s for t in timelines) and max(t.total_s for t in timelines) < hi
        legend = fig.legends[0]
        colours = {t.get_text(): matplotlib.colors.to_hex(h.get_facecolor()) for t, h in
                   zip(legend.get_texts(), legend.legend_handles)}
        assert len(set(colours.values())) == len(colours), colours  # upload is not encode+upload's colour
        plt.close(fig)

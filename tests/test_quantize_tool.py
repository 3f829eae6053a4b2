"""tools/quantize.py on a two-layer graph: symmetric QDQ, and --keep-float leaves a layer in float."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

# the runtime's floor is onnxruntime 1.20; the tool's q4 quantizer module is 1.22's (README "Set-up")
pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer",
                    reason="tools/quantize.py needs onnxruntime 1.22 or newer")
from tools.quantize import matching_nodes, quantize_graph


def two_matmuls(path: Path) -> None:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(size=(8, 16)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(size=(16, 4)).astype(np.float32), "w2")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="/first/MatMul"),
         helper.make_node("Relu", ["h"], ["r"], name="/relu"),
         helper.make_node("MatMul", ["r", "w2"], ["y"], name="/head/MatMul")],
        "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # as an exporter writes it: make_model's default is the newest onnx knows
    onnx.save(model, str(path))


def weight_is_quantized(model: onnx.ModelProto, node_name: str) -> bool:
    """Does the node's weight input come out of a DequantizeLinear?"""
    node = next(n for n in model.graph.node if n.name == node_name)
    dq_outputs = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return node.input[1] in dq_outputs


def test_keep_float_leaves_the_named_layer_unquantized(tmp_path):
    src, dst = tmp_path / "two.onnx", tmp_path / "two_int8.onnx"
    two_matmuls(src)
    feeds = [{"x": np.random.default_rng(i).normal(size=(3, 8)).astype(np.float32)} for i in range(8)]
    assert matching_nodes(src, ["/head/*"]) == ["/head/MatMul"]
    kept = quantize_graph(src, dst, feeds, "minmax", keep_float=["/head/*"])
    assert kept == ["/head/MatMul"]
    model = onnx.load(str(dst))
    assert weight_is_quantized(model, "/first/MatMul")
    assert not weight_is_quantized(model, "/head/MatMul")
    # symmetric: every zero point is 0, as TensorRT's explicit quantization needs
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    zero_points = [inits[n.input[2]] for n in model.graph.node
                   if n.op_type == "QuantizeLinear" and len(n.input) > 2]
    assert zero_points and all(not z.any() for z in zero_points)
    # and it still computes nearly the same function
    x = feeds[0]["x"]
    ref = ort.InferenceSession(str(src)).run(None, {"x": x})[0]
    out = ort.InferenceSession(str(dst)).run(None, {"x": x})[0]
    assert np.abs(out - ref).max() < 0.2 * np.abs(ref).max()


def test_without_keep_float_every_layer_is_quantized(tmp_path):
    src, dst = tmp_path / "two.onnx", tmp_path / "two_int8.onnx"
    two_matmuls(src)
    feeds = [{"x": np.random.default_rng(i).normal(size=(3, 8)).astype(np.float32)} for i in range(8)]
    assert quantize_graph(src, dst, feeds, "minmax") == []
    model = onnx.load(str(dst))
    assert weight_is_quantized(model, "/first/MatMul") and weight_is_quantized(model, "/head/MatMul")


def test_percentile_clips_the_range_that_one_outlier_would_set(tmp_path):
    """Feeds of two shapes (onnxruntime's own percentile calibration cannot take them) with one
    huge outlier: minmax stretches the input's scale to it, percentile does not."""
    src = tmp_path / "two.onnx"
    two_matmuls(src)
    feeds = [{"x": np.random.default_rng(i).normal(size=(3 + i % 2, 8)).astype(np.float32)} for i in range(40)]
    feeds[5]["x"][0, 0] = 1000.0
    scales = {}
    for method in ("minmax", "percentile"):
        dst = tmp_path / f"{method}.onnx"
        quantize_graph(src, dst, feeds, method, percentile=99.9)
        model = onnx.load(str(dst))
        inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "x")
        scales[method] = float(inits[q.input[1]])
    assert scales["minmax"] > 1000 / 128  # the outlier sets the range
    assert scales["percentile"] < 10 / 127  # ordinary values (|x| < ~4) set it


def test_the_model_folder_names_its_float_layers(tmp_path, model_dir):
    from tools.quantize import model_keep_float
    keep = model_keep_float(model_dir)
    assert keep and matching_nodes(model_dir / "vision_encoder.onnx", keep)  # the globs name real layers
    assert model_keep_float(tmp_path) == []  # no model.yaml (a Hugging Face folder): nothing kept
    (tmp_path / "model.yaml").write_text("quantization:\n  keep_float: /body.4/conv/Conv\n")
    with pytest.raises(SystemExit, match="keep_float must be a list"):
        model_keep_float(tmp_path)


def test_the_shipped_int8_encoder_leaves_exactly_those_layers_float(model_dir):
    from tools.quantize import model_keep_float
    kept = set(matching_nodes(model_dir / "vision_encoder.onnx", model_keep_float(model_dir)))
    model = onnx.load(str(model_dir / "vision_encoder_int8.onnx"))
    convs = [n.name for n in model.graph.node if n.op_type == "Conv"]
    assert kept and kept < set(convs)
    for name in convs:
        assert weight_is_quantized(model, name) == (name not in kept), name


# ---- calibration reduced in the graph (bounded memory at real size) ------------------------

def ranges_from_every_activation(prepared: Path, feeds: list, method: str, moving_average: bool = False,
                                 percentile: float = 99.99) -> dict:
    """The reference: every Conv/MatMul/Gemm float tensor made a graph output (the calibration
    before reduction_graph; gigabytes per input at real size) and reduced in numpy, percentile
    samples picked by the same rule (value floor(u·n) of a tensor of n > SAMPLES_PER_FEED)."""
    from onnxruntime.quantization.qdq_loss_debug import (_TENSOR_SAVE_POSTFIX as SAVED,
                                                         modify_model_output_intermediate_tensors)
    from tools.quantize import MOVING_AVERAGE, SAMPLES_PER_FEED
    rng = np.random.default_rng(0)
    augmented = prepared.with_name("every_activation.onnx")
    modify_model_output_intermediate_tensors(str(prepared), str(augmented), ["Conv", "MatMul", "Gemm"])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(augmented), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs() if o.name.endswith(SAVED)]
    largest, samples = {}, {}
    for feed in feeds:
        u = rng.random(SAMPLES_PER_FEED) if method == "percentile" else None
        for output, value in zip(names, session.run(names, feed)):
            name, magnitude = output[:-len(SAVED)], np.abs(value.reshape(-1))
            if magnitude.size == 0:
                continue
            if method == "percentile":
                n = magnitude.size
                if n > SAMPLES_PER_FEED:
                    magnitude = magnitude[np.minimum(np.floor(u * n).astype(np.int64), n - 1)]
                samples.setdefault(name, []).append(magnitude.astype(np.float32))
                continue
            r = float(magnitude.max())
            if name not in largest:
                largest[name] = r
            elif moving_average:
                largest[name] += MOVING_AVERAGE * (r - largest[name])
            else:
                largest[name] = max(largest[name], r)
    if method == "percentile":
        largest = {k: float(np.percentile(np.concatenate(v), percentile)) for k, v in samples.items()}
    return {k: r for k, r in largest.items() if r > 0}


@pytest.fixture(scope="module", params=["tiny-vlm", "idefics3-tiny"])
def calibration_case(request, model_dir, tmp_path_factory):
    """(prepared decoder or encoder graph, its calibration feeds) of the built-in model and of
    the idefics3 fixture (SmolVLM's family), from a few generated scenes."""
    from onnxruntime.quantization.shape_inference import quant_pre_process
    from tools.quantize import SceneFeeds, fp32_runtime
    folder = model_dir if request.param == "tiny-vlm" else model_dir.parent.parent / "tests/fixtures/idefics3-tiny"
    rt = fp32_runtime(folder)
    cases = {}
    for component in ("vision_encoder", "decoder"):
        prepared = tmp_path_factory.mktemp(f"{request.param}-{component}") / "prepared.onnx"
        quant_pre_process(str(rt.manifest.graph_path(component, "fp32")), str(prepared), skip_symbolic_shape=True)
        cases[component] = (prepared, list(SceneFeeds(rt, component, 8)))
    return cases


@pytest.mark.parametrize("component", ["vision_encoder", "decoder"])
@pytest.mark.parametrize("method, moving_average", [("minmax", False), ("minmax", True), ("percentile", False)])
def test_ranges_reduced_in_the_graph_equal_every_activation_reduced_in_numpy(calibration_case, component,
                                                                          method, moving_average):
    from tools.quantize import activation_ranges
    prepared, feeds = calibration_case[component]
    assert len(feeds) > 4  # several inputs: the maxima and the moving average are over inputs
    expected = ranges_from_every_activation(prepared, feeds, method, moving_average)
    first: list = []
    got = activation_ranges(prepared, feeds, method, 99.99, moving_average, first)
    assert got.keys() == expected.keys() and len(got) > 10
    for name, r in expected.items():
        assert got[name] == [{"rmin": np.float32(-r), "rmax": np.float32(r)}], name
    assert first[0] is min(feeds, key=lambda f: sum(v.nbytes for v in f.values()))


@pytest.mark.parametrize("method", ["minmax", "percentile"])
def test_the_calibration_graph_outputs_nothing_larger_than_its_samples(tmp_path, model_dir, method):
    """Bounded memory: besides the graph's own outputs, only sizes, extremes and samples come
    out, so onnxruntime frees every activation once used, as in an ordinary run."""
    from tools.quantize import REDUCTION, SAMPLE_INPUT, SAMPLES_PER_FEED, SceneFeeds, fp32_runtime, reduction_graph
    src = model_dir / "vision_encoder.onnx"
    model, tensors = reduction_graph(src, method)
    path = tmp_path / "reduced.onnx"
    onnx.save(model, str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    own = {o.name for o in onnx.load(str(src), load_external_data=False).graph.output}
    added = [o.name for o in session.get_outputs() if o.name not in own]
    assert added and all(name.startswith(REDUCTION + "/") for name in added)
    assert len(added) == len(tensors) * (3 if method == "minmax" else 2)
    feed = next(iter(SceneFeeds(fp32_runtime(model_dir), "vision_encoder", 1)))
    if method == "percentile":
        feed[SAMPLE_INPUT] = np.random.default_rng(0).random(SAMPLES_PER_FEED)
    values = session.run(added, feed)
    assert max(v.size for v in values) <= SAMPLES_PER_FEED
    activation_sizes = [int(v) for name, v in zip(added, values) if name.endswith("/size")]
    assert max(activation_sizes) > SAMPLES_PER_FEED  # the encoder's activations are larger than that


def test_the_progress_line_says_scene_inputs_seconds_and_eta(model_dir, capsys):
    from tools.quantize import SceneFeeds, fp32_runtime
    feeds = SceneFeeds(fp32_runtime(model_dir), "decoder", 3)
    count = sum(1 for _ in feeds)
    err = capsys.readouterr().err
    assert count == feeds.count > 3
    last = err.rstrip("\n").split("\r")[-1]
    assert last.startswith(f"calibrating decoder: scene 3/3, {count} inputs, ")
    assert " s, ETA 0 s" in last
    assert "scene 1/3" in err and "ETA " in err.split("scene 2/3")[0]


def test_a_real_size_model_gets_the_few_scenes_default(tmp_path):
    from tools.quantize import LARGE_MODEL_SCENES, SMALL_MODEL_BYTES, SMALL_MODEL_SCENES, default_scenes

    class Manifest:  # graph_path as a model folder's manifest answers it
        def __init__(self, total: int):
            self.total = total

        def graph_path(self, component: str, precision: str) -> Path:
            path = tmp_path / f"{self.total}-{component}.onnx"
            with path.open("wb") as f:
                f.truncate(self.total // 3)  # sparse: no disk used
            return path

    assert default_scenes(Manifest(SMALL_MODEL_BYTES // 2)) == SMALL_MODEL_SCENES
    assert default_scenes(Manifest(SMALL_MODEL_BYTES * 16)) == LARGE_MODEL_SCENES


@pytest.mark.parametrize("method", ["minmax", "percentile"])
def test_each_reduction_runs_right_after_its_tensor_is_made(tmp_path, model_dir, method):
    """What keeps the memory at an ordinary run's: in onnxruntime's execution order (from its
    profile), no Conv / MatMul / Gemm of the graph itself runs between a tensor's producer and
    the reductions of that tensor, so the tensor is freed as soon as the graph is done with it
    (shape nodes may: this order runs them first). In onnxruntime's default order this fails:
    the reductions ran late, after layers that made tensors of their own."""
    import json
    from tools.quantize import REDUCTION, SAMPLE_INPUT, SAMPLES_PER_FEED, SceneFeeds, calibration_options, fp32_runtime
    from tools.quantize import reduction_graph
    model, tensors = reduction_graph(model_dir / "vision_encoder.onnx", method)
    path = tmp_path / "reduced.onnx"
    onnx.save(model, str(path))
    producer = {t: n.name for n in model.graph.node if not n.name.startswith(REDUCTION) for t in n.output}
    heavy = {n.name for n in model.graph.node if n.op_type in ("Conv", "MatMul", "Gemm")}
    options = calibration_options()
    options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "profile")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feed = next(iter(SceneFeeds(fp32_runtime(model_dir), "vision_encoder", 1)))
    if method == "percentile":
        feed[SAMPLE_INPUT] = np.random.default_rng(0).random(SAMPLES_PER_FEED)
    session.run(None, feed)
    events = json.loads(Path(session.end_profiling()).read_text())
    order = [e["name"][:-len("_kernel_time")] for e in sorted(events, key=lambda e: e["ts"])
             if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    last_own = None  # the graph's own Conv / MatMul / Gemm run last
    checked = 0
    for name in order:
        if not name.startswith(REDUCTION + "/"):
            last_own = name if name in heavy else last_own
            continue
        tensor = tensors[int(name.split("/")[1])]
        if producer.get(tensor) in heavy:  # (a graph input is the caller's, alive throughout anyway)
            assert last_own == producer[tensor], (name, tensor, last_own)
            checked += 1
    assert checked > len(tensors)

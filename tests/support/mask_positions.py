"""A decoder graph rewritten to compute its positions from the attention mask, as graphs made for
transformers.js may: the `position_ids` input is dropped and nodes computing
cumsum(attention_mask) - 1 for the last S positions (S: the tokens fed) take its place."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def without_position_ids(source: Path, target: Path) -> None:
    """Write `source`'s decoder to `target` with position_ids computed inside the graph."""
    model = onnx.load(str(source))
    graph = model.graph
    declared = next(i for i in graph.input if i.name == "position_ids")
    dtype = declared.type.tensor_type.elem_type
    graph.input.remove(declared)
    prefix = "mask_positions/"
    constants = {"one": np.array(1, np.int64), "axis": np.array(1, np.int64),
                 "axes": np.array([1], np.int64), "second": np.array([1], np.int64),
                 "third": np.array([2], np.int64)}
    graph.initializer.extend(numpy_helper.from_array(v, prefix + k) for k, v in constants.items())
    n = lambda name: prefix + name  # noqa: E731 (a short name for the tensor names below)
    nodes = [
        helper.make_node("Cast", ["attention_mask"], [n("mask")], to=TensorProto.INT64),
        helper.make_node("CumSum", [n("mask"), n("axis")], [n("cumsum")]),
        helper.make_node("Sub", [n("cumsum"), n("one")], [n("all")]),  # every column's position
        helper.make_node("Shape", ["attention_mask"], [n("mask_shape")]),
        helper.make_node("Slice", [n("mask_shape"), n("second"), n("third")], [n("total")]),
        helper.make_node("Shape", ["inputs_embeds"], [n("embeds_shape")]),
        helper.make_node("Slice", [n("embeds_shape"), n("second"), n("third")], [n("fed")]),
        helper.make_node("Sub", [n("total"), n("fed")], [n("start")]),
        helper.make_node("Slice", [n("all"), n("start"), n("total"), n("axes")], [n("last")]),
        helper.make_node("Cast", [n("last")], ["position_ids"], to=dtype),
    ]
    for node in reversed(nodes):  # before every node that reads position_ids
        graph.node.insert(0, node)
    onnx.checker.check_model(model)
    onnx.save(model, str(target))

"""The rules that give a compiled graph's save its width (``daf.runtime.graph_rules``), from a table: what made
the save, who reads it in backward, its dtype and shape, and the policy."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from daf.config import Adaptive, Auto, Config
from daf.runtime.graph_rules import GraphWidths, Readers, decide, producer_of


class Node:
    """A backward fx node as the rules read it."""

    def __init__(self, target: object, *args: object, **kwargs: object) -> None:
        self.target, self.args, self.kwargs = target, args, kwargs


SAVED = Node("placeholder")
RELU_BACKWARD = Node("aten.threshold_backward.default", "g", SAVED, 0)
aten = torch.ops.aten
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _readers(*nodes: Node) -> Readers:
    return Readers(tuple(nodes), frozenset({SAVED}))


FEATURE_MAP = torch.empty(4, 8, 16, 16)
ROWS = torch.empty(512, 256)
CASES = [  # (save, producer, readers, form, bits, why contains)
    (FEATURE_MAP, "aten.convolution.default", _readers(Node("aten.native_batch_norm_backward.default")),
     "codes", 2, "feature map"),
    (FEATURE_MAP, "aten.convolution.default", _readers(Node("aten.sub.Tensor")), "codes", 2, "feature map"),  # inductor
    (FEATURE_MAP, "aten.relu.default", _readers(RELU_BACKWARD), "sign", 1, "sign bits"),
    # Auto's nonzeros rule: 4-bit codes of the nonzeros where they fit in 2-bit codes of the map
    (FEATURE_MAP, "aten.relu.default", _readers(RELU_BACKWARD, Node("aten.max_pool2d_with_indices_backward.default")),
     "nonzeros", 4, "nonzeros at 4 bits"),
    (FEATURE_MAP.bfloat16(), "aten.relu.default", _readers(RELU_BACKWARD, Node("aten.convolution_backward.default")),
     "codes+sign", 2, "feature map"),  # the nonzeros ops are float32's
    (ROWS, "aten.relu.default", _readers(RELU_BACKWARD, Node("aten.mm.default")), "codes+sign", 4, "linear"),
    # inductor's partitioner recomputes ReLU's mask from the save: the sign must survive the codes
    (FEATURE_MAP, "aten.relu.default", _readers(Node("aten.le.Scalar", SAVED, 0), Node("aten.convolution_backward.default")),
     "nonzeros", 4, "zeros exact"),
    (FEATURE_MAP, "aten.relu.default", _readers(Node("aten.le.Scalar", SAVED, 0)), "sign", 1, "sign bits"),
    (FEATURE_MAP, "aten.add.Tensor", _readers(Node("aten.le.Scalar", SAVED, 1)), "codes", 8, "compares"),
    (ROWS, "aten.addmm.default", _readers(Node("aten.gelu_backward.default")), "codes", 4, "linear"),
    (ROWS, "aten.addmm.default", _readers(Node("aten.tanh.default")), "codes", 8, "saturating"),  # recomputed tanh
    (ROWS, "aten._softmax.default", _readers(Node("aten._softmax_backward_data.default")), "codes", 8, "saturating"),
    (torch.empty(4, 8, 64, 64), "aten.convolution.default", _readers(Node("aten.mm.default")), "codes", 4, "linear"),
    (torch.empty(64, 64, dtype=torch.bool), "aten.gt.Scalar", _readers(Node("aten.mul.Tensor")), "mask", 1, "boolean"),
    (torch.empty(64, 64, dtype=torch.int64), "aten.max_pool2d_with_indices.default", _readers(), "raw", None, "integer"),
    (torch.empty(16), "aten.convolution.default", _readers(), "raw", None, "min_numel"),
    (ROWS, None, None, "codes", 4, "linear"),  # eagerly: nobody says who reads it
    # ReLU6's backward compares the save with 0 and 6: codes would move elements across them
    (FEATURE_MAP, "aten.native_batch_norm.default", _readers(Node("aten.hardtanh_backward.default")),
     "raw", None, "against its bounds"),
    (FEATURE_MAP, "aten.convolution.default", _readers(Node("aten.leaky_relu_backward.default"),
                                                       Node("aten.convolution_backward.default")),
     "raw", None, "against its bounds"),
]


@pytest.mark.parametrize("save, producer, readers, form, bits, why", CASES)
def test_the_default_policy_in_a_graph(save, producer, readers, form, bits, why):
    config = Config(min_numel=64)
    got = decide(save, producer, readers, GraphWidths.of(config), config)
    assert (got.form, got.bits) == (form, bits) and why in got.why


def _chain(*targets: str) -> tuple[Node, Node]:
    """Backward nodes reading one another in turn, the first reading the save: (first, last)."""
    nodes = [Node(targets[0], SAVED)]
    for target in targets[1:]:
        nodes.append(Node(target, nodes[-1], 0))
    for node, user in zip(nodes, nodes[1:]):
        node.users = {user: None}
    nodes[-1].users = {}
    return nodes[0], nodes[-1]


@pytest.mark.parametrize("chain, compared", [
    # inductor recomputes relu(bn(x)) from a batch norm's saved input and takes ReLU's mask from it
    (("aten.sub.Tensor", "aten.mul.Tensor", "aten.mul.Tensor", "aten.add.Tensor", "aten.relu.default",
      "aten.le.Scalar"), True),
    (("aten.sub.Tensor", "aten.mul.Tensor", "aten.relu.default", "aten.where.self"), True),
    (("aten.sub.Tensor", "aten.mul.Tensor", "aten.sum.dim_IntList"), False),  # the norm's backward alone
    (("aten.sub.Tensor",) + ("aten.mul.Tensor",) * 12 + ("aten.le.Scalar",), False),  # beyond the walk's depth
])
def test_a_save_backward_compares_after_recomputing_gets_sensitive_bits(chain, compared):
    first, _ = _chain(*chain)
    config = Config(min_numel=64)
    got = decide(FEATURE_MAP, "aten.convolution.default", _readers(first), GraphWidths.of(config), config)
    assert (got.form, got.bits, "compares" in got.why) == (("codes", 8, True) if compared else ("codes", 2, False))


def test_uniform_bits_keep_relu_outputs_as_codes_and_sign_bits():
    config = Config(bits=2, min_numel=64)
    got = decide(FEATURE_MAP, "aten.relu.default", _readers(RELU_BACKWARD, Node("aten.convolution_backward.default")),
                 GraphWidths.of(config), config)
    assert (got.form, got.bits) == ("codes+sign", 2)


@pytest.mark.parametrize("role, form, bits", [("query", "raw", None), ("key", "raw", None), ("value", "codes", 8),
                                              ("out", "codes", 8), ("logsumexp", "raw", None),
                                              ("attn_mask", "raw", None)])
def test_fused_attention_keeps_q_k_and_logsumexp_raw_and_codes_v_and_the_output_at_8_bits(role, form, bits):
    names = [argument.name for argument in FLASH_BACKWARD._schema.arguments]
    positional = [a.name for a in FLASH_BACKWARD._schema.arguments if not a.kwarg_only]
    args = [Node(f"other{i}") for i in range(len(positional))]
    kwargs = {}
    if role in positional:
        args[positional.index(role)] = SAVED
    else:  # attn_mask is keyword-only: a causal mask with -inf where masked
        assert role in names
        kwargs[role] = SAVED
    config = Config(min_numel=64)
    got = decide(torch.empty(4, 4, 64, 16), None, _readers(Node(FLASH_BACKWARD, *args, **kwargs)),
                 GraphWidths.of(config), config)
    assert (got.form, got.bits) == (form, bits)
    if form == "raw":
        assert ("logits' magnitude" if role != "attn_mask" else "-inf where masked") in got.why


def test_uniform_bits_apply_everywhere_and_adaptive_falls_back_to_8_bits_saying_so():
    uniform = Config(bits=2)
    for save, producer, readers, form, _, _ in CASES:
        if form in ("codes", "codes+sign"):
            assert decide(save, producer, readers, GraphWidths.of(uniform), uniform).bits == 2
    adaptive = Config(policy=Adaptive(average=2.0))
    got = decide(ROWS, "aten.addmm.default", _readers(Node("aten.mm.default")), GraphWidths.of(adaptive), adaptive)
    assert got.bits == 8 and "Adaptive policy decides from data at run time" in got.why
    assert GraphWidths.of(Config(policy=Auto(bits=8, feature_map_bits=4))) == GraphWidths(8, 4, 8, nonzeros=True)


def test_masks_false_keeps_booleans_raw():
    config = Config(min_numel=1, masks=False)
    got = decide(torch.empty(64, dtype=torch.bool), None, _readers(), GraphWidths.of(config), config)
    assert got.form == "raw"


def test_the_producer_is_found_past_views_and_a_softmax_tail():
    def softmax_tail(x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x - x.amax(-1, keepdim=True))
        return torch.where(x > -1e9, e / e.sum(-1, keepdim=True), 0).transpose(0, 1)

    def conv_view(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.conv2d(x, w).flatten(1).t()

    graph = make_fx(softmax_tail)(torch.randn(4, 8)).graph
    assert producer_of(graph.output_node().args[0]) == "aten.exp.default"
    graph = make_fx(conv_view)(torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)).graph
    assert producer_of(graph.output_node().args[0]) == "aten.convolution.default"


def test_attention_values_multiplied_with_the_probabilities_get_sensitive_bits_in_a_graph():
    """Eager attention traced: v (the other operand of the probabilities' product) is found from the forward
    graph and gets ``sensitive_bits``, as eager Auto gives it; q, k and the probabilities are not values."""
    from daf.runtime.graph_rules import values_of_probabilities

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    graph = make_fx(attention)(*(torch.randn(2, 4, 16, 8) for _ in range(3))).graph
    q, k, v = graph.find_nodes(op="placeholder")
    assert values_of_probabilities(v) and not values_of_probabilities(q) and not values_of_probabilities(k)
    softmax = next(n for n in graph.nodes if "softmax" in str(n.target))
    assert not values_of_probabilities(softmax)
    widths = GraphWidths.of(Config())
    read_by_bmm = _readers(Node("aten.bmm.default"))
    assert decide(ROWS, "aten.view.default", read_by_bmm, widths, Config()).bits == Auto().bits
    decision = decide(ROWS, "aten.view.default", read_by_bmm, widths, Config(), values=True)
    assert decision.bits == Auto().sensitive_bits and "other operand of softmax's probabilities" in decision.why


def _graph(function, *args):
    return make_fx(function)(*args).graph


CONV_GRAPH = _graph(lambda x, w: torch.relu(torch.conv2d(x, w)), torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3))
LINEAR_GRAPH = _graph(lambda x, w: torch.relu(x @ w), torch.randn(8, 8), torch.randn(8, 8))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="inductor lays out CPU graphs by oneDNN's choice")
@pytest.mark.parametrize("save, graph, producer, readers, order", [
    # inductor gives a CPU graph with a convolution channels-last feature maps: flatten them so, a view there
    (FEATURE_MAP, CONV_GRAPH, "aten.convolution.default", _readers(), (0, 2, 3, 1)),
    (FEATURE_MAP, CONV_GRAPH, "aten.add.Tensor", _readers(Node("aten.convolution_backward.default")), (0, 2, 3, 1)),
    # not a feature map, no convolution in the graph, not 4-D, not on the CPU, no graph (eager): the trace's order
    (FEATURE_MAP, CONV_GRAPH, "aten.bmm.default", _readers(Node("aten.bmm.default")), (0, 1, 2, 3)),
    (FEATURE_MAP, LINEAR_GRAPH, "aten.relu.default", _readers(), (0, 1, 2, 3)),
    (torch.empty(4, 8, 16), CONV_GRAPH, "aten.convolution.default", _readers(), (0, 1, 2)),
    (torch.empty(4, 8, 16, 16, device="meta"), CONV_GRAPH, "aten.convolution.default", _readers(), (0, 1, 2, 3)),
    (FEATURE_MAP, None, "aten.convolution.default", _readers(), (0, 1, 2, 3)),
    # already channels-last in the trace, or not dense: as the trace says
    (FEATURE_MAP.contiguous(memory_format=torch.channels_last), CONV_GRAPH, "aten.relu.default", _readers(), (0, 2, 3, 1)),
    (FEATURE_MAP[:, :, :, ::2], CONV_GRAPH, "aten.relu.default", _readers(), None),
    # a concatenation's channels come from different maps, at different scales: grouped inside a channel
    (FEATURE_MAP, CONV_GRAPH, "aten.cat.default", _readers(Node("aten.convolution_backward.default")), (0, 1, 2, 3)),
])
def test_a_save_is_flattened_in_the_order_the_compiled_graph_will_lay_it_out(save, graph, producer, readers, order):
    from daf.runtime.graph_rules import memory_order
    assert memory_order(save, graph, producer, readers) == order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_positive_element_restored_at_the_floor_multiplies_a_gradient_without_a_denormal(dtype):
    """A ReLU output's positive element whose code rounded to 0 is restored at ``positive_floor``: still > 0
    for backward's mask, and no denormal when a conv's weight gradient multiplies it (oneDNN's channels-last
    kernels computed those in microcode: ResNet-18's compiled step ran 4.6x plain's with ``finfo.tiny``)."""
    from daf.runtime.in_graph import positive_floor
    floor = torch.tensor(positive_floor(dtype), dtype=dtype)
    assert floor > 0 and torch.isfinite(floor)
    if dtype != torch.float16:  # float16's products are computed in float32: no denormal from its floor
        gradients = torch.tensor([2.0 ** -60, 1e-6, 1.0, 1e6], dtype=torch.float32)
        assert bool((floor.float() * gradients >= torch.finfo(torch.float32).tiny).all())


class ForwardNode(Node):
    def __init__(self, target: object, *users: Node) -> None:
        super().__init__(target)
        self.users = {user: None for user in users}


@pytest.mark.parametrize("producer, node, bits", [
    ("aten.convolution.default", ForwardNode("aten.convolution.default", ForwardNode("aten.relu.default")), 2),
    # a ConvNeXt's map turned channels-last for its LayerNorm (past a view): a transformer's use, Auto.bits
    ("aten.convolution.default", ForwardNode("aten.convolution.default", ForwardNode(
        "aten.view.default", ForwardNode("aten.permute.default"))), 4),
    ("aten.add.Tensor", ForwardNode("aten.add.Tensor"), 4),  # a residual stream: made by an add, not a CNN's op
    ("aten.cat.default", ForwardNode("aten.cat.default"), 2),
])
def test_only_what_a_cnns_ops_make_and_keep_channels_first_is_a_feature_map(producer, node, bits):
    from daf.runtime.graph_rules import permuted_in_forward
    config = Config(min_numel=64)
    got = decide(FEATURE_MAP, producer, _readers(Node("aten.convolution_backward.default")), GraphWidths.of(config),
                 config, permuted=permuted_in_forward(node))
    assert (got.form, got.bits) == ("codes", bits)

"""``daf.Auto``, the default policy: each save's width from what reads it in backward (a rule table), and
what ``daf.wrap(model)`` with no other argument does to the widths and the gradient."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daf
from daf.policy.auto import AutoPolicy
from daf.policy import auto

AUTO = daf.Auto()


def _widths(model: nn.Module, x: torch.Tensor, **config) -> dict[str, int | None]:
    daf.wrap(model, **{"audit": daf.Audit(every=0), **config})  # the policy's widths, not the audit's raises
    model(x).float().square().mean().backward()
    rows = {row.site: row.bits for row in daf.report(model).rows if row.kind == "compressed"}
    daf.unwrap(model)
    return rows


class Net(nn.Module):
    """A convolution block, then a transformer-ish tail: a linear whose output goes through tanh and softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.proj = nn.Linear(16 * 8 * 8, 256)
        self.head = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x)))
        y = torch.tanh(self.proj(h.flatten(1)))
        return F.softmax(self.head(y), dim=-1) @ torch.ones(64, 8)


def test_each_save_gets_the_width_of_its_rule():
    torch.manual_seed(0)
    widths = _widths(Net(), torch.randn(64, 3, 8, 8))
    assert widths == {"bn#0": AUTO.feature_map_bits,  # batch norm's input, a feature map
                      "proj#0": AUTO.bits,  # a linear's input, 2-D (ReLU's output, flattened)
                      "<root>#1": AUTO.sensitive_bits,  # tanh's output (the head's linear shares it)
                      "<root>#2": AUTO.sensitive_bits}  # softmax's probabilities


@pytest.mark.parametrize("node, op, dim, field", [
    ("TanhBackward0", "linear", 2, "sensitive_bits"),
    ("SigmoidBackward0", "mul", 3, "sensitive_bits"),
    ("SoftmaxBackward0", "matmul", 4, "sensitive_bits"),
    ("ConvolutionBackward0", "batch_norm", 4, "feature_map_bits"),
    ("ReluBackward0", "conv2d", 4, "feature_map_bits"),
    ("ReluBackward0", "linear", 2, "bits"),
    ("AddBackward0", "layer_norm", 3, "bits"),
    ("NativeLayerNormBackward0", "linear", 3, "bits"),
    ("ReluBackward0", "relu", 2, "bits"),  # a 2-D save is no feature map
    # A ConvNeXt's: a convolution reads a LayerNorm's output (through a permute) or the residual stream
    ("PermuteBackward0", "conv2d", 4, "bits"),
    ("AddBackward0", "conv2d", 4, "bits"),
    ("NativeLayerNormBackward0", "conv2d", 4, "bits"),
    ("MaxPool2DWithIndicesBackward0", "conv2d", 4, "feature_map_bits"),
    ("CatBackward0", "conv2d", 4, "feature_map_bits"),  # a U-Net's skip connection
    ("ConvolutionBackward0", "group_norm", 4, "bits"),  # its output and the activation's are remade from it
])
def test_rule_table(node, op, dim, field):
    x = _tensor_made_by(node, dim)
    call = _Call(op)
    assert AutoPolicy.rule(x, call) == field


def test_a_convnext_style_feature_map_after_a_layer_norm_says_why_it_got_bits():
    x = _tensor_made_by("PermuteBackward0", 4)
    assert AutoPolicy(AUTO).reason(x, _Call("conv2d")) == "auto: feature map made by a norm or an add, not a ReLU CNN's"
    assert AutoPolicy(AUTO).reason(_tensor_made_by("ReluBackward0", 4), _Call("conv2d")) == "auto: feature map"


def test_config_widths_are_checked():
    with pytest.raises(ValueError, match="Auto.feature_map_bits must be one of"):
        daf.Auto(feature_map_bits=3)
    assert AutoPolicy(daf.Auto(bits=8)).summary()["bits"] == 8


def test_the_default_config_is_auto_and_a_width_asks_for_uniform_bits():
    assert isinstance(daf.Config().policy, daf.Auto) and daf.Config().bits is None
    assert isinstance(daf.Config(bits=2).policy, daf.Uniform) and daf.Config(bits=2).bits == 2
    assert isinstance(daf.Config().replace(bits=4).policy, daf.Uniform)
    assert daf.Config(policy=daf.Uniform()).bits == 2
    with pytest.raises(ValueError, match="leave bits out"):
        daf.Config(bits=4, policy=daf.Adaptive())
    assert daf.Config.from_dict(daf.Config().to_dict()) == daf.Config()
    assert daf.Config.from_dict(daf.Config(bits=4).to_dict()) == daf.Config(bits=4)


def test_large_channels_get_the_outlier_split_and_plain_saves_do_not():
    linear = nn.Linear(256, 256)
    plain = torch.randn(64, 256)
    large = plain.clone()
    large[:, :2] *= 60
    sizes = {}
    for name, x in (("plain", plain), ("large", large)):  # a linear's input: the default's codec splits it
        with daf.compress(linear, min_numel=1) as session:
            loss = linear(x.requires_grad_() * 1.0).sum()
        loss.backward()
        sizes[name] = [row.stored_bytes for row in daf.report(session).rows if row.kind == "compressed"][0]
    # the split keeps the two large channels exact: 64 x 2 float32 and their index beside the codes
    assert sizes["large"] > sizes["plain"] + 64 * 2 * 4


def test_wrap_alone_keeps_a_transformer_layer_gradient_with_large_norm_channels():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    with torch.no_grad():
        for module in layer.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight[:2] *= 60
    x = torch.randn(8, 64, 256)
    reference = copy.deepcopy(layer)
    reference(x).square().mean().backward()
    daf.wrap(layer)
    layer(x).square().mean().backward()
    g = torch.cat([p.grad.flatten() for p in layer.parameters()])
    g_ref = torch.cat([p.grad.flatten() for p in reference.parameters()])
    assert F.cosine_similarity(g, g_ref, dim=0) > 0.99


def _tensor_made_by(node: str, dim: int) -> torch.Tensor:
    shape = (2,) * dim
    x = torch.randn(shape, requires_grad=True)
    made = {"TanhBackward0": torch.tanh, "SigmoidBackward0": torch.sigmoid,
            "SoftmaxBackward0": lambda t: torch.softmax(t, -1), "ReluBackward0": torch.relu,
            "AddBackward0": lambda t: t + 1, "ConvolutionBackward0": None, "NativeLayerNormBackward0": None,
            "PermuteBackward0": lambda t: t.permute(0, 3, 1, 2), "CatBackward0": lambda t: torch.cat([t, t], 1),
            "MaxPool2DWithIndicesBackward0": lambda t: F.max_pool2d(t, 1)}[node]
    if made is None:
        made = (lambda t: F.layer_norm(t, t.shape[-1:])) if node == "NativeLayerNormBackward0" else _convolved
    out = made(x)
    assert type(out.grad_fn).__name__ == node
    return out


def _convolved(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 4:
        return F.conv2d(t, torch.randn(2, 2, 1, 1))
    return F.conv1d(t.unsqueeze(0), torch.randn(2, 2, 1)).squeeze(0)


class _Call:
    """What ``AutoPolicy.rule`` reads of a ``daf.tracing.OpCall``: its name and the fused-attention role."""

    attention_value = None
    tensor_arguments: list = []

    def __init__(self, name: str) -> None:
        self.name = name

    def fused_attention_role(self, tensor: torch.Tensor) -> None:
        return None


class _NormCall(_Call):
    """A batch norm call with its weight, as ``F.batch_norm`` is called (weight the fourth argument)."""

    def __init__(self, weight: torch.Tensor, keyword: bool = False) -> None:
        super().__init__("batch_norm")
        self.args = (None, None, None) if keyword else (None, None, None, weight)
        self.kwargs = {"weight": weight} if keyword else {}


@pytest.mark.parametrize("keyword", [False, True])
def test_a_batch_norm_input_gets_bits_when_the_norms_weight_has_large_channels(keyword):
    x = _tensor_made_by("ConvolutionBackward0", 4)
    plain, large = torch.ones(32), torch.ones(32)
    large[:2] = 60.0  # as trained networks and benchmarks/default_safety.py's large channels have them
    assert AutoPolicy.rule(x, _NormCall(plain, keyword)) == "feature_map_bits"
    assert AutoPolicy.rule(x, _NormCall(large, keyword)) == "bits"
    reason = AutoPolicy(AUTO).reason(x, _NormCall(large, keyword))
    assert reason == "auto: batch norm input, its weight has large channels"
    nearly = torch.ones(32)
    nearly[:2] = 7.9  # under daf.policy.auto.LARGE_WEIGHT
    assert AutoPolicy.rule(x, _NormCall(nearly, keyword)) == "feature_map_bits"


def test_wrap_alone_widens_the_inputs_of_norms_with_large_weights_and_the_gradient_recovers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    with torch.no_grad():
        for norm in (model[1], model[4], model[7]):
            norm.weight[:2] *= 60
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))

    def gradient(m):
        m.zero_grad(set_to_none=True)
        F.cross_entropy(m(x), y).backward()
        return torch.cat([p.grad.flatten() for p in m.parameters()])

    expected = gradient(model)
    wrapped = daf.wrap(copy.deepcopy(model), audit=daf.Audit(every=0))
    got = gradient(wrapped)
    rows = {row.site: row for row in daf.report(wrapped).rows}
    assert [rows[f"{i}#0"].bits for i in (1, 4, 7)] == [AUTO.bits] * 3  # the norms' inputs
    assert F.cosine_similarity(got, expected, 0) > 0.997  # 0.993 with the inputs at 2 bits


@pytest.mark.parametrize("made_by, call", [("ConvolutionBackward0", "conv2d"), ("AddBackward0", "conv2d"),
                                           ("TanhBackward0", "linear"), ("NativeLayerNormBackward0", "linear")])
@pytest.mark.parametrize("large", [False, True])
def test_choice_is_the_width_and_the_reason_from_one_look_at_the_call(monkeypatch, made_by, call, large):
    policy, x = AutoPolicy(AUTO), _tensor_made_by(made_by, 4)
    weight = torch.ones(32)
    weight[:2] = 60.0 if large else 1.0
    calls = [_NormCall(weight), _Call(call)]
    expected = [(policy.bits_for_call("s", x, c), policy.reason(x, c)) for c in calls]
    looks = []
    real = auto._norm_with_large_weight
    monkeypatch.setattr(auto, "_norm_with_large_weight", lambda *a: looks.append(1) or real(*a))
    assert [policy.choice("s", x, c) for c in calls] == expected
    assert len(looks) == len(calls)  # one batch norm weight check per save (it syncs a CUDA device)


class _ConvCall(_Call):
    """A convolution call on ``x``, as the op tracker records it."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__("conv2d")
        self.tensor_arguments = [x, torch.randn(8, 8, 3, 3)]


@pytest.mark.parametrize("nonzero, field", [(0.30, "bits"), (0.515, "bits"), (0.52, "feature_map_bits"),
                                            (0.9, "feature_map_bits")])
def test_a_relu_outputs_nonzeros_get_4_bits_where_that_costs_no_more_than_2_bit_codes_of_the_map(nonzero, field):
    relu_out = torch.zeros(2, 8, 10, 10)
    nonzeros = torch.rand(int(nonzero * relu_out.numel())) + 0.1  # what the session passes: the map's nonzeros
    assert AutoPolicy.rule(nonzeros, _ConvCall(relu_out)) == field
    assert "nonzeros of a ReLU output" in AutoPolicy(AUTO).reason(nonzeros, _ConvCall(relu_out))
    assert AutoPolicy.rule(nonzeros, _Call("linear")) == "bits"  # a 1-D save of another op: no such rule
    assert AutoPolicy.codes_nonzeros_only


def test_wrap_alone_codes_a_relu_cnns_nonzeros_finer_in_fewer_bytes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    x, y = torch.randn(32, 3, 16, 16), torch.randint(0, 10, (32,))

    def run(nonzeros: bool) -> tuple[torch.Tensor, daf.Report]:
        wrapped = daf.wrap(copy.deepcopy(model), audit=daf.Audit(every=0))
        daf.session_of(wrapped).policy.codes_nonzeros_only = nonzeros  # off: the dense 2-bit codes of before
        F.cross_entropy(wrapped(x), y).backward()
        return torch.cat([p.grad.flatten() for p in wrapped.parameters()]), daf.report(wrapped)

    exact = model
    F.cross_entropy(exact(x), y).backward()
    reference = torch.cat([p.grad.flatten() for p in exact.parameters()])
    errors, stored = {}, {}
    for nonzeros in (False, True):
        errors[nonzeros], stored[nonzeros] = [], []
        for seed in range(3):  # stochastic rounding: a few draws
            torch.manual_seed(seed)
            gradient, report = run(nonzeros)
            errors[nonzeros].append(float((gradient - reference).norm() / reference.norm()))
            stored[nonzeros].append(report.stored_bytes)
    rows = [row for row in report.rows if "nonzeros of a ReLU output" in row.why]
    assert len(rows) == 2 and all(row.bits in (2, 4) for row in rows)
    assert max(stored[True]) <= min(stored[False])
    assert sum(errors[True]) < 0.8 * sum(errors[False]), errors


class _Attention(nn.Module):
    """Attention written out (``eager``) or through the math path of ``scaled_dot_product_attention`` (taken on a
    CPU when the mask needs a gradient); dropout on the probabilities when ``dropout``."""

    def __init__(self, path: str, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv, self.path, self.dropout = nn.Linear(64, 3 * 64), path, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
        if self.path == "eager":
            p = F.dropout(torch.softmax(q @ k.transpose(-1, -2), -1), self.dropout)
            out = torch.matmul(p, v)
        else:
            bias = torch.zeros(x.shape[1], x.shape[1], requires_grad=True)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=self.dropout)
        return out.transpose(1, 2).flatten(2)


@pytest.mark.parametrize("path, dropout", [("eager", 0.0), ("eager", 0.1), ("math", 0.0)])
def test_attention_values_outside_the_fused_kernels_get_sensitive_bits(path, dropout):
    """Eager attention's v (the other operand of softmax's probabilities) and the math path's copy of v get
    ``sensitive_bits``, as the fused kernels' v does; q and k keep ``bits``."""
    torch.manual_seed(0)
    model = _Attention(path, dropout)
    daf.wrap(model, audit=daf.Audit(every=0), min_numel=1)
    model(torch.randn(4, 32, 64)).square().mean().backward()
    rows = [row for row in daf.report(model).rows if row.kind == "compressed" and row.shape[-1] != 64 * 3]
    values = [row for row in rows if row.why == auto._EAGER_VALUES_REASON]
    assert len(values) == 1 and values[0].bits == AUTO.sensitive_bits, [(r.site, r.source, r.bits, r.why) for r in rows]
    operands = [row for row in rows if row.source == "UnsafeViewBackward0" and row not in values]
    assert len(operands) == 2 and all(row.bits == AUTO.bits for row in operands)  # q and k^T


def test_values_of_probabilities_reads_the_call_and_the_saves_history():
    x = torch.randn(2, 4, 8, requires_grad=True)
    p, v = torch.softmax(x @ x.transpose(-1, -2), -1), x * 2
    matmul = _Call("matmul")
    matmul.tensor_arguments = [p, v]
    assert auto.values_of_probabilities(v, matmul)
    assert not auto.values_of_probabilities(p.reshape(8, 4), matmul)  # the probabilities themselves
    other = _Call("matmul")
    other.tensor_arguments = [x * 3, v]
    assert not auto.values_of_probabilities(v, other)  # no probabilities in the product
    assert not auto.values_of_probabilities(v, _Call("linear"))
    assert not auto.values_of_probabilities(v, None)

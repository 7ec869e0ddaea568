"""compact: smaller layers, the same function as the masked model, the input model untouched, refusals."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import prune as torch_prune

from lightprune import prune
from lightprune.experiment.models import SmallCNN
from lightprune.export import CompactError, compact

pytestmark = pytest.mark.usefixtures("one_thread_for_module")


def _randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Nonzero biases and BatchNorm statistics, so removed channels carry constants that must be folded."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g))
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.randn(m.num_features, generator=g))
                m.bias.copy_(torch.randn(m.num_features, generator=g) + 0.5)
            elif isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)) and m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) + 0.5)
    return model


def assert_same_function(small: nn.Module, masked: nn.Module, inputs: tuple, rtol: float = 1e-5) -> None:
    masked.eval()
    with torch.no_grad():
        want, got = masked(*inputs), small(*inputs)
    assert want.shape == got.shape
    scale = want.abs().max()
    assert (want - got).abs().max() <= rtol * scale, float((want - got).abs().max() / scale)


def weights(model: nn.Module) -> dict[str, tuple[int, ...]]:
    named = ((name.removesuffix("_orig"), p) for name, p in model.named_parameters())
    return {name: tuple(p.shape) for name, p in named if name.endswith("weight")}


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_untouched(model: nn.Module, before: dict[str, torch.Tensor], training: bool) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert model.training == training


# ------------------------------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 24)
        self.fc3 = nn.Linear(24, 5)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(nn.functional.gelu(self.fc1(x)))))


@pytest.mark.parametrize("engine", [prune, torch_prune])
def test_mlp_output_channels_removed_and_bias_constants_folded(engine):
    torch.manual_seed(0)
    model = _randomize(MLP())
    engine.ln_structured(model.fc1, "weight", amount=0.5, n=2, dim=0)  # biases stay: gelu(b) is folded
    engine.ln_structured(model.fc2, "weight", amount=0.25, n=1, dim=0)
    before, training = snapshot(model), model.training
    small = compact(model, torch.randn(8, 20))
    assert weights(small) == {"fc1.weight": (16, 20), "fc2.weight": (18, 16), "fc3.weight": (5, 18)}
    assert_untouched(model, before, training)
    for seed in range(3):
        torch.manual_seed(seed)
        assert_same_function(small, model, (torch.randn(64, 20) * 3,))


def test_input_channels_pruned_along_dim_1_shrink_the_layer_and_its_producer():
    torch.manual_seed(1)
    model = _randomize(MLP())
    prune.ln_structured(model.fc2, "weight", amount=0.5, n=2, dim=1)  # fc2 ignores half of fc1's outputs
    prune.ln_structured(model.fc1, "weight", amount=0.25, n=2, dim=1)  # fc1 ignores a quarter of the input
    small = compact(model, torch.randn(4, 20))
    assert weights(small) == {"fc1.weight": (16, 15), "fc2.weight": (24, 16), "fc3.weight": (5, 24)}
    assert_same_function(small, model, (torch.randn(64, 20),))


def test_all_channels_pruned_keeps_one():
    torch.manual_seed(2)
    model = _randomize(MLP())
    prune.ln_structured(model.fc2, "weight", amount=1.0, n=2, dim=0)
    small = compact(model, torch.randn(4, 20))
    assert weights(small)["fc2.weight"][0] == 1
    assert_same_function(small, model, (torch.randn(16, 20),))


def test_unpruned_model_is_unchanged_in_size():
    model = _randomize(MLP())
    small = compact(model, torch.randn(4, 20))
    assert weights(small) == weights(model)
    assert_same_function(small, model, (torch.randn(16, 20),))


# ------------------------------------------------------------------------------------------------------------------


class ConvBN(nn.Module):
    def __init__(self, padding_mode: str = "zeros"):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, padding_mode=padding_mode)
        self.bn1 = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(16, 12, 3, padding=1, padding_mode=padding_mode)
        self.bn2 = nn.BatchNorm2d(12)
        self.conv3 = nn.Conv2d(12, 8, 1)
        self.fc = nn.Linear(8 * 2 * 2, 4)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = nn.functional.relu6(self.bn2(self.conv2(x)))
        x = nn.functional.avg_pool2d(self.conv3(x), 2)
        return self.fc(torch.flatten(x, 1))


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "circular"])
def test_cnn_with_batchnorm_constants_exact_at_the_borders(padding_mode):
    torch.manual_seed(3)
    model = _randomize(ConvBN(padding_mode))
    prune.ln_structured(model.conv1, "weight", amount=0.5, n=2, dim=0)
    prune.ln_structured(model.conv2, "weight", amount=0.5, n=2, dim=0)
    prune.ln_structured(model.conv3, "weight", amount=0.5, n=1, dim=0)
    model.train()
    x = torch.randn(2, 3, 8, 8)
    before = snapshot(model)
    small = compact(model, x)
    assert_untouched(model, before, training=True)
    assert weights(small) == {
        "conv1.weight": (8, 3, 3, 3),
        "bn1.weight": (8,),
        "conv2.weight": (6, 8, 3, 3),
        "bn2.weight": (6,),
        "conv3.weight": (4, 6, 1, 1),
        "fc.weight": (4, 16),
    }
    assert not small.training
    for seed in range(3):
        torch.manual_seed(seed)
        assert_same_function(small, model, (torch.randn(8, 3, 8, 8),))
    # the border correction follows the input size (zero padding)
    assert_same_function(small, model, (torch.randn(2, 3, 8, 8),))


def test_a_compact_model_with_border_corrections_pickles_and_traces_again(tmp_path):
    """Unpickling a GraphModule traces its code again: the correction map must be traceable."""
    torch.manual_seed(3)
    model = _randomize(ConvBN("zeros"))
    prune.ln_structured(model.conv1, "weight", amount=0.5, n=2, dim=0)
    small = compact(model, torch.randn(2, 3, 8, 8))
    assert any(getattr(n.target, "__name__", "") == "constant_input_correction" for n in small.graph.nodes)
    torch.save(small, tmp_path / "small.pt")
    loaded = torch.load(tmp_path / "small.pt", weights_only=False)
    again = compact(small, torch.randn(2, 3, 8, 8))
    traced = torch.fx.symbolic_trace(small)
    for shape in [(4, 3, 8, 8), (1, 3, 8, 8)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            want = small(x)
            assert torch.equal(loaded(x), want) and torch.equal(traced(x), want)
        assert_same_function(again, model, (x,))


@pytest.mark.parametrize("dims", [1, 3])
def test_conv1d_and_conv3d(dims):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            conv = nn.Conv1d if dims == 1 else nn.Conv3d
            self.a = conv(2, 8, 3, padding=1)
            self.b = conv(8, 4, 3, padding=1)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(4)
    model = _randomize(Net())
    prune.ln_structured(model.a, "weight", amount=0.5, n=2, dim=0)
    x = torch.randn(2, 2, *([6] * dims))
    small = compact(model, x)
    assert weights(small)["a.weight"][0] == 4 and weights(small)["b.weight"][1] == 4
    assert_same_function(small, model, (torch.randn(3, 2, *([6] * dims)),))


def test_small_cnn_from_the_app():
    torch.manual_seed(5)
    model = SmallCNN(in_channels=1, image_size=8, channels=(16, 32), num_classes=10)
    for conv in (model.conv1, model.conv2):
        prune.ln_structured(conv, "weight", amount=0.5, n=2, dim=0)
        kept = conv.weight_mask.flatten(1).any(1).float()
        prune.custom_from_mask(conv, "bias", kept)  # the app zeroes the pruned channels' biases too
    small = compact(model, torch.randn(64, 1, 8, 8))
    assert weights(small) == {"conv1.weight": (8, 1, 3, 3), "conv2.weight": (16, 8, 3, 3), "fc.weight": (10, 64)}
    assert_same_function(small, model, (torch.randn(64, 1, 8, 8),))


# ------------------------------------------------------------------------------------------------------------------


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.conv1 = nn.Conv2d(16, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        x = torch.relu(x + y)
        return self.head(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


def test_residual_add_merges_channel_sets():
    torch.manual_seed(6)
    model = _randomize(Residual())
    mask_stem = torch.ones_like(model.stem.weight)
    mask_stem[:8] = 0  # stem channels 0-7 pruned
    mask_conv2 = torch.ones_like(model.conv2.weight)
    mask_conv2[4:12] = 0  # block channels 4-11 pruned: only 4-7 are pruned on both sides of the add
    prune.custom_from_mask(model.stem, "weight", mask_stem)
    prune.custom_from_mask(model.conv2, "weight", mask_conv2)
    prune.ln_structured(model.conv1, "weight", amount=0.25, n=2, dim=0)
    x = torch.randn(2, 3, 6, 6)
    small = compact(model, x)
    assert weights(small) == {
        "stem.weight": (12, 3, 3, 3),
        "conv1.weight": (12, 12, 3, 3),
        "bn1.weight": (12,),
        "conv2.weight": (12, 12, 3, 3),
        "bn2.weight": (12,),
        "head.weight": (3, 12),
    }
    for seed in range(3):
        torch.manual_seed(seed)
        assert_same_function(small, model, (torch.randn(4, 3, 6, 6),))


class Concat(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Conv2d(3, 8, 1)
        self.right = nn.Conv2d(3, 6, 3, padding=1)
        self.fuse = nn.Conv2d(14, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 2)

    def forward(self, x):
        y = torch.cat([torch.sigmoid(self.left(x)), nn.functional.elu(self.right(x))], dim=1)
        return self.fc(self.fuse(y).view(x.size(0), -1))


def test_concatenation():
    torch.manual_seed(7)
    model = _randomize(Concat())
    prune.ln_structured(model.left, "weight", amount=0.5, n=2, dim=0)
    prune.ln_structured(model.right, "weight", amount=2, n=2, dim=0)
    small = compact(model, torch.randn(2, 3, 4, 4))
    assert weights(small)["left.weight"][0] == 4
    assert weights(small)["right.weight"][0] == 4
    assert weights(small)["fuse.weight"][1] == 8
    assert_same_function(small, model, (torch.randn(5, 3, 4, 4),))


def test_concatenation_with_the_model_input_dense_net_style():
    """``cat([x, relu(c1(x))])``, then ``cat`` of that with ``c2``'s output: the input's channels are kept, the
    pruned ones of c1 and c2 removed (before, an operand no layer made stopped compact at every later cat)."""

    class Dense(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(9, 6, 3, padding=1)
            self.head = nn.Conv2d(15, 4, 1)

        def forward(self, x):
            x = torch.cat([x, torch.relu(self.c1(x))], 1)
            x = torch.cat([x, torch.relu(self.c2(x))], dim=1)
            return self.head(x)

    torch.manual_seed(8)
    model = _randomize(Dense())
    prune.ln_structured(model.c1, "weight", amount=0.5, n=2, dim=0)
    prune.ln_structured(model.c2, "weight", amount=0.5, n=2, dim=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        small = compact(model, torch.randn(2, 3, 6, 6))
    assert weights(small) == {"c1.weight": (3, 3, 3, 3), "c2.weight": (3, 6, 3, 3), "head.weight": (4, 9, 1, 1)}
    assert_same_function(small, model, (torch.randn(5, 3, 6, 6),))


def test_channels_reaching_an_unsupported_operation_are_kept():
    class Softmaxed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 8)
            self.b = nn.Linear(8, 4)

        def forward(self, x):
            return self.b(torch.softmax(self.a(x), dim=-1))  # mixes channels: nothing may go

    torch.manual_seed(8)
    model = _randomize(Softmaxed())
    prune.ln_structured(model.a, "weight", amount=0.5, n=2, dim=0)
    with pytest.warns(UserWarning, match=r"kept 4 pruned output channels of 'a': they reach node 'softmax'"):
        small = compact(model, torch.randn(3, 6))
    assert weights(small) == weights(model)
    assert_same_function(small, model, (torch.randn(9, 6),))


def test_unstructured_zeros_and_the_output_layer_are_left_alone():
    torch.manual_seed(9)
    model = _randomize(MLP())
    prune.l1_unstructured(model.fc1, "weight", amount=0.5)
    prune.ln_structured(model.fc3, "weight", amount=0.4, n=2, dim=0)  # model outputs: never removed
    small = compact(model, torch.randn(3, 20))
    assert weights(small) == weights(model)
    assert_same_function(small, model, (torch.randn(9, 20),))


def test_untraceable_model_is_refused_naming_the_node():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.inner = nn.Sequential(nn.Linear(4, 4))

        def forward(self, x):
            y = self.fc(x)
            if y.sum() > 0:  # data-dependent control flow
                return self.inner(y)
            return y

    model = Branchy()
    with pytest.raises(CompactError, match=r"cannot trace Branchy.*after node 'gt'.*control flow"):
        compact(model, torch.randn(2, 4))

    class Inner(nn.Module):
        def forward(self, x):
            return x * 2 if x.max() > 1 else x

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(Inner()))
    with pytest.raises(CompactError, match=r"inside module '1.0'"):
        compact(model, torch.randn(2, 4))


@pytest.mark.parametrize(
    ("rtol", "error", "pattern"),
    [
        (float("nan"), ValueError, r"^rtol=nan must be a finite number >= 0"),  # would pass any output
        (float("inf"), ValueError, r"^rtol=inf must be a finite number >= 0"),
        (-1, ValueError, r"^rtol=-1 must be a finite number >= 0"),
        ("x", TypeError, r"^rtol='x' must be a real number, not a str$"),
        (True, TypeError, r"^rtol=True must be a real number, not a bool$"),
    ],
)
def test_a_tolerance_the_check_cannot_use_is_refused_before_tracing(monkeypatch, rtol, error, pattern):
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    prune.ln_structured(model[0], "weight", amount=0.5, n=2, dim=0)
    small = compact(model, torch.randn(4, 8), rtol=0)  # zero is a tolerance: the floor of a few epsilons applies
    assert small.get_submodule("0").out_features == 3

    def no_tracing(*args):
        raise AssertionError("traced before checking rtol")

    # the package's ``compact`` attribute is the function: reach the module through sys.modules
    monkeypatch.setattr(sys.modules["lightprune.export.compact"], "_trace_in_eval_mode", no_tracing)
    with pytest.raises(error, match=pattern):
        compact(model, torch.randn(4, 8), rtol=rtol)


def test_in_place_update_read_elsewhere_keeps_the_channels():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 8)
            self.b = nn.Linear(8, 3)

        def forward(self, x):
            y = self.a(x)
            z = y * 2
            y.relu_()
            return self.b(y) + self.b(z)

    torch.manual_seed(10)
    model = _randomize(InPlace())
    with torch.no_grad():
        model.a.bias[:4] = -1.0
    prune.ln_structured(model.a, "weight", amount=0.5, n=2, dim=0)
    with pytest.warns(UserWarning, match=r"kept 4 pruned output channels of 'a': they reach node 'relu_'"):
        small = compact(model, torch.randn(3, 6))
    assert weights(small) == weights(model)
    assert_same_function(small, model, (torch.randn(9, 6),))


def test_compact_model_is_independent_and_deep_copies():
    model = _randomize(MLP())
    prune.ln_structured(model.fc1, "weight", amount=0.5, n=2, dim=0)
    small = compact(model, torch.randn(2, 20))
    with torch.no_grad():
        for p in small.parameters():
            p.add_(1.0)
    assert_same_function(compact(model, torch.randn(2, 20)), model, (torch.randn(4, 20),))
    copy.deepcopy(small)


@pytest.mark.parametrize("seed", [11, 12, 13])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes(dtype, seed):
    """float64: the same function to 1e-12. bfloat16 (8 significant bits) cannot match bit for bit: the compacted
    model sums fewer terms, so it rounds differently. The exact reference is the masked model's own bfloat16 weights
    evaluated in float64. Both bfloat16 models stay within 2**-7 of its scale (over 40 seeds: at most 0.0050), and the
    compacted one is off by at most one bfloat16 rounding (2**-8) more than the masked one."""
    torch.manual_seed(seed)
    model = _randomize(ConvBN()).to(dtype)
    prune.ln_structured(model.conv1, "weight", amount=0.5, n=2, dim=0)
    prune.ln_structured(model.conv2, "weight", amount=0.5, n=2, dim=0)
    small = compact(model, torch.randn(2, 3, 8, 8, dtype=dtype))
    assert weights(small)["conv2.weight"] == (6, 8, 3, 3)
    assert small.get_submodule("conv2").weight.dtype == dtype
    x = torch.randn(4, 3, 8, 8, dtype=dtype)
    if dtype == torch.float64:
        assert_same_function(small, model, (x,), rtol=1e-12)
        return
    model.eval()
    with torch.no_grad():
        exact = copy.deepcopy(model).to(torch.float64)(x.to(torch.float64))
        scale = float(exact.abs().max())
        masked_error = float((model(x).to(torch.float64) - exact).abs().max()) / scale
        compact_error = float((small.eval()(x).to(torch.float64) - exact).abs().max()) / scale
    assert masked_error <= 2**-7 and compact_error <= 2**-7, (masked_error, compact_error)
    assert compact_error <= masked_error + 2**-8, (masked_error, compact_error)


# ------------------------------------------------------------------------------------------------------------------
# random architectures and masks
# ------------------------------------------------------------------------------------------------------------------


class RandomNet(nn.Module):
    """conv stem -> blocks (conv [-> BN] -> activation, optionally residual or concatenated) -> pool -> two Linears."""

    def __init__(self, plan: dict):
        super().__init__()
        self.plan = plan
        width = plan["widths"][0]
        self.stem = nn.Conv2d(2, width, 3, padding=plan["paddings"][0], padding_mode=plan["padding_mode"])
        self.convs, self.norms, self.extras = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        for i, out in enumerate(plan["widths"][1:]):
            kind = plan["kinds"][i]
            if kind == "residual":
                out = width
            self.convs.append(nn.Conv2d(width, out, 3, padding=1, bias=plan["biases"][i]))
            self.norms.append(nn.BatchNorm2d(out) if plan["norms"][i] else nn.Identity())
            if kind == "concat":
                self.extras.append(nn.Conv2d(width, 3, 1))
                out += 3
            else:
                self.extras.append(nn.Identity())
            width = out
        self.fc1 = nn.Linear(width * 4, 12)
        self.fc2 = nn.Linear(12, 3)

    def forward(self, x):
        x = torch.tanh(self.stem(x)) if self.plan["tanh"] else torch.relu(self.stem(x))
        for conv, norm, extra, kind in zip(self.convs, self.norms, self.extras, self.plan["kinds"], strict=False):
            y = nn.functional.silu(norm(conv(x)))
            if kind == "residual":
                x = x + y
            elif kind == "concat":
                x = torch.cat([y, extra(x)], dim=1)
            else:
                x = y
        x = nn.functional.adaptive_max_pool2d(x, 2)
        return self.fc2(nn.functional.gelu(self.fc1(x.flatten(1))))


@settings(max_examples=25, deadline=None)
@given(
    blocks=st.integers(1, 3),
    data=st.data(),
)
def test_random_architectures_compact_exactly(blocks, data):
    plan = {
        "widths": [data.draw(st.integers(2, 8)) for _ in range(blocks + 1)],
        "kinds": [data.draw(st.sampled_from(["plain", "residual", "concat"])) for _ in range(blocks)],
        "biases": [data.draw(st.booleans()) for _ in range(blocks)],
        "norms": [data.draw(st.booleans()) for _ in range(blocks)],
        "paddings": [data.draw(st.integers(0, 1))],
        "padding_mode": data.draw(st.sampled_from(["zeros", "replicate"])),
        "tanh": data.draw(st.booleans()),
    }
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    model = _randomize(RandomNet(plan))
    layers = [model.stem, *model.convs, model.fc1]
    for layer in layers:
        dim = data.draw(st.sampled_from([0, 0, 1]))
        channels = layer.weight.shape[dim]
        pruned = data.draw(st.lists(st.integers(0, channels - 1), max_size=channels, unique=True))
        mask = torch.ones_like(layer.weight)
        mask.index_fill_(dim, torch.tensor(pruned, dtype=torch.long), 0.0)
        prune.custom_from_mask(layer, "weight", mask)
    small = compact(model, torch.randn(2, 2, 6, 6))
    assert sum(p.numel() for p in small.parameters()) <= sum(p.numel() for p in model.parameters())
    assert_same_function(small, model, (torch.randn(5, 2, 6, 6) * 2,))


# ------------------------------------------------------------------------------------------------------------------
# the eval-mode function, inputs and modules compact refuses or handles
# ------------------------------------------------------------------------------------------------------------------


class TrainSwitch(nn.Module):
    """Probabilities only at inference time, dropout only in training: the two modes compute different functions."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        y = self.b(nn.functional.dropout(torch.relu(self.a(x)), 0.5, self.training))
        if not self.training:
            y = y.softmax(-1)
        return y


def test_a_model_in_train_mode_is_compacted_to_its_eval_mode_function():
    torch.manual_seed(14)
    model = _randomize(TrainSwitch())
    prune.ln_structured(model.a, "weight", amount=0.5, n=2, dim=0)
    model.train()
    model.b.eval()  # a mixed state: every module's own flag comes back
    before = snapshot(model)
    small = compact(model, torch.randn(3, 4))
    assert model.training and model.a.training and not model.b.training
    assert_untouched(model, before, training=True)
    assert weights(small)["a.weight"] == (3, 4)
    x = torch.randn(7, 4)
    assert torch.allclose(small(x).sum(-1), torch.ones(7))
    assert_same_function(small, model, (x,))


@pytest.mark.parametrize("padding", [0, 1])
def test_unbatched_conv_input(padding):
    """A (C, H, W) input: removed constant channels behind a padded conv and unused model-input channels."""
    torch.manual_seed(15)
    model = _randomize(nn.Sequential(nn.Conv2d(3, 6, 3, padding=padding), nn.ReLU(), nn.Conv2d(6, 2, 3, padding=1)))
    prune.ln_structured(model[0], "weight", amount=0.5, n=2, dim=0)  # constants reach the padded conv
    prune.ln_structured(model[0], "weight", amount=1, n=2, dim=1)  # one model-input channel unused
    small = compact(model, torch.randn(3, 7, 7))
    assert weights(small) == {"0.weight": (3, 2, 3, 3), "2.weight": (2, 3, 3, 3)}
    for shape in [(3, 7, 7), (3, 9, 8)]:
        assert_same_function(small, model, (torch.randn(*shape),))


@pytest.mark.parametrize(
    ("wrap", "keys"),
    [(nn.utils.spectral_norm, r"\['weight_orig', 'weight_u', 'weight_v'\]"), (nn.utils.weight_norm, r"\['weight_g'")],
)
def test_hook_based_weight_reparametrization_is_refused_naming_the_layer(wrap, keys):
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # weight_norm is deprecated in favour of parametrizations
        wrap(model[2])
    prune.ln_structured(model[0], "weight", amount=0.5, n=2, dim=0)
    with pytest.raises(CompactError, match=rf"module '2' \(Linear\) holds {keys}.*remove_spectral_norm"):
        compact(model, torch.randn(3, 4))


class FunctionalLinear(nn.Module):
    """A custom layer: torch.fx traces into it, and so into its pruning hook."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features))
        self.bias = nn.Parameter(torch.randn(out_features))

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_a_custom_layer_pruned_with_lightprune_compacts(mask_dtype):
    torch.manual_seed(16)
    model = nn.Sequential(FunctionalLinear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    with prune.mask_dtype(mask_dtype):
        prune.l1_unstructured(model[0], "weight", amount=0.5)
    model(torch.randn(1, 4))
    before = model[0].weight.clone()
    small = compact(model, torch.randn(3, 4))
    assert torch.equal(model[0].weight, before)  # the traced value does not stay on the model
    copy.deepcopy(model)
    assert_same_function(small, model, (torch.randn(5, 4),))


def test_in_place_update_of_a_view_read_elsewhere_keeps_the_channels():
    class InPlaceView(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 2), nn.Linear(6, 2)

        def forward(self, x):
            h = self.a(x)
            r = nn.functional.relu(h.view(h.size(0), -1), inplace=True)  # rectifies h too
            return self.b(r) + self.c(h)

    torch.manual_seed(17)
    model = InPlaceView()
    prune.ln_structured(model.a, "weight", amount=0.34, n=2, dim=0)
    with torch.no_grad():
        model.a.bias.fill_(-0.5)  # the pruned channels carry constants the in-place relu changes
    with pytest.warns(UserWarning, match=r"kept 2 pruned output channels of 'a': they reach node 'relu'"):
        small = compact(model, torch.randn(3, 4))
    assert weights(small) == weights(model)
    assert_same_function(small, model, (torch.randn(9, 4),))

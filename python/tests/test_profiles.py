"""Layer profiles (sumflow.profiles): the format, the built-ins and scaling.

The built-ins are checked against the real architectures built from torch.nn on the meta
device (no memory, no arithmetic): the same tensor names, shapes and order, and the same
FLOPs as torch's own FlopCounterMode counts. The sleeping model built from profiles and the
training-benchmark worker are tested with the benchmarks, in bench/tests."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from sumflow import profiles
from sumflow.profiles import LayerProfile, ModelProfile, ParamSpec, architectures

# ---- the real architectures, as torchvision and torch.nn define them ---------------------


class VGG16(nn.Module):
    """torchvision.models.vgg16() without torchvision."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        config = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", *[512, 512, 512, "M"] * 2]
        for v in config:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                assert isinstance(v, int)
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU()]
                cin = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(),
            nn.Dropout(),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Dropout(),
            nn.Linear(4096, 1000),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class Bottleneck(nn.Module):
    """torchvision's ResNet v1.5 bottleneck."""

    def __init__(self, cin: int, width: int, stride: int, downsample: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * 4)
        self.relu = nn.ReLU()
        self.downsample = (
            nn.Sequential(
                nn.Conv2d(cin, width * 4, 1, stride=stride, bias=False), nn.BatchNorm2d(width * 4)
            )
            if downsample
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = self.downsample(x) if self.downsample is not None else x
        return self.relu(out + identity)


class ResNet50(nn.Module):
    """torchvision.models.resnet50() without torchvision."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = 64
        for stage, (blocks, width) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512)), 1):
            stride = 1 if stage == 1 else 2
            seq = [Bottleneck(cin, width, stride, True)]
            seq += [Bottleneck(width * 4, width, 1, False) for _ in range(blocks - 1)]
            setattr(self, f"layer{stage}", nn.Sequential(*seq))
            cin = width * 4
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2048, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for stage in range(1, 5):
            x = getattr(self, f"layer{stage}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def forward_flops(module: Callable[..., Any], *inputs: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        module(*inputs)
    return int(counter.get_total_flops())


def shapes(profile: ModelProfile) -> list[tuple[str, tuple[int, ...]]]:
    return [(p.name, p.shape) for p in profile.params()]


# ---- built-ins against the real architectures --------------------------------------------


@pytest.mark.parametrize(
    ("name", "params", "tensors"),
    [
        ("vgg16", 138_357_544, 32),
        ("resnet50", 25_557_032, 161),
        ("transformer", 63_082_496, 253),
        ("bert-large", 336_226_108, 398),
        ("gpt2", 124_439_808, 148),
    ],
)
def test_builtin_parameter_counts_are_the_real_architectures(
    name: str, params: int, tensors: int
) -> None:
    p = profiles.builtin(name)
    assert p.num_params == params
    assert p.num_tensors == tensors
    assert p.param_bytes == 4 * params
    assert profiles.load(name) is p


@pytest.mark.parametrize(
    ("name", "real", "macs_per_image"),
    [("vgg16", VGG16, 15.47e9), ("resnet50", ResNet50, 4.09e9)],
)
def test_cnn_profiles_match_torchvision_tensors_and_flops(
    name: str, real: Any, macs_per_image: float
) -> None:
    with torch.device("meta"):
        model = real()
        flops = forward_flops(model, torch.empty(1, 3, 224, 224))
    assert shapes(profiles.builtin(name)) == [
        (n, tuple(t.shape)) for n, t in model.named_parameters()
    ]
    arch = getattr(architectures, name)()
    assert sum(layer.flops for layer in arch) == flops
    # torchvision's published "GFLOPS" (15.47, 4.09) count multiply-adds: half our FLOPs.
    assert flops / 2 == pytest.approx(macs_per_image, rel=0.005)


def test_transformer_profile_matches_torch_transformer_layers() -> None:
    arch = architectures.transformer_base()
    by_name = {layer.name: layer for layer in arch}
    with torch.device("meta"):
        enc = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
        dec = nn.TransformerDecoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
        embed = nn.Embedding(37000, 512)
        x = torch.empty(1, 128, 512)
        enc_flops = forward_flops(enc, x)
        dec_flops = forward_flops(dec, x, x)
        out_flops = forward_flops(lambda h: nn.functional.linear(h, embed.weight), x)

    def count(layers: list[str]) -> tuple[int, int]:
        ps = [p for n in layers for p in by_name[n].params]
        return sum(p.numel for p in ps), sum(by_name[n].flops for n in layers)

    for i in range(6):
        e = f"encoder.layers.{i}"
        d = f"decoder.layers.{i}"
        assert count([f"{e}.self_attn", f"{e}.ffn"]) == (
            sum(t.numel() for t in enc.parameters()),
            enc_flops,
        )
        assert count([f"{d}.self_attn", f"{d}.encoder_attn", f"{d}.ffn"]) == (
            sum(t.numel() for t in dec.parameters()),
            dec_flops,
        )
    assert by_name["embed"].params[0].shape == tuple(embed.weight.shape)
    assert by_name["decoder.output_projection"].params == ()
    assert by_name["decoder.output_projection"].flops == out_flops
    layers = [*[enc] * 6, *[dec] * 6]
    total = sum(t.numel() for m in layers for t in m.parameters())
    assert profiles.builtin("transformer").num_params == total + embed.weight.numel()
    # The usual estimate: 2 FLOPs per weight-matrix element per token (source and target
    # are both 128 tokens), the tied output projection included, plus QK^T and AV
    # (4 * 128^2 * 512 per attention; 3 attentions per encoder + decoder layer pair).
    tokens = 128
    matrices = sum(t.numel() for m in layers for t in m.parameters() if t.dim() == 2)
    dense = 2 * tokens * (matrices + embed.weight.numel())
    attention = 6 * 3 * 4 * tokens * tokens * 512
    assert sum(a.flops for a in arch) == dense + attention
    assert sum(a.flops for a in arch) / 1e9 == pytest.approx(16.73, abs=0.01)


def test_bert_large_and_gpt2_match_torch_layers() -> None:
    """Every BERT-large encoder layer is a post-norm nn.TransformerEncoderLayer and every
    GPT-2 block a pre-norm one (the same tensors, q/k/v fused): parameters and FLOPs per
    layer agree, and so do the embeddings and the tied vocabulary projections."""
    cases = [
        (architectures.bert_large(), "bert.encoder.layer", ("attention", "ffn"), 24, 1024, 16, 4096,
         128, 30522),
        (architectures.gpt2(), "transformer.h", ("attn", "mlp"), 12, 768, 12, 3072, 1024, 50257),
    ]  # fmt: skip
    for arch, prefix, parts, layers, d, heads, ffn, tokens, vocab in cases:
        by_name = {layer.name: layer for layer in arch}
        with torch.device("meta"):
            block = nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.0, batch_first=True)
            x = torch.empty(1, tokens, d)
            block_flops = forward_flops(block, x)
            embed = nn.Embedding(vocab, d)
            head_flops = forward_flops(partial(nn.functional.linear, weight=embed.weight), x)
        block_params = sum(t.numel() for t in block.parameters())
        for i in range(layers):
            names = [f"{prefix}.{i}.{part}" for part in parts]
            assert sum(p.numel for n in names for p in by_name[n].params) == block_params
            assert sum(by_name[n].flops for n in names) == block_flops
        embeddings = arch[0].params[0]
        assert embeddings.shape == tuple(embed.weight.shape)
        head = by_name["cls.predictions.decoder" if "bert" in prefix else "lm_head"]
        assert head.flops == head_flops
        assert all(p.numel != vocab * d for p in head.params), "the head's weight is tied"


ARCHITECTURES: dict[str, Callable[[], list[architectures.ArchLayer]]] = {
    "vgg16": architectures.vgg16,
    "resnet50": architectures.resnet50,
    "transformer": architectures.transformer_base,
    "bert-large": architectures.bert_large,
    "gpt2": architectures.gpt2,
}


def test_builtin_times_follow_the_stated_flop_model() -> None:
    from sumflow.profiles.builtin import V100

    for name in profiles.names():
        p = profiles.builtin(name)
        arch = {a.name: a for a in ARCHITECTURES[name]()}
        for layer in p.layers:
            want = arch[layer.name].flops * p.batch_size / V100.effective_flops_per_s * 1e3
            assert layer.forward_ms == pytest.approx(want, abs=1e-6)
            assert layer.backward_ms == pytest.approx(2 * layer.forward_ms, abs=2e-6)
        assert p.source
        assert (p.device, p.batch_size) == (V100.name, 8 if name == "gpt2" else 32)
    # ResNet-50 at ~350 images/s on a V100 in FP32, the figure the efficiency is set from.
    r = profiles.builtin("resnet50")
    assert 300 < r.batch_size / (r.compute_ms / 1e3) < 450
    assert profiles.builtin("vgg16").compute_ms == pytest.approx(344.0, rel=0.01)
    assert profiles.builtin("transformer").compute_ms == pytest.approx(186.0, rel=0.01)
    # 3 x 87 GFLOPs per 128-token sequence, 3 x 292 GFLOPs per 1,024-token one.
    assert profiles.builtin("bert-large").compute_ms == pytest.approx(969.3, rel=0.01)
    assert profiles.builtin("gpt2").compute_ms == pytest.approx(810.6, rel=0.01)


# ---- the JSON format ----------------------------------------------------------------------


@pytest.mark.parametrize("name", profiles.names())
def test_json_round_trip(tmp_path: Path, name: str) -> None:
    p = profiles.builtin(name)
    path = profiles.save(p, tmp_path / f"{name}.json")
    back = profiles.load(str(path))
    assert back == p
    assert ModelProfile.from_json(p.to_json()) == p
    assert json.loads(path.read_text())["version"] == profiles.FORMAT_VERSION


def small() -> dict[str, Any]:
    return {
        "version": 1,
        "name": "tiny",
        "source": "hand-made",
        "device": "none",
        "batch_size": 4,
        "sample": "a number",
        "dtype": "float32",
        "layers": [
            {
                "name": "a",
                "forward_ms": 1.0,
                "backward_ms": 2.0,
                "params": [{"name": "a.w", "shape": [3, 2]}, {"name": "a.b", "shape": [3]}],
            },
            {"name": "b", "forward_ms": 0, "backward_ms": 0.5, "params": []},
        ],
    }


def _set(path: tuple[Any, ...], value: Any) -> Any:
    def edit(d: dict[str, Any]) -> None:
        target: Any = d
        for k in path[:-1]:
            target = target[k]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value

    return edit


_DELETE = object()


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (_set(("name",), _DELETE), ["missing field 'name'"]),
        (
            _set(("layers", 0, "forward_ms"), _DELETE),
            ["layer 0 ('a')", "missing field 'forward_ms'"],
        ),
        (
            _set(("layers", 0, "params", 1, "shape"), _DELETE),
            ["layer 0 ('a')", "parameter 1", "'shape'"],
        ),
        (_set(("layers", 1, "backward_ms"), -1.0), ["layer 1 ('b')", "'backward_ms'", ">= 0"]),
        (_set(("layers", 1, "forward_ms"), float("nan")), ["layer 1 ('b')", "'forward_ms'"]),
        (_set(("layers", 1, "forward_ms"), "1"), ["layer 1 ('b')", "'forward_ms'"]),
        (
            _set(("layers", 0, "params", 0, "shape"), [3, 2.5]),
            ["layer 0 ('a')", "'a.w'", "'shape'"],
        ),
        (_set(("layers", 0, "params", 0, "shape"), [3, 0]), ["layer 0 ('a')", "'a.w'", "positive"]),
        (_set(("layers", 0, "params", 0, "shape"), [True, 2]), ["'a.w'", "'shape'"]),
        (
            _set(("layers", 0, "params", 0, "shape"), "3x2"),
            ["layer 0 ('a')", "'shape' must be a list"],
        ),
        (_set(("layers", 1, "name"), "a"), ["duplicate layer name 'a'"]),
        (
            _set(("layers", 1, "params"), [{"name": "a.b", "shape": [1]}]),
            ["layer 'b'", "duplicate parameter name 'a.b'", "layer 'a'"],
        ),
        (
            _set(("layers", 0, "params", 1, "name"), "a.w"),
            ["layer 0 ('a')", "duplicate parameter name 'a.w'"],
        ),
        (_set(("extra",), 1), ["unknown field 'extra'"]),
        (_set(("layers", 0, "flops"), 1), ["layer 0 ('a')", "unknown field 'flops'"]),
        (
            _set(("layers", 0, "params", 0, "dtype"), "float16"),
            ["parameter 0", "unknown field 'dtype'"],
        ),
        (_set(("version",), 2), ["'version'", "version 1"]),
        (_set(("version",), "1"), ["'version'"]),
        (_set(("dtype",), "float16"), ["'dtype'", "float32"]),
        (_set(("batch_size",), 0), ["'batch_size'", ">= 1"]),
        (_set(("layers",), []), ["'layers'", "empty"]),
        (_set(("layers",), {"a": 1}), ["'layers' must be a list"]),
        (_set(("layers", 0), [1, 2]), ["layer 0", "JSON object"]),
    ],
)
def test_validation_names_the_field_and_the_layer(edit: Any, words: list[str]) -> None:
    data = small()
    edit(data)
    with pytest.raises(ValueError, match=re.escape(words[0])) as info:
        ModelProfile.from_dict(data)
    for w in words[1:]:
        assert w in str(info.value), (w, str(info.value))


def test_validation_of_files_and_names(tmp_path: Path) -> None:
    assert ModelProfile.from_dict(small()).num_tensors == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json: profile is not valid JSON"):
        profiles.load(bad)
    with pytest.raises(ValueError, match="no built-in profile or file named 'nope'"):
        profiles.load("nope")
    with pytest.raises(ValueError, match="no built-in profile named 'nope'"):
        profiles.builtin("nope")
    with pytest.raises(ValueError, match="layer 'x': field 'forward_ms'"):
        LayerProfile("x", (), -0.1, 0.0)
    with pytest.raises(ValueError, match="'shape'"):
        ParamSpec("w", [2, 2])  # type: ignore[arg-type]


# ---- scaling ------------------------------------------------------------------------------


def test_scale_keeps_tensors_and_order_and_scales_sizes_and_times() -> None:
    p = profiles.builtin("resnet50")
    s = profiles.scale(p, size_scale=0.01, time_scale=3.0)
    assert [x.name for x in s.params()] == [x.name for x in p.params()]
    assert [layer.name for layer in s.layers] == [layer.name for layer in p.layers]
    for a, b in zip(p.params(), s.params(), strict=True):
        assert b.shape == (max(1, round(a.numel * 0.01)),)
    assert s.num_params == pytest.approx(p.num_params * 0.01, rel=0.01)
    assert s.forward_ms == pytest.approx(3 * p.forward_ms)
    assert s.backward_ms == pytest.approx(3 * p.backward_ms)
    assert (s.name, s.device, s.batch_size) == (p.name, p.device, p.batch_size)
    assert "x0.01" in s.source
    tiny = profiles.scale(p, size_scale=1e-9, time_scale=1)
    assert tiny.num_params == tiny.num_tensors == 161
    assert profiles.scale(p, size_scale=1, time_scale=0).compute_ms == 0
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="size_scale"):
            profiles.scale(p, size_scale=bad, time_scale=1)
        if bad != 0:
            with pytest.raises(ValueError, match="time_scale"):
                profiles.scale(p, size_scale=1, time_scale=bad)

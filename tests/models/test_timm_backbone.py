"""timm:NAME backbones: built offline, weights loaded exactly, ONNX graphs equal to torch.

Small timm test models with random weights keep it fast: `test_efficientnet` (conv, BatchNorm,
squeeze-excite pooling, global pooling, 0.1 M parameters) in the default suite; `test_resnet`
and `mobilenetv3_small_050` in the slow one.
"""
from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from models import (
    ClassHead,
    SLCNet,
    backbone_input_spec,
    build_backbone,
    check_backbone_name,
    list_backbones,
    spec_normalisation,
)
from models.timm_backbone import import_timm
from trainer.export import PARITY_TOL, _export_graph, _wrappers, check_graph, parity

SHAPE = (3, 64, 64)
FAST = "test_efficientnet"


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Any connection attempt fails the test: timm backbones must never download."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:] if len(args) > 1 else kwargs}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Random weights *and* BatchNorm statistics, so eval-mode outputs are far from trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if not t.is_floating_point():
                continue
            if name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            else:
                t.copy_(torch.randn(t.shape, generator=g) * (0.5 if name.endswith("weight") else 0.2))


def _net(model_name: str, D: int = 5, seed: int = 0) -> SLCNet:
    mean, std = spec_normalisation(backbone_input_spec(f"timm:{model_name}"))
    body = build_backbone(f"timm:{model_name}", SHAPE)
    _randomise(body, seed)
    return SLCNet(body, ClassHead(body.embed_dim, D), torch.from_numpy(mean), torch.from_numpy(std)).eval()


def test_input_spec_from_timms_pretrained_config():
    spec = backbone_input_spec("timm:resnet18")
    assert spec == {"height": 224, "width": 224, "channels": 3, "mean": pytest.approx([0.485, 0.456, 0.406]),
                    "std": pytest.approx([0.229, 0.224, 0.225]), "interpolation": "bicubic"}
    assert backbone_input_spec("timm:resnet18.tv_in1k")["interpolation"] == "bilinear"  # a tag's own config
    assert backbone_input_spec("timm:vit_tiny_patch16_384")["height"] == 384
    assert backbone_input_spec("timm:vit_tiny_patch16_224", img_size=96)["width"] == 96
    assert backbone_input_spec("mlp") is None and backbone_input_spec("resnet_glyph") is None


class _Spy(torch.nn.Module):
    """Records what reaches the backbone."""

    def __init__(self):
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 3, H, W] -> [B, 2]
        self.seen.append(x)
        return x.flatten(1)[:, :2]


def test_per_channel_normalisation_in_slcnet():
    """Raw pixels equal to mean_c*255 + k*std_c*255 in channel c reach the backbone as exactly k."""
    spec = backbone_input_spec("timm:resnet18")
    mean, std = spec_normalisation(spec)
    assert mean.shape == std.shape == (3, 1, 1) and mean.dtype == np.float32
    spy = _Spy()
    net = SLCNet(spy, ClassHead(2, 2), torch.from_numpy(mean), torch.from_numpy(std))
    k = torch.tensor([-1.5, 0.0, 2.0])
    x = torch.stack([torch.full((4, 4), (m + kk * s) * 255.0)
                     for m, s, kk in zip(spec["mean"], spec["std"], k.tolist())])[None]  # [1, 3, 4, 4]
    net.embed(x)
    torch.testing.assert_close(spy.seen[0], k.view(1, 3, 1, 1).expand(1, 3, 4, 4), atol=1e-5, rtol=0)


def test_timm_backbone_embeds_and_trains():
    torch.manual_seed(0)
    body = build_backbone(f"timm:{FAST}", SHAPE, drop_rate=0.0)
    x = torch.randn(4, *SHAPE, requires_grad=True)
    h = body(x)  # [4, d]
    assert h.shape == (4, body.embed_dim) and torch.isfinite(h).all()
    h.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in body.parameters() if p.requires_grad)
    # embed_dim is the real output width, not num_features (MobileNetV3 has a 1024-wide conv head)
    assert build_backbone("timm:mobilenetv3_small_050", SHAPE).embed_dim == 1024
    assert "timm:resnet18" not in list_backbones()  # an open family, not a registry entry


def _export_and_compare(net: SLCNet, tmp_path: Path) -> dict[str, float]:
    """The three graphs exported the way trainer/export.py does, each checked against torch."""
    rng = np.random.default_rng(0)
    x = (rng.random((16, *SHAPE)) * 255).astype(np.float32)  # raw 0..255 pixels
    class_id = rng.integers(0, net.head.weight.shape[0], len(x)).astype(np.int64)
    example_x, example_c = torch.from_numpy(x[:4]), torch.from_numpy(class_id[:4])
    report = {}
    for kind, module in _wrappers(net).items():
        path = tmp_path / f"{kind}.onnx"
        _export_graph(module, kind, (example_x, example_c) if kind == "single" else (example_x,), path, external=False)
        check_graph(path, kind)
        report[kind] = parity(path, kind, module, x, class_id)  # raises past PARITY_TOL
    with torch.no_grad():
        logits = net(torch.from_numpy(x))
    assert logits.std() > 0.1, "outputs near zero would make the comparison vacuous"
    return report


def test_onnx_parity_small_timm_model(tmp_path):
    report = _export_and_compare(_net(FAST), tmp_path)
    assert set(report) == {"backbone", "full", "single"} and max(report.values()) <= PARITY_TOL


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["test_resnet", "mobilenetv3_small_050"])
def test_onnx_parity_more_timm_models(model_name, tmp_path):
    report = _export_and_compare(_net(model_name), tmp_path)
    assert max(report.values()) <= PARITY_TOL


def _timm_state(seed: int, with_head: bool = True) -> dict[str, torch.Tensor]:
    """A state dict in timm's own layout (classifier included), as a hub or timm training run saves it."""
    timm = import_timm()
    model = timm.create_model(FAST, pretrained=False, num_classes=7)
    _randomise(model, seed)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if not with_head:
        state = {k: v for k, v in state.items() if not k.startswith("classifier.")}
    return state


def _assert_loaded(body, state: dict[str, torch.Tensor]) -> None:
    got = body.model.state_dict()
    assert set(got) == {k for k in state if not k.startswith("classifier.")}
    for k, v in got.items():
        assert torch.equal(v, state[k]), k


@pytest.mark.parametrize("fmt", ["pt", "pth-wrapped", "safetensors"])
def test_weights_round_trip(fmt, tmp_path):
    state = _timm_state(seed=3)
    path = tmp_path / f"w.{fmt.split('-')[0]}"
    if fmt == "safetensors":
        save_file(state, str(path))
    elif fmt == "pth-wrapped":  # a training checkpoint of a DDP-wrapped model
        torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, path)
    else:
        torch.save(state, path)
    torch.manual_seed(123)
    _assert_loaded(build_backbone(f"timm:{FAST}", SHAPE, weights=path), state)
    _assert_loaded(build_backbone(f"timm:{FAST}", SHAPE, weights=str(path)), state)


def test_an_slc_runs_checkpoint_of_a_timm_backbone_loads_into_a_new_run(tmp_path):
    """A run's checkpoint.pt (SLCNet: backbone.model.*, head.*, mean, std) starts a new timm backbone:
    its backbone part, every tensor as saved; the old head is dropped."""
    source = _net(FAST, D=5, seed=4)
    torch.save(source.state_dict(), tmp_path / "checkpoint.pt")
    torch.manual_seed(9)
    body = build_backbone(f"timm:{FAST}", SHAPE, weights=tmp_path / "checkpoint.pt")
    _assert_loaded(body, source.backbone.model.state_dict())


def _one_line_error(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError, match=match) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message
    return message


def test_weights_errors_are_one_line(tmp_path):
    def build(weights):
        return build_backbone(f"timm:{FAST}", SHAPE, weights=weights)

    _one_line_error("does not exist", build, tmp_path / "absent.safetensors")
    other = tmp_path / "resnet.safetensors"  # another architecture's weights
    save_file(import_timm().create_model("test_resnet", num_classes=0).state_dict(), str(other))
    msg = _one_line_error("do not fit timm:test_efficientnet: missing ", build, other)
    assert "unexpected" in msg and "in all)" in msg
    partial = tmp_path / "partial.pt"
    state = _timm_state(seed=1, with_head=False)
    torch.save({k: v for k, v in state.items() if k != "conv_stem.weight"}, partial)
    _one_line_error(r"missing conv_stem\.weight$", build, partial)
    reshaped = tmp_path / "reshaped.pt"
    torch.save(state | {"conv_stem.weight": torch.zeros(1, 1, 1, 1)}, reshaped)
    _one_line_error(r"shapes differ: conv_stem\.weight \(1, 1, 1, 1\) vs", build, reshaped)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    _one_line_error("is not a state dict or safetensors file", build, garbage)
    pickled = tmp_path / "model.pt"  # a whole pickled module: weights_only refuses to unpickle it
    torch.save(torch.nn.Linear(2, 2), pickled)
    _one_line_error("is not a state dict or safetensors file", build, pickled)


def test_unknown_names_are_one_line():
    _one_line_error(r"unknown timm model 'resnt18'; e\.g\. resnet18", check_backbone_name, "timm:resnt18")
    _one_line_error("Invalid pretrained tag", check_backbone_name, "timm:resnet18.nope")
    _one_line_error("nothing is downloaded", check_backbone_name, "timm:hf-hub:timm/resnet18.a1_in1k")
    msg = _one_line_error("unknown backbone 'resnet9000'; built-in: cnn6, linear", check_backbone_name, "resnet9000")
    assert "timm:NAME" in msg
    _one_line_error("unknown timm model", build_backbone, "timm:nope_net", SHAPE)
    _one_line_error("unknown timm model", backbone_input_spec, "timm:nope_net")
    _one_line_error("takes 224x224 inputs only", build_backbone, "timm:vit_tiny_patch16_224", SHAPE)
    _one_line_error("unexpected keyword argument 'widht'", build_backbone, f"timm:{FAST}", SHAPE, widht=2)
    check_backbone_name("mlp")
    check_backbone_name("timm:resnet18.a1_in1k")

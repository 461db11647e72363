"""Backbone registry: every registered backbone maps [B, *shape] to [B, embed_dim]."""
import pytest
import torch

from models import ClassHead, SLCNet, build_backbone, list_backbones

# Small instances so the suite stays fast; shapes each backbone is meant for.
CASES = {
    "linear": ((64,), {}),
    "mlp": ((784,), {"hidden": 32}),
    "cnn6": ((3, 32, 32), {"width": 0.05, "dense": 16}),
    "resnet_glyph": ((1, 32, 32), {"width": 4, "embed": 16}),
}


def test_every_backbone_has_a_case():
    assert set(list_backbones()) <= set(CASES), "add a small case for the new backbone"


@pytest.mark.parametrize("name", list_backbones())
def test_backbone_output_shape_and_gradient(name):
    torch.manual_seed(0)
    shape, params = CASES[name]
    body = build_backbone(name, shape, **params)
    x = torch.randn(4, *shape, requires_grad=True)
    h = body(x)
    assert h.shape == (4, body.embed_dim)
    assert torch.isfinite(h).all()
    h.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()  # gradient reaches the input
    grads = [p.grad for p in body.parameters()]  # and every parameter (linear has none)
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", list_backbones())
def test_slcnet_single_logit_equals_full_row(name):
    """The single-logit path (gather one row of W) gives the same number as the full head."""
    torch.manual_seed(0)
    shape, params = CASES[name]
    body = build_backbone(name, shape, **params)
    model = SLCNet(body, ClassHead(body.embed_dim, 7), mean=0.5, std=2.0).eval()
    x = torch.rand(5, *shape) * 10
    class_id = torch.tensor([0, 6, 3, 3, 1])
    full = model(x)  # [5, 7]
    assert full.shape == (5, 7)
    torch.testing.assert_close(model.single(x, class_id), full[torch.arange(5), class_id], rtol=1e-5, atol=1e-5)
    # Normalisation lives inside: raw x equals the backbone applied to (x - mean) / std.
    torch.testing.assert_close(model.embed(x), body((x - 0.5) / 2.0))


def test_unknown_backbone_and_cnn6_shape_check():
    with pytest.raises(KeyError):
        build_backbone("resnet9000", (3, 32, 32))
    with pytest.raises(ValueError):
        build_backbone("cnn6", (784,))


# ------------------------------------------------------------------ starting weights and keywords
def _one_line(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize("name", list_backbones())
@pytest.mark.parametrize("form", ["run checkpoint", "backbone state dict"])
def test_a_built_in_backbone_starts_from_saved_weights(name, form, tmp_path):
    """Every built-in takes weights=FILE: an slc run's whole SLCNet state dict (the head's keys
    dropped) or the backbone's own; every tensor, BatchNorm statistics included, is the saved one."""
    shape, params = CASES[name]
    torch.manual_seed(1)
    source = SLCNet(build_backbone(name, shape, **params), ClassHead(build_backbone(name, shape, **params).embed_dim, 5),
                    torch.tensor(3.0), torch.tensor(7.0))
    for buf in source.backbone.buffers():  # running statistics away from their initial values
        if buf.dtype.is_floating_point:
            buf.uniform_(0.5, 2.0)
    path = tmp_path / "w.pt"
    torch.save(source.state_dict() if form == "run checkpoint" else source.backbone.state_dict(), path)
    torch.manual_seed(2)
    body = build_backbone(name, shape, weights=path, **params)
    want = source.backbone.state_dict()
    got = body.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    x = torch.randn(3, *shape)
    body.eval(), source.backbone.eval()
    torch.testing.assert_close(body(x), source.backbone(x), rtol=0, atol=0)


def test_weights_of_another_width_are_one_line_naming_the_shapes_and_the_runs_config(tmp_path):
    shape = (1, 32, 32)
    src = SLCNet(build_backbone("resnet_glyph", shape, width=4, embed=16), ClassHead(16, 3), torch.tensor(0.0),
                 torch.tensor(1.0))
    torch.save(src.state_dict(), tmp_path / "run.pt")
    msg = _one_line(r"do not fit resnet_glyph: shapes differ: features\.0\.weight \(4, 1, 3, 3\) vs \(8, 1, 3, 3\)",
                    build_backbone, "resnet_glyph", shape, weights=tmp_path / "run.pt", width=8, embed=16)
    assert "backbone_params of its config.json" in msg
    torch.save(build_backbone("mlp", (784,), hidden=32).state_dict(), tmp_path / "mlp.pt")
    msg = _one_line("do not fit resnet_glyph: missing ", build_backbone, "resnet_glyph", shape,
                    weights=tmp_path / "mlp.pt", width=4, embed=16)
    assert "unexpected net.1.weight" in msg and "config.json" not in msg  # not a run's: no run hint


def test_backbone_keywords_are_checked_against_the_constructor():
    from models import check_backbone_params

    _one_line(r"backbone resnet_glyph takes no keyword 'widht'; it takes: blocks, embed, pool, width",
              check_backbone_params, "resnet_glyph", {"widht": 8})
    _one_line(r"backbone resnet_glyph: width must be an integer, got 'abc'", check_backbone_params, "resnet_glyph",
              {"width": "abc"})
    _one_line(r"backbone cnn6: width must be a number, got True", check_backbone_params, "cnn6", {"width": True})
    _one_line("takes no keyword 'width'; it takes: hidden, layers", build_backbone, "mlp", (784,), width=8)
    check_backbone_params("cnn6", {"width": 1, "dense": 16, "weights": "any"})  # an int where a float goes
    check_backbone_params("timm:resnet18", {"anything": 1})  # timm's keywords are timm's to check

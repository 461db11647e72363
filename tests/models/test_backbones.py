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

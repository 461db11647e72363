"""`slc train`'s keywords and starting weights: a wrong `--backbone-param` / `--loss-param` or
weights file is one line before any data is read, for every backbone and loss; a built-in backbone
starts from an earlier run (`--weights RUN`: its backbone, parameters and checkpoint)."""
from __future__ import annotations

import inspect
import json

import pytest
import torch

from tests.cli.test_cli import run

TINY = ("--dataset", "digits", "--backbone", "mlp", "--backbone-param", "hidden=16", "--epochs", 1,
        "--batch-size", 64, "--device", "cpu")


@pytest.mark.parametrize("args, option, words", [
    (("--backbone-param", "widht=8"), "--backbone-param",
     "backbone resnet_glyph takes no keyword 'widht'; it takes: blocks, embed, pool, width; backbone mlp takes"),
    (("--backbone", "resnet_glyph", "--backbone-param", "width=abc"), "--backbone-param",
     "backbone resnet_glyph: width must be an integer, got 'abc'"),
    (("--loss", "max_margin", "--loss-param", "margin=1"), "--loss-param",
     "loss max_margin takes no keyword 'margin'; it takes: anneal, gamma, tau"),
    (("--loss", "self_norm", "--loss-param", "alpha=x"), "--loss-param", "loss self_norm: alpha must be a number, got 'x'"),
    (("--loss-param", "foo=1"), "--loss-param", "loss batch_ce takes no keyword 'foo'; it takes none"),
    (("--weights", "NOT_WEIGHTS"), "--weights", "is not a state dict or safetensors file"),
    (("--weights", "FOLDER"), "--weights", "is a folder but not a training run (no config.json / checkpoint.pt)"),
])
def test_a_wrong_backbone_keyword_or_weights_file_is_one_line_before_the_data(args, option, words, tmp_path, capsys):
    (tmp_path / "notes.pt").write_text("these are not weights")
    args = tuple(str(tmp_path / "notes.pt") if a == "NOT_WEIGHTS" else str(tmp_path) if a == "FOLDER" else a
                 for a in args)
    for name in ("A", "B"):  # unreadable images: decoding them would fail, so nothing may get that far
        (tmp_path / "letters" / name).mkdir(parents=True)
        (tmp_path / "letters" / name / "0.png").write_bytes(b"not a png")
    code, _, err = run(capsys, "train", "--dataset", f"imagefolder:{tmp_path / 'letters'}", *args, "--out", tmp_path / "r")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"Invalid value for {option}: " in err and words in err, err
    assert not (tmp_path / "r").exists()  # refused before the output folder or the data


def test_every_backbone_and_loss_takes_its_own_defaults():
    """The check against the signature accepts what each constructor declares, and refuses a word for
    each keyword whose default is a number (the walk over both registries the CLI checks)."""
    from models import check_backbone_params, list_backbones
    from models.backbones import _REGISTRY
    from models.keywords import accepted, check_keywords
    from trainer.losses import list_losses, loss_class

    checked = 0
    for name in list_backbones():
        params = {k: p.default for k, p in accepted(_REGISTRY[name], skip=("input_shape",)).items()}
        check_backbone_params(name, params)
        for k, v in params.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                with pytest.raises(ValueError, match=f"{k} must be"):
                    check_backbone_params(name, {k: "word"})
                checked += 1
    for name in list_losses():
        fn = loss_class(name)
        params = {k: p.default for k, p in accepted(fn, skip=("num_classes",)).items()
                  if p.default is not inspect.Parameter.empty}
        check_keywords(fn, params, name, skip=("num_classes",))
        for k, v in params.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                with pytest.raises(ValueError, match=f"{k} must be"):
                    check_keywords(fn, {k: "word"}, name, skip=("num_classes",))
                checked += 1
    assert checked >= 10

    def open_ended(num_classes: int, scale: float = 1.0, **more):
        return None

    check_keywords(open_ended, {"anything": 1}, "loss x", skip=("num_classes",))  # **more takes it
    with pytest.raises(ValueError, match="scale must be a number"):
        check_keywords(open_ended, {"scale": "big"}, "loss x", skip=("num_classes",))


@pytest.mark.integration
def test_a_run_starts_from_an_earlier_runs_weights(tmp_path, capsys):
    assert run(capsys, "train", *TINY, "--seed", 1, "--out", tmp_path / "a")[0] == 0
    source = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)
    # the folder as --weights: its backbone and parameters are taken; a near-zero lr keeps the weights
    code, _, _ = run(capsys, "train", "--dataset", "digits", "--weights", tmp_path / "a", "--epochs", 1,
                     "--max-steps", 1, "--lr", 1e-9, "--seed", 2, "--device", "cpu", "--out", tmp_path / "b")
    assert code == 0
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert (config["backbone"], config["backbone_params"]) == ("mlp", {"hidden": 16})
    assert config["weights"] == str((tmp_path / "a" / "checkpoint.pt").resolve())
    started = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    fresh = torch.load(_fresh(tmp_path, capsys), weights_only=True)  # the same run without --weights
    params = [k for k in source if k.startswith("backbone.") and k.endswith(("weight", "bias"))]
    assert params
    for k in params:
        torch.testing.assert_close(started[k], source[k], rtol=0, atol=1e-6)
        assert (fresh[k] - source[k]).abs().max() > 1e-3, k  # without the weights the start is elsewhere


def _fresh(tmp_path, capsys):
    code, _, _ = run(capsys, "train", *TINY, "--max-steps", 1, "--lr", 1e-9, "--seed", 2, "--out", tmp_path / "c")
    assert code == 0
    return tmp_path / "c" / "checkpoint.pt"

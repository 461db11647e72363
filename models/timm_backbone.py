"""`timm:NAME` backbones: any timm model as the embedding h(x), optionally with local weights.

The model is built with `pretrained=False, num_classes=0` (timm's classifier replaced by an
identity: the output is the pooled, pre-classifier embedding) so nothing is ever downloaded;
`weights=FILE` loads a state dict saved by torch (.pt/.pth, read with weights_only=True) or a
.safetensors file, in timm's own key layout (e.g. the model.safetensors of a timm/ hub repo).

Input size and normalisation come from timm's pretrained config (metadata shipped in the timm
package, no network): `timm_input_spec` returns them for the trainer to decode RGB images at
that size and to set SLCNet's mean/std buffers (docs/backbones.md).

torchvision: timm imports it at import time (timm.layers uses torchvision.ops.misc). PyPI's
x86_64 torchvision wheels are CUDA builds whose C ops (_C.so) cannot load beside the CPU torch
build this project pins; torchvision's Python modules then fail on import only because
`torchvision::nms`/`qnms` have no schema to register fake kernels on. `_torchvision_op_schemas`
declares those two schemas (no kernels) when the C ops cannot load, so timm imports; timm's
networks use none of torchvision's C ops. Where _C loads (a CUDA torch), nothing is declared.
"""
from __future__ import annotations

import difflib
import glob
import importlib.util
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

PREFIX = "timm:"
EXAMPLES = ("resnet18", "resnet50", "efficientnet_b0", "mobilenetv3_large_100", "convnext_tiny", "vit_small_patch16_224")
_TORCHVISION_SCHEMAS = (  # torchvision 0.28's _meta_registrations registers fakes on these unconditionally
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_declared: list[torch.library.Library] = []  # kept alive: a Library's definitions die with it


def is_timm(name: str) -> bool:
    return name.startswith(PREFIX)


def _torchvision_op_schemas() -> None:
    """Declare torchvision's nms/qnms schemas when its C ops cannot load (see the module doc)."""
    if _declared or "torchvision" in sys.modules:
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    libs = glob.glob(os.path.join(next(iter(spec.submodule_search_locations)), "_C*.so"))
    try:
        for lib in libs:
            torch.ops.load_library(lib)  # what torchvision.extension does; loading twice is a no-op
        if libs:
            return
    except OSError:
        pass
    lib = torch.library.Library("torchvision", "DEF")
    for schema in _TORCHVISION_SCHEMAS:
        lib.define(schema)
    _declared.append(lib)


def import_timm():
    """timm, or a one-line ValueError saying why it cannot be used."""
    try:
        _torchvision_op_schemas()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchvision's "failed to load image extension" (image.so, unused)
            import timm
    except ModuleNotFoundError as exc:
        raise ValueError(f"timm is not installed (pip install timm): {exc}") from None
    except (ImportError, RuntimeError, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"timm cannot be imported beside this torch: {first}") from None
    return timm


def check_timm_name(model_name: str) -> None:
    """ValueError (one line) unless timm is importable and knows `model_name` (arch or arch.tag)."""
    timm = import_timm()
    if ":" in model_name or "/" in model_name:
        raise ValueError(f"timm:{model_name}: give a timm model name (nothing is downloaded; "
                         f"pass a hub repo's model.safetensors as weights=FILE)")
    arch = model_name.split(".", 1)[0]
    if not model_name or not timm.is_model(arch):
        close = difflib.get_close_matches(arch, timm.list_models(), n=5, cutoff=0.6)
        raise ValueError(f"unknown timm model {model_name!r}; e.g. {', '.join(close or EXAMPLES)} "
                         f"(timm.list_models() has them all)")
    try:
        timm.models.get_pretrained_cfg(model_name)
    except RuntimeError as exc:  # "Invalid pretrained tag (x) for arch."
        raise ValueError(f"timm:{model_name}: {exc}") from None


class TimmBackbone(nn.Module):
    """A timm model without its classifier: [B, C, H, W] normalised -> [B, embed_dim]."""

    def __init__(self, model: nn.Module, embed_dim: int):
        super().__init__()
        self.model = model
        self.embed_dim = int(embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, H, W] -> [B, embed_dim]
        return self.model(x)


def build_timm_backbone(model_name: str, input_shape: tuple[int, ...], weights: str | os.PathLike | None = None,
                        **params) -> TimmBackbone:
    """timm.create_model(model_name, pretrained=False, num_classes=0, in_chans=C, **params) [+ weights]."""
    check_timm_name(model_name)
    timm = import_timm()
    if len(input_shape) != 3:
        raise ValueError(f"timm:{model_name} needs input_shape (C, H, W), got {tuple(input_shape)}")
    c, h, w = input_shape
    cfg = _pretrained_cfg(model_name)
    if cfg.get("fixed_input_size") and "img_size" not in params and tuple(cfg["input_size"][1:]) != (h, w):
        raise ValueError(f"timm:{model_name} takes {cfg['input_size'][1]}x{cfg['input_size'][2]} inputs only "
                         f"(timm's pretrained config), got {h}x{w}")
    try:
        model = timm.create_model(model_name, pretrained=False, num_classes=0, in_chans=c, **params)
    except TypeError as exc:
        raise ValueError(f"timm:{model_name}: {exc}") from None
    if weights is not None:
        load_weights(model, weights, f"timm:{model_name}", run_prefix=RUN_PREFIX + "model.")
    return TimmBackbone(model, _output_dim(model, input_shape, model_name))


def _output_dim(model: nn.Module, input_shape: tuple[int, ...], model_name: str) -> int:
    """The embedding size, by one forward at the input shape (num_features misses conv heads)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(1, *input_shape))  # [1, d]
    except RuntimeError as exc:
        raise ValueError(f"timm:{model_name} cannot take inputs of shape {tuple(input_shape)}: "
                         f"{str(exc).splitlines()[0]}") from None
    finally:
        model.train(was_training)
    if out.dim() != 2:
        raise ValueError(f"timm:{model_name} gives outputs of shape {tuple(out.shape)}, expected [B, d]")
    return out.shape[1]


def _head_prefixes(model: nn.Module) -> tuple[str, ...]:
    """State-dict prefixes of timm's classifier(s), absent from a num_classes=0 model."""
    classifier = (getattr(model, "pretrained_cfg", None) or {}).get("classifier") or ()
    names = (classifier,) if isinstance(classifier, str) else tuple(classifier)
    return tuple(f"{n}." for n in names)


def _few(keys: list[str], n: int = 2) -> str:
    return ", ".join(keys[:n]) + (f" … ({len(keys)} in all)" if len(keys) > n else "")


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A state dict from .safetensors or a torch file (weights_only); one-line errors."""
    timm = import_timm()
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"weights file {str(p)!r} does not exist")
    try:  # handles {'state_dict': …}/{'model': …} wrappers and DDP/compile prefixes
        state = timm.models.load_state_dict(str(p), use_ema=True, device="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling / header errors: the file is not weights
        first = str(exc).splitlines()[0].split(". ")[0] if str(exc) else type(exc).__name__  # torch's advice aside
        raise ValueError(f"weights file {str(p)!r} is not a state dict or safetensors file: {first}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"weights file {str(p)!r} holds no state dict of tensors")
    return state


RUN_PREFIX = "backbone."  # an slc run's checkpoint.pt / best.pt: SLCNet's keys, the backbone's under this


def load_weights(model: nn.Module, path: str | os.PathLike, label: str, run_prefix: str = RUN_PREFIX) -> None:
    """Load every backbone tensor from `path` into `model` (`label` names it in errors), ignoring a
    timm classifier's keys. The file is the backbone's own state dict or an slc run's checkpoint
    (every key of SLCNet: the backbone's are taken from under `run_prefix`, the head's dropped).

    Strict: a backbone key missing from the file, a key the model lacks (other than the head's),
    or a shape that differs is a one-line ValueError naming the first keys of each kind.
    """
    state, hint = read_state_dict(path), ""
    if "head.weight" in state or (any(k.startswith(run_prefix) for k in state)
                                  and not any(k.startswith(run_prefix) for k in model.state_dict())):
        state = {k[len(run_prefix):]: v for k, v in state.items() if k.startswith(run_prefix)}
        hint = " (an slc run's weights: give the backbone and the backbone_params of its config.json)"
    head = _head_prefixes(model)
    state = {k: v for k, v in state.items() if not (head and k.startswith(head))}
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in own
              if k in state and state[k].shape != own[k].shape]
    problems = ([f"missing {_few(missing)}"] if missing else []) + \
               ([f"unexpected {_few(unexpected)}"] if unexpected else [])
    problems = problems or ([f"shapes differ: {_few(shapes)}"] if shapes else [])  # shapes alone: same keys
    if problems:
        raise ValueError(f"weights {str(path)!r} do not fit {label}: {'; '.join(problems)}{hint}")
    model.load_state_dict(state, strict=True)


def _pretrained_cfg(model_name: str) -> dict:
    """timm's pretrained config of `model_name` (metadata only), timm's defaults where it has none."""
    timm = import_timm()
    cfg = timm.models.get_pretrained_cfg(model_name)
    return timm.data.resolve_data_config({}, pretrained_cfg=cfg.to_dict() if cfg else {}) | \
        {"fixed_input_size": bool(cfg and cfg.fixed_input_size)}


def timm_input_spec(model_name: str, img_size: int | tuple[int, int] | None = None, **_params) -> dict:
    """{"height", "width", "channels": 3, "mean", "std" (RGB, in 0..1), "interpolation"} of a timm model.

    `img_size` (a backbone param for models that take it, e.g. ViTs) overrides the config's size.
    """
    check_timm_name(model_name)
    cfg = _pretrained_cfg(model_name)
    _, h, w = cfg["input_size"]
    if img_size is not None:
        h, w = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    return {"height": int(h), "width": int(w), "channels": 3,
            "mean": [float(m) for m in cfg["mean"]], "std": [float(s) for s in cfg["std"]],
            "interpolation": str(cfg["interpolation"])}

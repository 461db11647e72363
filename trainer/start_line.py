"""The lines `slc train` prints as training starts: what was chosen, defaults and resolutions included
(backbone and where its weights come from, input size, batch, epochs, optimizer, lr, device), so a
user sees before the first step what minutes of training will be spent on; and the one warning a
pretrained-backbone user must not miss: `timm:NAME` without `--weights` starts from random weights."""
from __future__ import annotations

import logging

log = logging.getLogger("trainer.train")


def start_lines(resolved: dict, resume: bool = False) -> list[str]:
    """The start line, then a warning line when a timm backbone has no weights (`resolved`: the run's
    config.json as _setup writes it)."""
    backbone, weights = resolved["backbone"], resolved.get("weights")
    origin = f"pretrained weights {weights}" if weights else "random init"
    backbone += "".join(f" {k}={v}" for k, v in (resolved.get("backbone_params") or {}).items())
    shape = "x".join(str(v) for v in resolved["input_shape"])
    steps = f"{resolved['steps']:,} steps of {resolved['steps_per_epoch']:,}/epoch"
    line = (f"{'resuming' if resume else 'training'}: backbone {backbone} ({origin}), input {shape}, "
            f"{resolved['num_classes']:,} classes, loss {resolved['loss']}, batch {resolved['batch_size']}, "
            f"{resolved['epochs']} epochs ({steps}), optimizer {resolved['optimizer']} lr {resolved['lr']:g} "
            f"({resolved['schedule']}), device {resolved['device_resolved']} {resolved['precision']}")
    lines = [line]
    if backbone.startswith("timm:") and not weights and not resume:
        lines.append(f"warning: --backbone {resolved['backbone']} without --weights trains from random initialisation, not "
                     "from pretrained weights (nothing is downloaded): pass --weights FILE.safetensors "
                     "(docs/backbones.md) to fine-tune")
    return lines


def announce(resolved: dict, resume: bool = False) -> None:
    for line in start_lines(resolved, resume):
        (log.warning if line.startswith("warning:") else log.info)(line)

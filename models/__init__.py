"""Torch network definitions: backbone registry (built-ins and timm:NAME) and the per-class head."""
from models.backbones import (
    UnknownBackboneError, backbone_input_spec, build_backbone, check_backbone_name, check_backbone_params, list_backbones, register_backbone,
    spec_normalisation,
)
from models.head import ClassHead, SLCNet

__all__ = ["build_backbone", "list_backbones", "register_backbone", "check_backbone_name", "check_backbone_params", "backbone_input_spec",
           "spec_normalisation", "UnknownBackboneError", "ClassHead", "SLCNet"]

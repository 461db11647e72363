"""Torch network definitions: backbone registry and the per-class head."""
from models.backbones import build_backbone, list_backbones, register_backbone
from models.head import ClassHead, SLCNet

__all__ = ["build_backbone", "list_backbones", "register_backbone", "ClassHead", "SLCNet"]

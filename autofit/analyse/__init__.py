"""Stage 2, analyse: the per-layer table (parameters, saved activations, outputs, FLOPs) and the checkpoint
boundaries of the traced graph."""

from autofit.analyse.table import Analysis, LayerRow, LayerTable

__all__ = ["Analysis", "LayerRow", "LayerTable"]

"""Hydra experiment app for prune-finetune runs: data (``data``), models (``models``), reports (``report``)."""

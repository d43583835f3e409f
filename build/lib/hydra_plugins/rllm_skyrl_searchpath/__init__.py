"""Hydra plug-in package of rllm-skyrl; Hydra imports every module under ``hydra_plugins``."""

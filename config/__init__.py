"""rllm-skyrl's Hydra configs, installed as the package ``rllm_skyrl.config`` (``pkg://rllm_skyrl.config``)."""

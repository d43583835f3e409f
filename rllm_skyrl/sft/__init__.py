"""rLLM's ``AgentSFTTrainer(spec, backend="skyrl")``: supervised fine-tuning on SkyRL's own SFT trainer.

``data`` turns rLLM's ``messages`` rows into SkyRL's pretokenized rows with rLLM's masking rule;
``config`` turns an ``SFTSpec`` into SkyRL's ``SFTConfig``; ``metrics`` adds rLLM's metric names to
what SkyRL's trainer logs; ``backend`` is the ``SFTBackend`` that runs SkyRL's ``SFTTrainer``.
Registration with rLLM's dispatcher is the ``rllm_sft_trainer`` patch set (``rllm_plugin.register``).
"""

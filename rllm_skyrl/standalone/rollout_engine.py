"""The rollout-engine interface workflows sample from (rLLM's ``RolloutEngine``, reduced)."""

from __future__ import annotations

from typing import Any

from rllm_skyrl.records import ModelOutput


class RolloutEngine:
    """Serves the current policy to workflows.

    Subclasses implement ``_get_model_response``; callers use ``get_model_response``, which
    stamps the weight version that was live when the request *started*, so a weight sync that
    lands mid-request cannot relabel an older sample as fresh.
    """

    tokenizer: Any = None
    chat_parser: Any = None
    # Set by WorkflowEngine.execute_tasks so engines can switch to validation sampling params.
    is_validation: bool = False

    def __init__(self) -> None:
        self.weight_version = 0

    async def _get_model_response(self, messages: list[dict[str, Any]], **kwargs: Any) -> ModelOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement _get_model_response")

    async def get_model_response(self, messages: list[dict[str, Any]], **kwargs: Any) -> ModelOutput:
        weight_version = self.weight_version
        output = await self._get_model_response(messages, **kwargs)
        output.weight_version = weight_version
        return output

    @property
    def supports_token_in_token_out(self) -> bool:
        return False

    async def get_token_output_from_token_input(self, token_input: list[int], **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not support token-in/token-out generation")

    async def wake_up(self) -> None:
        """Reclaim inference memory before rollouts (no-op for engines that never sleep)."""

    async def sleep(self) -> None:
        """Release inference memory while training runs (no-op by default)."""

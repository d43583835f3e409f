"""What an AgentFlow's calls through rLLM's model gateway take from the engine, and the gateway
settings this backend refuses before anything starts.

An AgentFlow calls the policy over OpenAI's chat API at the gateway, which forwards to the inference
servers and records what they saw and sampled. The params pinned on every session are the engine's
train or validation params in that API's terms: ``logprobs`` is a flag there (the gateway sets it),
and ``max_tokens`` never exceeds the run's response length, which the training rows are sized for.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
TUNNEL_REFUSAL = (
    "rllm.gateway.tunnel is set: with backend=skyrl the model gateway listens on 127.0.0.1 only and "
    "opens no public tunnel; set rllm.gateway.tunnel=null (flows run on this machine)"
)
REMOTE_RUNTIME_REFUSAL = (
    "rllm.remote_runtime.enabled=true: its runtimes ({backend}) run the flows elsewhere and reach the "
    "policy through a public gateway URL, which backend=skyrl does not open (the gateway listens on "
    "127.0.0.1 only); pass agent_flow= and evaluator= to train the flow on this machine"
)
# Engine params that are not OpenAI chat params (``logprobs`` is a count in vLLM's sampling terms).
_NOT_CHAT = frozenset({"logprobs", "n"})


def session_params(engine: Any, is_validation: bool, given: dict[str, Any] | None) -> dict[str, Any]:
    """The engine's train or validation params, ``given`` on top, ``max_tokens`` capped."""
    defaults = engine.val_sampling_params if is_validation else engine.train_sampling_params
    params = {k: v for k, v in {**defaults, **(given or {})}.items() if k not in _NOT_CHAT and v is not None}
    limit = engine.max_response_length
    params["max_tokens"] = min(int(params.get("max_tokens") or limit), limit)
    return params


def refusal(config: DictConfig) -> str | None:
    """Why this config's gateway settings cannot run with this backend, or None."""
    if OmegaConf.select(config, "rllm.remote_runtime.enabled", default=False):
        backend = OmegaConf.select(config, "rllm.remote_runtime.backend", default="agentcore")
        return REMOTE_RUNTIME_REFUSAL.format(backend=backend)
    if OmegaConf.select(config, "rllm.gateway.tunnel", default=None):
        return TUNNEL_REFUSAL
    host = OmegaConf.select(config, "rllm.gateway.host", default=None)
    if host and host not in LOOPBACK_HOSTS:
        return (
            f"rllm.gateway.host={host}: with backend=skyrl the model gateway listens on 127.0.0.1 only "
            "(it has no credential of its own); set rllm.gateway.host=null"
        )
    return None

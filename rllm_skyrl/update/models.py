"""Trainable models by id: a Tinker-style training API over ``SkyRLWorkers``.

Tinker clients name a model (``model_id``) in every call; SkyRL's ``WorkerDispatch`` names a role.
At most one model per role, because the workers hold one policy and one critic actor group. ``""``
is Tinker's id for the base model behind ``create_sampling_client(base_model=...)``: it can be
sampled but not trained, so every call here refuses it with that explanation.

Per-row outputs (Tinker's ``TensorData``) hold the row's response tokens only, pad rows dropped.
SkyRL's policy worker returns only logprobs per row for RL losses, so their ``elementwise_loss`` is
recomputed on the driver (``rllm_skyrl.update.elementwise_loss``) and left out where that is not exact.
SkyRL's critic worker returns metrics only from ``forward_backward``: call ``forward`` for values.

``metrics["loss"]`` is the scalar loss under one key for every path: the worker's ``loss`` for
``cross_entropy``, ``final_loss`` (policy term plus any KL/entropy terms) for RL losses,
``critic_loss`` for the critic. SkyRL's own metric names are kept next to it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.tinker.types import ForwardBackwardOutput

from rllm_skyrl.data.batch_layout import last_tokens, pad_to_multiple, real_rows
from rllm_skyrl.run_config.losses import CRITIC, POLICY, POLICY_LOSS_NAMES, ResolvedLoss, resolve_loss
from rllm_skyrl.update.elementwise_loss import ElementwisePolicyLoss

BASE_MODEL_ID = ""
MODEL_ROLES = (POLICY, CRITIC)

_RL_FIELDS = ("advantages", "action_log_probs")
_CRITIC_FIELDS = ("values", "returns")
_MISSING = object()


@dataclass(frozen=True)
class TrainingModel:
    model_id: str
    role: str
    base_model: str


def tensor_data(values: Sequence[float]) -> dict[str, Any]:
    """Tinker's ``TensorData`` layout for a 1-D float array."""
    data = [float(v) for v in values]
    return {"data": data, "dtype": "float32", "shape": [len(data)]}


class ModelRegistry:
    """``model_id -> role`` over one ``SkyRLWorkers``; every training call is made by model id."""

    def __init__(self, workers) -> None:
        self.workers = workers
        self._models: dict[str, TrainingModel] = {}
        # What each role's workers hold in their AlgorithmConfig: set_algorithm_config changes it
        # there, and the elementwise recomputation must read the same values.
        self._algorithm = {role: copy.deepcopy(workers.cfg.trainer.algorithm) for role in MODEL_ROLES}
        self._critic_value_clip_on_workers = self._algorithm[CRITIC].value_clip
        self._elementwise = ElementwisePolicyLoss(self._algorithm[POLICY])
        # The loss function SkyRL's policy workers resolved when they were built (``policy_loss_fn``);
        # a later set_algorithm_config of policy_loss_type does not change it.
        self._built_policy_loss = workers.cfg.trainer.algorithm.policy_loss_type

    @property
    def model_ids(self) -> tuple[str, ...]:
        return tuple(self._models)

    def create_model(
        self, model_id: str, model_role: str = POLICY, base_model: str | None = None
    ) -> TrainingModel:
        """Register ``model_id`` as the model of ``model_role``, trained by that role's workers.

        ``base_model`` defaults to the policy's base model for both roles; a given one must be the
        path the role's workers were started from (they load weights once, at start).
        """
        if model_id == BASE_MODEL_ID:
            raise ValueError(
                "model_id '' names the base model for sampling clients and cannot be trained; "
                "pick a non-empty id"
            )
        if model_role not in MODEL_ROLES:
            raise ValueError(f"unknown model_role {model_role!r}; choose one of {list(MODEL_ROLES)}")
        if model_id in self._models:
            raise ValueError(f"model {model_id!r} already exists (role {self._models[model_id].role!r})")
        holder = next((m.model_id for m in self._models.values() if m.role == model_role), None)
        if holder is not None:
            raise ValueError(f"the {model_role} role already belongs to model {holder!r}; one model per role")
        if model_role not in self.workers.roles:
            raise ValueError(
                f"no {model_role} workers are running: start SkyRLWorkers with "
                f"trainer.{model_role}.model.path set (the policy's path for a critic on the same base)"
            )
        trainer = self.workers.cfg.trainer
        started_from = getattr(trainer, model_role).model.path
        wanted = base_model if base_model is not None else trainer.policy.model.path
        if wanted != started_from:
            raise ValueError(
                f"the {model_role} workers were started from {started_from!r}, not {wanted!r}; "
                f"pass base_model={started_from!r} or restart them from the model you want"
            )
        model = TrainingModel(model_id=model_id, role=model_role, base_model=started_from)
        self._models[model_id] = model
        return model

    def get(self, model_id: str) -> TrainingModel:
        if model_id == BASE_MODEL_ID:
            raise ValueError(
                "model_id '' is the base model that sampling clients use; it is not a trainable "
                "model: create_model(...) one and use its id"
            )
        try:
            return self._models[model_id]
        except KeyError:
            raise ValueError(f"unknown model_id {model_id!r}; known ids: {list(self._models)}") from None

    def _resolve(
        self,
        model_id: str,
        loss_fn: str | ResolvedLoss | None,
        loss_fn_config: Mapping[str, Any] | None,
        training: bool,
    ) -> tuple[TrainingModel, ResolvedLoss | None]:
        """No loss name means: the critic's own loss, a plain forward for the policy, and an error
        for a policy update (it must say what it optimises). A loss the run config already
        resolved (``ResolvedLoss``) is only checked against the model's role.
        """
        model = self.get(model_id)
        if isinstance(loss_fn, ResolvedLoss):
            if loss_fn_config:
                raise ValueError("loss_fn_config was given with an already resolved loss")
            if loss_fn.role != model.role:
                raise ValueError(
                    f"loss {loss_fn.loss_fn!r} was resolved for the {loss_fn.role}, not the {model.role}"
                )
            return model, loss_fn
        if loss_fn is None and model.role == CRITIC:
            loss_fn = "ppo_critic"
        if loss_fn is None:
            if training:
                raise ValueError(
                    f"forward_backward on policy model {model_id!r} needs a loss_fn; "
                    f"policy losses: {list(POLICY_LOSS_NAMES)}"
                )
            if loss_fn_config:
                raise ValueError("loss_fn_config was given without a loss_fn")
            return model, None
        return model, resolve_loss(model.role, loss_fn, loss_fn_config)

    def forward(
        self,
        model_id: str,
        batch: TrainingInputBatch,
        loss_fn: str | ResolvedLoss | None = None,
        loss_fn_config: Mapping[str, Any] | None = None,
    ) -> ForwardBackwardOutput:
        """Per-row logprobs (or values), plus the loss when one is named; no update."""
        model, resolved = self._resolve(model_id, loss_fn, loss_fn_config, training=False)
        padded, n_real = self._padded(batch, model.role)
        if model.role == CRITIC or resolved is None:
            out = self.workers.forward(model.role, padded)
            key = "values" if model.role == CRITIC else "logprobs"
            rows = [{key: out.loss_fn_outputs[i][key]} for i in range(n_real)]
            return _tinker_output(out.loss_fn_output_type, rows, {}, padded)
        _require_fields(batch, resolved)
        out = self.workers.forward(model.role, padded, **resolved.dispatch_kwargs())
        return self._policy_output(out, resolved, padded, n_real)

    def forward_backward(
        self,
        model_id: str,
        batch: TrainingInputBatch,
        loss_fn: str | ResolvedLoss | None = None,
        loss_fn_config: Mapping[str, Any] | None = None,
        *,
        elementwise_loss: bool = True,
    ) -> ForwardBackwardOutput:
        """Accumulate gradients of the named loss; ``optim_step`` applies them.

        ``elementwise_loss=False`` skips an RL loss's per-token terms (their recomputation is a
        backward pass of its own) for callers that read only the logprobs.

        Several calls before one ``optim_step`` equal one call on the concatenated rows, provided
        the rows carry the reduction for the whole set: policy losses are masked sums (scale
        advantages or SFT loss masks for the full set, as ``advantages.apply_loss_reduction`` and
        ``sft_examples_to_batch`` do); the critic averages per micro-batch and SkyRL's critic worker
        divides by the micro-batches accumulated at ``optim_step``, so equal-sized calls agree.
        """
        model, resolved = self._resolve(model_id, loss_fn, loss_fn_config, training=True)
        _require_fields(batch, resolved)
        padded, n_real = self._padded(batch, model.role)
        if model.role == CRITIC:
            # SkyRL's critic reads value_clip from worker state, not per call: push changes only.
            value_clip = resolved.skyrl_config.get("value_clip", self._algorithm[CRITIC].value_clip)
            if value_clip != self._critic_value_clip_on_workers:
                self.workers.set_algorithm_config(CRITIC, value_clip=value_clip)
                self._critic_value_clip_on_workers = value_clip
            out = self.workers.forward_backward(CRITIC, padded)
            metrics = {**out.metrics, "loss": float(out.metrics["critic_loss"])}
            return _tinker_output(out.loss_fn_output_type, [{} for _ in range(n_real)], metrics, padded)
        out = self.workers.forward_backward(POLICY, padded, **self._update_loss_kwargs(resolved))
        return self._policy_output(out, resolved, padded, n_real, elementwise_loss)

    def optim_step(self, model_id: str) -> float | None:
        """Apply the accumulated gradients; returns the gradient norm before clipping."""
        role = self.get(model_id).role  # an unknown id fails before the workers are asked
        return self.workers.optim_step(role)

    def set_algorithm_config(self, model_id: str, **settings: Any) -> None:
        """Change ``trainer.algorithm`` fields on the model's workers until changed again.

        For the critic, a ``value_clip`` in a call's ``loss_fn_config`` applies to that call only;
        calls without one use the value set here.
        """
        role = self.get(model_id).role
        algorithm = self._algorithm[role]
        unknown = [key for key in settings if not hasattr(algorithm, key)]
        if unknown:
            raise ValueError(f"trainer.algorithm has no field(s) {unknown}")
        self.workers.set_algorithm_config(role, **settings)
        for key, value in settings.items():
            setattr(algorithm, key, value)
        self._elementwise.forget_configs()
        if role == CRITIC and "value_clip" in settings:
            self._critic_value_clip_on_workers = settings["value_clip"]

    def save_hf_model(self, model_id: str, export_dir: str, merged_dir: str | None = None) -> None:
        """Export the model's current weights as an HF model directory (with the tokenizer).

        A LoRA policy exports its PEFT adapter; ``merged_dir`` then also receives the base model with
        the adapter merged in, which plain transformers loads.
        """
        model = self.get(model_id)
        lora = getattr(self.workers.cfg.trainer, model.role).model.lora.rank > 0
        if merged_dir is not None and not lora:
            raise ValueError(
                f"merged_dir: model {model_id!r} trains all its weights (no LoRA adapter to merge); "
                f"{export_dir} already holds a plain transformers model"
            )
        self.workers.save_hf_model(model.role, export_dir)
        if merged_dir is not None:
            from rllm_skyrl.update.lora_merge import merge_adapter

            merge_adapter(export_dir, merged_dir, base_model=model.base_model)

    def _update_loss_kwargs(self, resolved: ResolvedLoss) -> dict[str, Any]:
        """The loss arguments of a policy update: only those that differ from what the workers hold.

        Given a loss by name, SkyRL's worker looks it up in its registry (a sync with Ray's key-value
        store); given ``loss_fn_config`` it merges that into its AlgorithmConfig with OmegaConf, once
        per micro-batch (bench/README.md: 'A step'). Without them it computes its configured loss, as SkyRL's
        own trainer does.
        """
        algorithm = self._algorithm[POLICY]
        if any(getattr(algorithm, key, _MISSING) != value for key, value in resolved.skyrl_config.items()):
            return resolved.dispatch_kwargs()
        built = resolved.skyrl_loss_name == self._built_policy_loss
        return {} if built else {"loss_fn": resolved.skyrl_loss_name}

    def _padded(self, batch: TrainingInputBatch, role: str) -> tuple[TrainingInputBatch, int]:
        return pad_to_multiple(batch, self.workers.dp_size(role)), real_rows(batch)

    def _policy_output(
        self,
        out,
        resolved: ResolvedLoss,
        batch: TrainingInputBatch,
        n_real: int,
        elementwise_loss: bool = True,
    ):
        logprobs = [out.loss_fn_outputs[i]["logprobs"] for i in range(batch.batch_size)]
        metrics = dict(out.metrics)
        metrics["loss"] = float(metrics["final_loss"] if "final_loss" in metrics else metrics["loss"])
        elementwise = None
        if resolved.loss_fn == "cross_entropy":
            elementwise = [out.loss_fn_outputs[i]["elementwise_loss"] for i in range(n_real)]
        elif elementwise_loss:
            elementwise_BT = self._elementwise.per_token(resolved, batch, logprobs)
            elementwise = None if elementwise_BT is None else elementwise_BT.tolist()
        rows = [{"logprobs": logprobs[i]} for i in range(n_real)]
        if elementwise is not None:
            rows = [{**row, "elementwise_loss": elementwise[i]} for i, row in enumerate(rows)]
        return _tinker_output(out.loss_fn_output_type, rows, metrics, batch)


def _tinker_output(
    output_type: str, rows: list[dict[str, Any]], metrics: dict, batch: TrainingInputBatch
) -> ForwardBackwardOutput:
    lengths = batch["response_mask"][: len(rows)].sum(dim=-1).tolist()
    formatted = [
        {key: tensor_data(last_tokens(values, int(length))) for key, values in row.items()}
        for row, length in zip(rows, lengths, strict=True)
    ]
    return ForwardBackwardOutput(loss_fn_output_type=output_type, loss_fn_outputs=formatted, metrics=metrics)


def _require_fields(batch: TrainingInputBatch, resolved: ResolvedLoss) -> None:
    """Fail before the workers do, naming what the loss reads and how to provide it."""
    if resolved.trains_critic:
        needed, how = _CRITIC_FIELDS, "values (the critic's predictions when sampled) and returns (targets)"
    elif resolved.uses_advantages:
        needed, how = _RL_FIELDS, "advantages and action_log_probs (the sampler's logprobs)"
    else:
        return
    missing = [name for name in needed if name not in batch]
    if missing:
        raise ValueError(
            f"loss_fn {resolved.loss_fn!r} on the {resolved.role} reads batch fields {list(needed)}; "
            f"missing {missing}: add {how}"
        )

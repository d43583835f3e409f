"""``rllm-skyrl``: the command line (``plan`` for clusters; ``train``, ``sft``: rLLM's commands on SkyRL)."""

from __future__ import annotations

from pathlib import Path

from rllm_skyrl import compat
from rllm_skyrl.hardware import Platform
from rllm_skyrl.run.exits import one_line_errors

__all__ = ["main", "patch_sets_summary", "plan", "placement_summary", "sft_command"]


def plan(
    overrides: list[str],
    config_name: str = "unified",
    config_dir: str | None = None,
    here: Platform | None = None,
) -> str:
    """The resolved SkyRL config and the placement a GPU cluster would get, and the patch sets a
    run applies there and, where this machine (``here``, detected by default) differs, here;
    starts nothing.

    The config is checked with SkyRL's own ``validate_cfg`` (on a copy: it edits what it checks),
    so a placement SkyRL would refuse fails here, before any GPU is rented.
    """
    import copy

    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.errors import HydraException
    from skyrl.train.config.config import get_config_as_yaml_str
    from skyrl.train.utils.utils import validate_cfg

    from rllm_skyrl.run_config import ConfigError, resolve_run_config

    init = (
        initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None)
        if config_dir
        else initialize_config_module(config_module="rllm_skyrl.config", version_base=None)
    )
    with init:
        try:
            cfg = compose(config_name, overrides=overrides)
        except HydraException as error:  # an unknown key or group: the user's to fix
            raise ConfigError(str(error).strip().replace("\n", " ")) from None
    cluster = Platform.gpu_cluster()
    run = resolve_run_config(cfg, platform=cluster, resolve_models=False)
    try:
        validate_cfg(copy.deepcopy(run.skyrl))
    except (AssertionError, ValueError) as error:
        raise ConfigError(f"SkyRL rejects this config for a GPU cluster: {error}") from error
    here = here or Platform.detect()
    sets = [patch_sets_summary(cluster, "the GPU cluster this plan is for")]
    if compat.on_platform(here) != compat.on_platform(cluster):
        sets.append(patch_sets_summary(here, "this machine, for a run started here"))
    return "\n\n".join(
        [placement_summary(run), *sets, "# resolved SkyRL config\n" + get_config_as_yaml_str(run.skyrl)]
    )


def patch_sets_summary(platform: Platform, where: str) -> str:
    """The ``compat.PATCH_SETS`` entries a run on ``platform`` applies, name and one line each,
    split by what they change: SkyRL's training code (on CUDA only bug fixes), or the driver
    process and rLLM's entry points (every platform: SkyRL's training code is not touched)."""
    sets = compat.on_platform(platform)
    disabled = compat.disabled()

    def line(patch_set: compat.PatchSet) -> str:
        off = " [turned off: RLLM_SKYRL_COMPAT_DISABLE]" if patch_set.name in disabled else ""
        return f"  {patch_set.name} ({patch_set.purpose}): {patch_set.summary}{off}"

    def on_the_driver(p: compat.PatchSet) -> bool:  # an rLLM bug fix acts on rLLM's driver code too
        return p.purpose in (compat.PROCESS, compat.INTEGRATION) or (
            p.purpose == compat.BUG and set(p.verified) == {"rllm"}
        )

    training = [p for p in sets if not on_the_driver(p)]
    driver = [p for p in sets if on_the_driver(p)]
    kind = "CUDA" if platform.cuda else "CPU"
    training_title = (
        "SkyRL's training code: its stock code but for these bug fixes"
        if platform.cuda
        else "SkyRL's training code, Ray and transformers on CPU: enablement, bug fixes and speed"
    )
    return "\n".join(
        [
            f"# patch sets on {kind}: {where} (compat.PATCH_SETS; README: Patches)",
            f"{training_title}:",
            *map(line, training),
            "the driver process and rLLM's entry points (every platform: its output, logs and "
            "signals, rLLM's AgentTrainer for backend='skyrl', its Tracking and gateway, and rLLM bug "
            "fixes; SkyRL's training code untouched):",
            *map(line, driver),
        ]
    )


def placement_summary(run) -> str:
    from skyrl.backends.skyrl_train.weight_sync import get_transfer_strategy

    placement = run.skyrl.trainer.placement
    engines = run.skyrl.generator.inference_engine
    roles = [
        (role, getattr(placement, f"{role}_num_nodes"), getattr(placement, f"{role}_num_gpus_per_node"))
        for role in run.roles
    ]
    lines = ["# placement"] + [
        f"{role}: {nodes} node(s) x {gpus} GPU(s) = {nodes * gpus} training GPU(s)"
        for role, nodes, gpus in roles
    ]
    urls = run.inference.urls
    if urls:
        inference_gpus = 0
        lines.append(f"inference: {len(urls)} engine(s) at {list(urls)} (their GPUs are not counted here)")
    else:
        per_engine = (
            engines.tensor_parallel_size * engines.pipeline_parallel_size * engines.data_parallel_size
        )
        inference_gpus = engines.num_engines * per_engine
        lines.append(
            f"inference: {engines.num_engines} vLLM engine(s) x {per_engine} GPU(s) = {inference_gpus} "
            "GPU(s), started by the backend"
        )
    training = sum(nodes * gpus for _, nodes, gpus in roles)
    if placement.colocate_all:  # every role and the engines share the same GPUs
        needed = max(nodes * gpus for _, nodes, gpus in roles)
    else:
        ref_shares = placement.colocate_policy_ref and "ref" in run.roles
        ref_gpus = placement.ref_num_nodes * placement.ref_num_gpus_per_node if ref_shares else 0
        needed = training - ref_gpus + inference_gpus
    transfer = get_transfer_strategy(engines.weight_sync_backend, placement.colocate_all)
    lines += [
        f"colocate_all: {placement.colocate_all}  colocate_policy_ref: {placement.colocate_policy_ref}",
        f"weight transfer: {'CUDA IPC' if transfer == 'ipc' else transfer.upper()}",
        "attention: flash_attention_2 where flash-attn is installed, else sdpa "
        "(trainer.flash_attn and remove_microbatch_padding are turned off automatically)",
        f"total training GPUs: {training}",
        f"GPUs needed: {needed}",
    ]
    return "\n".join(lines)


def sft_command():
    """rLLM's ``rllm sft`` command with ``skyrl`` among its ``--backend`` choices, and its default.

    rLLM's flags are a ``click.Choice`` that only its own backends pass; the command here is built
    from rLLM's (same options, same function behind them) with that one choice widened, so every
    flag means what it means to ``rllm sft``. ``--gpus`` is verl's; SkyRL uses every visible GPU.
    """
    import click

    from rllm_skyrl.optional_deps import require
    from rllm_skyrl.rllm_plugin import register

    rllm_sft = require("rllm", "rllm.cli.sft").sft_cmd
    register()
    params = []
    for param in rllm_sft.params:
        if param.name == "backend":
            param = click.Option(
                param.opts,
                default="skyrl",
                type=click.Choice([*param.type.choices, "skyrl"]),
                help="SFT backend (default: skyrl).",
            )
        params.append(param)
    return click.Command("sft", params=params, callback=rllm_sft.callback, help=rllm_sft.help)


def main(argv: list[str] | None = None) -> None:
    """``rllm-skyrl plan [--config-dir DIR] [--config-name NAME] [overrides...]``,
    ``rllm-skyrl train BENCHMARK --agent A --evaluator E [rllm train's flags]``, or
    ``rllm-skyrl sft [DATASET] [rllm sft's options]``."""
    import argparse
    import sys

    from rllm_skyrl import train_command
    from rllm_skyrl.compat.output_masking import mask_process_output

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sft"]:  # rLLM's click command parses its own flags
        mask_process_output()
        compat.apply(["quiet_logs"])
        sft_command().main(args=argv[1:], prog_name="rllm-skyrl sft")
        return
    parser = argparse.ArgumentParser(prog="rllm-skyrl")
    commands = parser.add_subparsers(dest="command", required=True)
    plan_parser = commands.add_parser(
        "plan", help="print the resolved SkyRL config and placement; start nothing"
    )
    plan_parser.add_argument("--config-dir", help="directory of the run config (default: packaged)")
    plan_parser.add_argument("--config-name", default="unified")
    plan_parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model.path=Qwen/Qwen3-8B")
    commands.add_parser("train", help=train_command.SUMMARY, add_help=False)  # listed; parsed below
    commands.add_parser(
        "sft", help="supervised fine-tuning on SkyRL (rllm sft's options; see rllm-skyrl sft --help)"
    )
    if argv[:1] == ["train"]:
        with one_line_errors(always=True):
            train_command.refuse_unsupported(argv[1:])
        args = train_command.build_parser().parse_intermixed_args(argv[1:])
        args.command = "train"
    else:
        args = parser.parse_args(argv)
    mask_process_output()
    compat.apply(["quiet_logs"])  # as in a run: SkyRL's import-time notes (its vLLM patches skipped) stay off
    if args.command == "train":
        with one_line_errors(always=True):
            train_command.train(args)
        return
    with one_line_errors(always=True):
        print(plan(args.overrides, args.config_name, args.config_dir))


if __name__ == "__main__":
    main()

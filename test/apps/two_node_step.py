"""One training step with the policy split over two Ray nodes.

``python test/apps/two_node_step.py SKYRL_OVERRIDES_JSON PAIRS_JSON`` joins the cluster at
``$RAY_ADDRESS``, waits (bounded) until it has two nodes, builds SkyRL's config from the dotted
overrides with ``trainer.placement.policy_num_nodes=2`` (one policy rank per node), runs one
cross-entropy forward_backward and optimizer step on the prompt/response pairs and prints one JSON
line: the node of each rank, the cluster's node count, the loss and the grad norm.
"""

from __future__ import annotations

import json
import sys
import time

import ray
from transformers import AutoTokenizer

from rllm_skyrl.data.adapter import sft_examples_to_batch
from rllm_skyrl.ray_cluster import start_ray
from rllm_skyrl.run_config import make_skyrl_config
from rllm_skyrl.update.workers import SkyRLWorkers


def wait_for_nodes(count: int, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while (alive := sum(node["Alive"] for node in ray.nodes())) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{alive} live Ray node(s) after {timeout:.0f} s; expected {count}")
        time.sleep(0.2)
    return alive


def main(overrides: dict, pairs: list[tuple[str, str]]) -> None:
    cfg = make_skyrl_config({**overrides, "trainer.placement.policy_num_nodes": 2})
    tokenizer = AutoTokenizer.from_pretrained(cfg.trainer.policy.model.path)
    start_ray(cfg)
    nodes = wait_for_nodes(2)
    examples = [
        (tokenizer(p)["input_ids"], tokenizer(r)["input_ids"] + [tokenizer.eos_token_id]) for p, r in pairs
    ]
    batch = sft_examples_to_batch(
        examples, pad_token_id=tokenizer.pad_token_id, dp_size=2, loss_reduction="sum"
    )
    workers = SkyRLWorkers(cfg, tokenizer)
    try:
        loss = workers.forward_backward("policy", batch, loss_fn="cross_entropy").metrics["loss"]
        grad_norm = workers.optim_step("policy")
        report = {"nodes": workers.dispatch.get_node_ids(), "cluster_nodes": nodes, "loss": loss}
        print(json.dumps(report | {"grad_norm": grad_norm}), flush=True)
    finally:
        workers.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), json.loads(sys.argv[2]))

"""Rows that share their context, packed into one row: the same logits and gradients as row by row.

The batches are SkyRL's layout (``[PAD | prompt | response]``, responses right-aligned), built
like a GRPO step: each prompt sampled several times, responses of mixed lengths.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_python

from rllm_skyrl.compat import context_packing
from rllm_skyrl.compat.context_packing import pack, packed_window_logits, pairs_per_token

# attention pairs per token of the tiny model (4 x its hidden size of 64)
PAIRS = 256


def grpo_batch(groups: list[tuple[int, list[int]]], num_actions: int, vocab: int = 250, seed: int = 0):
    """Rows of ``(prompt length, [response lengths of its samples])``, right-aligned in one batch."""
    generator = torch.Generator().manual_seed(seed)
    prompt_width = max(prompt for prompt, _ in groups)
    total = prompt_width + num_actions
    rows, masks = [], []
    for prompt_length, responses in groups:
        prompt = torch.randint(3, vocab, (prompt_length,), generator=generator)
        for response_length in responses:
            row = torch.zeros(total, dtype=torch.long)
            mask = torch.zeros(total, dtype=torch.long)
            tokens = torch.cat([prompt, torch.randint(3, vocab, (response_length,), generator=generator)])
            row[total - len(tokens) :], mask[total - len(tokens) :] = tokens, 1
            rows.append(row)
            masks.append(mask)
    sequences, attention_mask = torch.stack(rows), torch.stack(masks)
    positions = attention_mask.cumsum(-1) - 1
    positions.masked_fill_(attention_mask == 0, 1)
    return sequences, attention_mask, positions


# three prompts x four samples; the second prompt's samples have two response lengths
GROUPS = [(9, [3, 3, 3, 3]), (6, [3, 3, 1, 1]), (4, [3, 3, 3, 3])]


def test_rows_that_share_a_context_go_into_one_packed_row_each_token_where_it_was():
    sequences, mask, positions = grpo_batch(GROUPS, num_actions=3)
    width = 4
    packed = pack(sequences, mask, positions, width, PAIRS)
    # contexts: prompt 1; prompt 2 before a 3-token and before a 1-token response; prompt 3
    assert packed.ids.shape[0] == 4
    for row in range(len(sequences)):
        where = packed.row[row], packed.columns[row]
        assert torch.equal(packed.ids[where], sequences[row, -width:])
        assert torch.equal(packed.positions[where], positions[row, -width:])
        # the window sees its context (the row's real tokens before the window) and itself
        query = packed.columns[row, -1]
        seen = packed.ids[packed.row[row]][packed.mask[packed.row[row], 0, query]]
        own = sequences[row][mask[row].bool()]
        assert torch.equal(seen, own)


def test_a_context_with_more_windows_than_pay_is_repeated_over_several_packed_rows():
    """A packed row's attention grows with the square of its length: past about
    sqrt(c^2 + pairs c) / w windows, another copy of the context costs less."""
    sequences, mask, positions = grpo_batch([(9, [3] * 32), (4, [3] * 32)], num_actions=3)
    packed = pack(sequences, mask, positions, 4, pairs=64)
    # a window starts at its prompt's last token: contexts of 8 and 3 tokens; 6 and 4 windows pay
    assert packed.ids.shape == (6 + 8, 8 + 6 * 4)
    assert sorted(torch.bincount(packed.row).tolist()) == [2] + [4] * 8 + [6] * 5


def test_a_packed_row_stays_under_its_length_cap(monkeypatch):
    sequences, mask, positions = grpo_batch([(9, [3] * 8), (4, [3] * 8)], num_actions=3)
    monkeypatch.setattr(context_packing, "MAX_PACKED_LENGTH", 21)
    packed = pack(sequences, mask, positions, 4, PAIRS)
    # contexts of 8 and 3 tokens, then 3 and 4 windows of 4
    assert packed.ids.shape == (5, 8 + 3 * 4)
    assert sorted(torch.bincount(packed.row).tolist()) == [2, 3, 3, 4, 4]


@pytest.mark.parametrize(("window", "packed"), [(65, True), (129, False)])
def test_packing_is_chosen_where_it_was_measured_to_pay(window, packed):
    """SmolLM2-135M (4 x 576 pairs per token), a 34-token context and 8 samples: estimated 0.80 of
    the rows' cost with 64-token responses (measured 0.86) and 0.94 with 128-token ones (measured
    0.99): the first is packed 4 windows to a row, the second left alone."""
    batch = grpo_batch([(35, [window - 1] * 8)], num_actions=window - 1)
    plan = pack(*batch, window, pairs=4 * 576)
    assert (plan is not None) == packed
    if packed:
        assert plan.ids.shape == (2, 34 + 4 * window)


@pytest.mark.parametrize(
    "case",
    ["distinct contexts", "padding in a window", "a single row"],
)
def test_batches_where_packing_does_not_pay_or_apply_are_left_alone(case):
    if case == "distinct contexts":
        batch = grpo_batch([(9, [3]), (6, [3]), (4, [3])], num_actions=3)
    elif case == "padding in a window":  # a 2-token row under a 4-token window
        batch = grpo_batch([(1, [1, 1, 1, 1]), (4, [3, 3, 3, 3])], num_actions=3)
    else:
        batch = grpo_batch([(9, [3])], num_actions=3)
    assert pack(*batch, 4, PAIRS) is None


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )


def test_packed_logits_and_gradients_equal_the_row_by_row_ones(model):
    sequences, mask, positions = grpo_batch(GROUPS, num_actions=3, vocab=model.config.vocab_size)
    weights = torch.randn(
        len(sequences), 4, model.config.vocab_size, generator=torch.Generator().manual_seed(1)
    )

    def run(forward):
        model.zero_grad(set_to_none=True)
        logits = forward()
        (logits.log_softmax(-1) * weights).sum().backward()
        return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    plain, plain_grads = run(
        lambda: model(sequences, attention_mask=mask, position_ids=positions, logits_to_keep=4).logits
    )
    packed, packed_grads = run(lambda: packed_window_logits(model, sequences, mask, positions, 4, PAIRS)[0])
    assert packed.shape == plain.shape
    assert (packed - plain).abs().max() < 1e-5
    for name, grad in plain_grads.items():
        assert (packed_grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max() + 1e-7, name


def test_only_full_sdpa_attention_is_packed(tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    def model_with(**changes):
        config = AutoConfig.from_pretrained(tiny_model_dir, **changes)
        return AutoModelForCausalLM.from_config(config)

    assert pairs_per_token(model_with(attn_implementation="sdpa")) == PAIRS
    assert (
        pairs_per_token(model_with(attn_implementation="eager")) is None
    )  # its mask is added, not a boolean
    sliding = model_with(attn_implementation="sdpa", layer_types=["sliding_attention", "full_attention"])
    assert pairs_per_token(sliding) is None


FSDP_TWO_RANKS = """
    import json, os, sys, tempfile, torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, sys.argv[2])
    from test_context_packing import GROUPS, PAIRS, grpo_batch
    from rllm_skyrl.compat.context_packing import packed_window_logits

    def rank_main(rank, model_dir, rendezvous, out):
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (2,))
        sequences, mask, positions = grpo_batch(GROUPS, num_actions=3, seed=rank)
        grads = []
        for packed in (False, True):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                         attn_implementation="sdpa")
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=True)
            fully_shard(model, mesh=mesh, reshard_after_forward=True)
            for _ in range(2):  # two steps: gradients accumulate over steps as over windows
                if packed:
                    logits = packed_window_logits(model, sequences, mask, positions, 4, PAIRS)[0]
                else:
                    logits = model(sequences, attention_mask=mask, position_ids=positions,
                                   logits_to_keep=4).logits
                logits.log_softmax(-1)[..., 7].sum().backward()
            grads.append([p.grad.full_tensor() for p in model.parameters()])
        gap = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(*grads))
        if rank == 0:
            json.dump({"gap": gap}, open(out, "w"))
        dist.destroy_process_group()

    if __name__ == "__main__":
        out = tempfile.mktemp()
        mp.start_processes(rank_main, args=(sys.argv[1], tempfile.mktemp(), out), nprocs=2,
                           start_method="fork")
        print(open(out).read())
"""


@pytest.mark.slow
def test_fsdp_over_two_ranks_gets_the_row_by_row_gradients_from_packed_rows(tiny_model_dir):
    """One forward and one backward per layer: FSDP re-shards after each, and the gradients of
    both ranks' packed batches reduce to those of their row-by-row batches."""
    from pathlib import Path

    outcome = run_python(FSDP_TWO_RANKS, tiny_model_dir, str(Path(__file__).parent))
    assert outcome["gap"] < 1e-5

"""rLLM's messages rows as SkyRL's pretokenized SFT rows: rLLM's three masking rules, parquet rows
(numpy arrays), and bad rows refused naming the row before anything starts."""

from __future__ import annotations

import pandas as pd
import pytest
from rllm_harness import RLLM_MISSING

pytest.importorskip("rllm", reason=RLLM_MISSING)  # rLLM's SFT types are the subject

from rllm.parser import ChatTemplateParser  # noqa: E402
from rllm.trainer.sft.backend import SFTConfigError  # noqa: E402

from rllm_skyrl.sft.data import check_rows, tokens_and_mask, write_pretokenized  # noqa: E402

TWO_TURNS = [
    {"role": "user", "content": "what is 1?"},
    {"role": "assistant", "content": "1"},
    {"role": "user", "content": "what is 2?"},
    {"role": "assistant", "content": "2"},
]


def trained_text(tokenizer, method: str) -> str:
    parser = ChatTemplateParser.get_parser(tokenizer)
    ids, mask = tokens_and_mask(TWO_TURNS, tokenizer, method, parser)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    return tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])


def test_masking_rules_are_rllms(tiny_tokenizer):
    answer = "<|im_start|>assistant\n{}<|im_end|>\n"
    assert trained_text(tiny_tokenizer, "cumulative") == answer.format(1) + answer.format(2)
    assert trained_text(tiny_tokenizer, "stepwise") == answer.format(2)
    assert trained_text(tiny_tokenizer, "hf_template") == answer.format(1) + answer.format(2)
    # hf_template is the tokenizer's own rendering, token for token (what an RL server prompts with).
    ids, _ = tokens_and_mask(TWO_TURNS, tiny_tokenizer, "hf_template")
    assert tiny_tokenizer.decode(ids) == tiny_tokenizer.apply_chat_template(TWO_TURNS, tokenize=False)


def test_parquet_rows_come_back_as_numpy_and_train(tmp_path, tiny_tokenizer):
    source = tmp_path / "rows.parquet"
    pd.DataFrame({"messages": [TWO_TURNS, TWO_TURNS[:2]]}).to_parquet(source)
    rows = pd.read_parquet(source).to_dict("records")
    assert type(rows[0]["messages"]).__name__ == "ndarray"
    assert check_rows(rows, "train") == 2
    written = write_pretokenized(rows, tiny_tokenizer, "stepwise", None, tmp_path / "out.parquet", "train")
    stored = pd.read_parquet(written.path)
    assert written.rows == 2 and list(stored.columns) == ["input_ids", "loss_mask"]
    assert written.loss_tokens == sum(int(mask.sum()) for mask in stored["loss_mask"])


def test_max_length_drops_rows_left_without_a_trained_token(tmp_path, tiny_tokenizer):
    long = [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "1"}]
    written = write_pretokenized(
        [{"messages": long}, {"messages": TWO_TURNS[:2]}],
        tiny_tokenizer,
        "hf_template",
        24,
        tmp_path / "t.parquet",
        "train",
    )
    assert (written.rows, written.dropped) == (1, 1)
    with pytest.raises(SFTConfigError, match="no row keeps an assistant token within max_length=24"):
        write_pretokenized(
            [{"messages": long}], tiny_tokenizer, "hf_template", 24, tmp_path / "u.parquet", "train"
        )


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "x"}, "train row 1: 'messages' must be a non-empty list"),
        ({"messages": []}, "train row 1: 'messages' must be a non-empty list"),
        ({"messages": [{"content": "x"}]}, "train row 1, message 0: needs a string 'role'"),
        ({"messages": [{"role": "user", "content": 3}]}, "train row 1, message 0: 'content' must be text"),
        ({"messages": [{"role": "user", "content": "x"}]}, "train row 1: no assistant message"),
    ],
)
def test_bad_rows_are_named(row, message):
    with pytest.raises(SFTConfigError, match=message):
        check_rows([{"messages": TWO_TURNS}, row], "train")


def test_an_empty_split_is_refused():
    with pytest.raises(SFTConfigError, match="val dataset is empty"):
        check_rows([], "val")

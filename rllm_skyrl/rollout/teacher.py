"""A distillation teacher checked against the student before a run starts.

rLLM's ``DistillationWorkflow`` with ``shared_tokenizer=True`` sends the student's token ids to the
teacher as they are: a teacher with another vocabulary would score other tokens, and the run would
train on noise without an error. With ``shared_tokenizer=False`` rLLM re-renders the text with the
teacher's tokenizer and chat parser and aligns its logprobs to the student's tokens by bytes, so any
pair of tokenizers works there. The workflow reads ``teacher_engine.tokenizer`` and ``.chat_parser``
on every rollout, and rLLM's ``OpenAIEngine`` parses every teacher answer with its chat parser: a
teacher engine without a tokenizer, or with rLLM's generic parser, fails only once rollouts run.
"""

from __future__ import annotations

from typing import Any

from rllm_skyrl.errors import UserFacingError


def check_teacher(workflow_args: dict[str, Any], student_tokenizer: Any) -> None:
    """Raise a one-line ``UserFacingError`` if ``workflow_args``' teacher cannot score the student."""
    teacher = workflow_args.get("teacher_engine")
    if teacher is None:
        return
    teacher_tokenizer = getattr(teacher, "tokenizer", None)
    if teacher_tokenizer is None:
        raise UserFacingError(
            f"workflow_args.teacher_engine ({type(teacher).__name__}) has no tokenizer; the distillation "
            "workflow needs it: build the engine with the teacher's tokenizer (OpenAIEngine(tokenizer=...))"
        )
    parser = getattr(teacher, "chat_parser", None)
    if parser is not None and not _parses_completions(parser):
        raise UserFacingError(
            f"workflow_args.teacher_engine's chat parser ({type(parser).__name__}) cannot parse "
            "completions, which rLLM's OpenAIEngine does on every teacher call; pass the engine a parser "
            "that can (chat_parser=..., e.g. rLLM's QwenChatTemplateParser for a ChatML template)"
        )
    if (
        workflow_args.get("shared_tokenizer")
        and teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab()
    ):
        raise UserFacingError(
            f"workflow_args.shared_tokenizer=True, but the teacher's tokenizer "
            f"({_name(teacher_tokenizer)}) is not the student's ({_name(student_tokenizer)}): the teacher "
            "would score other tokens; set shared_tokenizer=False (rLLM aligns the two by text) or serve a "
            "teacher with the student's tokenizer"
        )


def _parses_completions(parser: Any) -> bool:
    """rLLM's generic ``ChatTemplateParser`` (what it picks for a template it does not know) raises
    in ``parse_completion``; its model-specific subclasses implement it."""
    from rllm.parser import ChatTemplateParser

    own = getattr(type(parser), "parse_completion", None)
    return own is not None and own is not ChatTemplateParser.parse_completion


def _name(tokenizer: Any) -> str:
    return f"{getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)}, {len(tokenizer)} tokens"

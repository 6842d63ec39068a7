"""The GRPO demo's pieces, and a 2-step run of it (the full 50-step run takes minutes)."""

import os
import sys

import pytest

from examples import grpo

sys.path.insert(0, os.path.dirname(__file__))
from grpo_helpers import EOS_ID, make_tokenizer  # noqa: E402


def test_word_piece_reward_counts_distinct_word_pieces():
    tok = make_tokenizer()
    ids = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    word, other = ids("cat")[0], tok.convert_tokens_to_ids("[UNK]")
    rewards = grpo.word_piece_reward(
        None,
        [ids("cat dog fish") + [EOS_ID], [word] * 4, [word, other], [EOS_ID], []],
        tokenizer=tok,
    )
    # all word pieces (eos not counted); one word repeated; half; nothing generated; empty
    assert rewards == [1.0, 0.25, 0.5, 0.0, 0.0]


def test_word_piece_pattern():
    for piece in [" the", "ing", " Python"]:
        assert grpo.WORD_PIECE.fullmatch(piece)
    for piece in ["  the", "3", " x2", "的", ".", " "]:
        assert not grpo.WORD_PIECE.fullmatch(piece)


def test_args_defaults_and_validation():
    args = grpo.parse_args([])
    assert (args.steps, args.num_generations, args.num_prompts, args.beta) == (50, 8, 4, 0.04)
    with pytest.raises(SystemExit):
        grpo.parse_args(["--num-generations", "1"])


def test_demo_runs_two_steps(tmp_path):
    plot = tmp_path / "reward.png"
    status = grpo.main([
        "--steps", "2", "--num-generations", "2", "--prompts-per-step", "1", "--num-prompts", "1",
        "--max-completion-length", "4", "--prompt-tokens", "8", "--plot", str(plot),
    ])
    assert status in (0, 1)  # two steps say nothing about learning; the run and the plot must work
    assert plot.stat().st_size > 0

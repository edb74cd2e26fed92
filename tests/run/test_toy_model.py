"""The examples' toy tokenizer (microrl/run/toy_model.py): a real fast tokenizer that round-trips
and saves, with the padding side and special tokens the rollouts rely on."""

from __future__ import annotations

from pathlib import Path

from microrl.run.toy_model import build_tokenizer


def test_tokenizer_is_a_real_fast_tokenizer_that_round_trips(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = build_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast)
    ids = tok("12+7=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 6
    assert (
        tok.decode(
            tok("19", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
            skip_special_tokens=True,
        )
        == "19"
    )
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded("12+7=")["input_ids"] == ids
    assert loaded.padding_side == "left" and loaded.pad_token_id == tok.pad_token_id

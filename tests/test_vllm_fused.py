"""Targets the checkpoint already stores fused (Phi-3's ``qkv_proj`` / ``gate_up_proj``, Falcon's
``query_key_value``) against a real vLLM engine: vLLM splits them into blocks of its own (Falcon's
loader also permutes rows per head), so the sync sends them whole and everything else as factors."""

from __future__ import annotations

import warnings

import pytest
import torch

from logra_optim import LoGRAOptimizer, patch_model
from tests.helpers import trl_setup
from tests.helpers.vllm_helpers import build_engine, engine_logprobs, max_difference, train_step, trainer_logprobs

pytest.importorskip("vllm")

COMMON = dict(vocab_size=trl_setup.VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=2)


def phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        **COMMON,
        intermediate_size=128,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=trl_setup.SPECIAL["<pad>"],
        eos_token_id=trl_setup.SPECIAL["<eos>"],
        bos_token_id=trl_setup.SPECIAL["<bos>"],
    )
    return Phi3ForCausalLM(config), {"qkv_proj", "gate_up_proj"}


def falcon():
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        **COMMON,
        new_decoder_architecture=True,
        num_kv_heads=1,
        bias=False,
        alibi=False,
        parallel_attn=True,
        max_position_embeddings=64,
        pad_token_id=trl_setup.SPECIAL["<pad>"],
        eos_token_id=trl_setup.SPECIAL["<eos>"],
        bos_token_id=trl_setup.SPECIAL["<bos>"],
    )
    return FalconForCausalLM(config), {"query_key_value"}


@pytest.mark.parametrize("family", [phi3, falcon], ids=["phi3", "falcon"])
def test_checkpoint_fused_targets_are_synced_whole_and_the_rest_compressed(family, tmp_path):
    from logra_optim.integrations.vllm import VLLMSync

    torch.manual_seed(0)
    model, fused = family()
    model.save_pretrained(tmp_path)
    trl_setup.build_tokenizer().save_pretrained(tmp_path)
    llm = build_engine(str(tmp_path))
    try:
        patch_model(model)
        opt = LoGRAOptimizer(model, rank=8, update_ratio=2e-2)
        sync = VLLMSync(opt, llm)
        with pytest.warns(RuntimeWarning, match="sent whole at every sync"):
            sync.sync()
        whole = {name.rsplit(".", 2)[-2] for name in sync.sent_whole}
        assert whole == fused
        generator = torch.Generator().manual_seed(0)
        before = trainer_logprobs(model)
        for _ in range(3):
            train_step(model, opt, generator)
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # no drift, no fallback
                stats = sync.sync()
            assert stats["kind"] == "compressed"
            assert max_difference(engine_logprobs(llm), trainer_logprobs(model)) < 1e-4
        assert max_difference(before, trainer_logprobs(model)) > 1e-3  # the updates moved the policy
        assert sync.drift()["drift"] < 1e-5
    finally:
        del llm

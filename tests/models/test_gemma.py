"""Gemma 2 and Gemma 3 specifics, beyond the greedy oracle (tests/e2e/test_oracle.py).

The final logit soft cap never changes an argmax (tanh is monotone), so it is checked
through log-probabilities; the attention soft cap and the local/global layout through what
the model builds from its config.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from vlite import LLM, SamplingParams
from vlite.testing.tiny_models import make_tiny_model

PROMPT = [5, 77, 123, 9, 250, 31, 64, 200, 18, 42, 99, 7, 150, 3, 88]  # past the 12-token window


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gemma2"), "Gemma2ForCausalLM")


def test_logprobs_follow_the_final_soft_cap(gemma2):
    model = AutoModelForCausalLM.from_pretrained(gemma2, dtype=torch.float32)
    with torch.no_grad():
        hf_logits = model(torch.tensor([PROMPT])).logits[0, -1]
    hf_logprobs = torch.log_softmax(hf_logits.float(), -1)
    assert hf_logits.abs().max() < 2.0  # capped at final_logit_softcapping=2.0
    llm = LLM(model=str(gemma2))
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    output = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    top = output.logprobs[0]
    assert len(top) >= 5
    for token_id, entry in top.items():
        assert entry.logprob == pytest.approx(hf_logprobs[token_id].item(), abs=1e-4)


def test_layers_take_their_window_cap_scale_and_rope_from_the_config(gemma2, tmp_path):
    llm = LLM(model=str(gemma2))
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    attns = [layer.self_attn for layer in model.model.layers]
    assert [a.sliding_window for a in attns] == [12, None]
    assert [a.logits_soft_cap for a in attns] == [1.0, 1.0]
    assert model.attention.scale == pytest.approx(24**-0.5)  # query_pre_attn_scalar
    assert model.local_rotary_emb is model.rotary_emb  # Gemma 2: one RoPE table

    gemma3 = make_tiny_model(tmp_path / "g3", "Gemma3ForCausalLM")
    model3 = LLM(model=str(gemma3)).llm_engine.engine_core.executor.worker.model_runner.model
    assert model3.local_rotary_emb is not model3.rotary_emb  # local base, global scaled
    assert [a.logits_soft_cap for a in (x.self_attn for x in model3.model.layers)] == [None] * 2
    assert model3.model.layers[0].self_attn.has_gemma_qk_norm


def test_a_backend_without_soft_capping_is_refused(gemma2, monkeypatch):
    from vlite.plugins.attention.torch_ref import TorchAttentionBackend

    monkeypatch.setattr(TorchAttentionBackend, "supports_logits_soft_cap", False)
    with pytest.raises(ValueError, match="caps attention scores at 1.0"):
        LLM(model=str(gemma2), attention_backend="torch")


def test_tensor_parallel_sizes_the_heads_do_not_divide_are_refused(gemma2):
    from vlite.models.gemma import GemmaForCausalLM
    from vlite.models.loader import load_hf_config

    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        GemmaForCausalLM.check_tensor_parallel_size(load_hf_config(gemma2), 3)

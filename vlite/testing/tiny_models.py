"""Tiny random-weight Hugging Face models with a real offline tokenizer, for tests.

:func:`make_tiny_model` writes a folder that both ``transformers`` and vlite can load:
``config.json``, ``model.safetensors`` and a byte-level BPE tokenizer trained on a fixed
built-in text. Everything is deterministic for a given seed and takes well under a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vlite.core.plugins import PluginRegistry, build_plugin_manager

#: The architectures vlite runs itself (the oracle's list): the models its built-in plugins
#: register. The tiny-model helpers take any architecture ``transformers`` has a config class
#: for, so a model plugin can test on one.
ARCHITECTURES: tuple[str, ...] = tuple(
    PluginRegistry(build_plugin_manager(load_entry_points=False)).names("model")
)

#: Config classes whose name is not the architecture's with ``Config`` for ``ForCausalLM``.
_CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
TOKENIZER_VOCAB_SIZE = 320

#: A simple chat template so chat code paths can be exercised with tiny models.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. Once upon a time there was a small town by the sea, where the people told
stories about the weather, the boats and the fish they caught in the morning. The children
went to school, the teachers wrote on the board, and everyone had lunch at noon.
Hello, world! How are you today? I am fine, thank you. What is your name? My name is Ada.
Tell me a joke. Why did the chicken cross the road? To get to the other side.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Colours: red, green, blue, yellow, black, white.
The engine schedules requests, computes attention over the cache and samples the next token.
Language models predict the next word given the words that came before it.
"""

_CONFIG_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.2,
    "hidden_act": "silu",
}


def make_tiny_tokenizer() -> Any:
    """Train a deterministic byte-level BPE (vocab ~320) and wrap it for ``transformers``.

    Encoding prepends the BOS token, as Llama tokenizers do.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT.splitlines(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_config(
    architecture: str, *, vocab_size: int, num_kv_heads: int, tie_word_embeddings: bool, **kw
) -> Any:
    """A small ``transformers`` config for ``architecture``; ``kw`` overrides any field."""
    import transformers

    config_name = _CONFIG_CLASSES.get(architecture, architecture.replace("ForCausalLM", "Config"))
    config_cls = getattr(transformers, config_name, None)
    if config_cls is None:
        raise ValueError(
            f"transformers has no {config_name} for architecture {architecture!r}: a tiny "
            f"model can be made of any architecture transformers knows (the built-in ones: "
            f"{', '.join(ARCHITECTURES)})"
        )
    fields = dict(_CONFIG_DEFAULTS)
    if architecture == "Qwen3ForCausalLM":
        fields["head_dim"] = 32  # deliberately != hidden_size // num_attention_heads
    if architecture == "MistralForCausalLM":
        fields["sliding_window"] = None
    if architecture == "SmolLM3ForCausalLM":
        fields["no_rope_layer_interval"] = 2  # the second of two layers has no RoPE
        fields.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # the tiny tokenizer's
    if architecture == "MixtralForCausalLM":
        # 4 experts of 2 per token; the intermediate width is one expert's.
        fields.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if architecture == "Qwen2MoeForCausalLM":
        # Layer 0 sparse with a shared expert, layer 1 dense (mlp_only_layers).
        fields.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        )
    if architecture == "Qwen3MoeForCausalLM":
        fields.update(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
        )
        fields["head_dim"] = 32
    if architecture == "OlmoeForCausalLM":
        fields.update(num_experts=4, num_experts_per_tok=2, clip_qkv=2.0)
        fields.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if architecture == "Phi3ForCausalLM":
        fields["partial_rotary_factor"] = 0.5  # as Phi-4-mini: half of each head rotates
        fields.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        # Windows far shorter than the tests' prompts, local layer then global layer, a
        # query scale != head_dim, caps that bite on tiny random scores (Gemma 2); smaller
        # weights, since the embedding scale (sqrt(hidden)) otherwise makes every layer
        # repeat the last token.
        fields.update(
            initializer_range=0.05,
            head_dim=16 if architecture == "Gemma2ForCausalLM" else 32,
            query_pre_attn_scalar=24,
            sliding_window=12,
            layer_types=["sliding_attention", "full_attention"],
            hidden_activation="gelu_pytorch_tanh",
        )
    if architecture == "Gemma2ForCausalLM":
        fields.update(attn_logit_softcapping=1.0, final_logit_softcapping=2.0)
    if architecture == "Gemma3ForCausalLM":
        fields["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        }
    fields.update(
        vocab_size=vocab_size,
        num_key_value_heads=num_kv_heads,
        tie_word_embeddings=tie_word_embeddings,
        architectures=[architecture],
        dtype="float32",
    )
    fields.update(kw)
    return config_cls(**fields)


def _randomise_norms_and_biases(model: torch.nn.Module, generator: torch.Generator) -> None:
    """HF initialises norm weights to 1 and biases to 0; perturb them so a loader that
    drops or misplaces them is caught by a logits comparison."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))


def make_tiny_model(
    path: Path,
    architecture: str,
    *,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a random-initialised tiny ``architecture`` model and its tokenizer to ``path``.

    Defaults: hidden 64, 2 layers, 4 attention heads, ``num_kv_heads`` KV heads (pass 4
    for multi-head attention), intermediate 128, 512 positions, float32, vocab matching
    the tokenizer (~320). Qwen3 gets ``head_dim=32``. ``overrides`` are config fields.

    Returns:
        ``path``, now holding ``config.json``, ``model.safetensors`` and tokenizer files.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer()
    config = make_tiny_config(
        architecture,
        vocab_size=len(tokenizer),
        num_kv_heads=num_kv_heads,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )
    generator = torch.Generator().manual_seed(seed)
    previous_rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(previous_rng)
    _randomise_norms_and_biases(model, generator)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

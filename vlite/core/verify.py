"""The configuration phase: every refusal of a configuration, before the executor is built.

:func:`verify_config` runs first in ``EngineCore.__init__``, before the executor (and so any
worker, process or Ray actor) exists. It checks, in order:

- the plugin names (scheduler, executor, sampler, attention backend, structured-output
  backend) are registered, and the model's architecture is;
- prefix caching against the model (LongRoPE: turned off by default, refused when set);
- the model split: ``tensor_parallel_size``, ``pipeline_parallel_size`` and
  ``pp_layer_partition`` against the model class and its layers and heads
  (:mod:`vlite.core.model_split`);
- the attention backend: ``auto`` resolved for ``config.torch_device`` and the dtype, the
  backend available there and within its dtype, head-dim and block-size limits
  (:mod:`vlite.core.attention_selection`), and the KV cache's dtype (``auto`` resolved,
  another than the model's only where the backend takes it);
- the plugins' capabilities: prefix caching and chunked prefill (scheduler and backend),
  sliding windows and an attention soft cap (backend);
- the quantization plan (``config.quantization`` for this model and device);
- speculative decoding: the proposer is registered, and the configuration lets each
  step's drafts be verified before the next step is scheduled (one pipeline stage, no
  async scheduling); a draft model (``model_spec.draft``) is a registered architecture
  sharing the model's tokenizer and reaching its context length.

Each refusal is a :class:`~vlite.core.errors.ConfigError` naming the setting, its value and
what is allowed. What it resolved comes back as a :class:`VerifiedConfig`, which the later
stages use instead of deciding again: the executor gets ``VerifiedConfig.config``, whose
``attention_backend`` already names the registered backend ``auto`` chose.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from vlite.core.attention_selection import (
    dtype_name,
    limits_violation,
    resolve_attention_backend,
    resolve_kv_cache_dtype,
)
from vlite.core.config import VliteConfig
from vlite.core.errors import ConfigError
from vlite.core.model import ModelDescription
from vlite.core.model_split import check_model_split
from vlite.core.plugins import PluginRegistry
from vlite.core.proposer import DRAFT_MODEL
from vlite.core.scheduler import SchedulerLimits, resolve_limits
from vlite.core.weight_format import registered_weight_formats

#: The configuration's plugin settings: (registry kind, ``VliteConfig`` field).
PLUGIN_SETTINGS = (
    ("scheduler", "scheduler"),
    ("executor", "executor"),
    ("sampler", "sampler"),
    ("attention_backend", "attention_backend"),
    ("structured_output_backend", "structured_outputs_backend"),
)


@dataclass(frozen=True)
class VerifiedConfig:
    """A configuration that passed every check, with what the checks resolved.

    Attributes:
        config: the configuration to build with: ``attention_backend`` is the registered
            backend ``auto`` resolved to, ``kv_cache_dtype`` the dtype ``auto`` resolved to,
            and ``enable_prefix_caching`` is off where the model's cached blocks cannot be
            shared.
        plugins: registry kind -> the class the configuration names (every kind of
            :data:`PLUGIN_SETTINGS`, the attention backend the resolved one).
        limits: the scheduler's limits, ``enable_chunked_prefill`` resolved to a bool.
        quantization: which weights stay quantized, in which weight format (the model's
            ``quantization_plan``).
    """

    config: VliteConfig
    plugins: dict[str, type]
    limits: SchedulerLimits
    quantization: Any

    @property
    def attention_backend(self) -> str:
        """The registered name of the attention backend in use (never ``auto``)."""
        return self.config.attention_backend


def verify_config(
    config: VliteConfig, model_spec: ModelDescription, registry: PluginRegistry
) -> VerifiedConfig:
    """Check ``config`` for ``model_spec`` with ``registry``'s plugins (module docstring).

    Raises:
        ConfigError: the first check that fails; nothing has been started.
    """
    plugins = {kind: registry.get(kind, getattr(config, field)) for kind, field in PLUGIN_SETTINGS}
    check_architecture(registry, model_spec.architecture)
    config = without_conflicting_prefix_caching(config, model_spec)
    model_cls = registry.get("model", model_spec.architecture)
    check_model_split(config, model_cls, model_spec.hf_config, model_spec.architecture)
    limits = scheduler_limits(config, plugins["scheduler"], model_spec)
    name, attention_cls = resolve_attention(config, model_spec, registry)
    plugins["attention_backend"] = attention_cls
    kv_cache_dtype = resolve_kv_cache(config, model_spec, attention_cls, name)
    check_prefix_caching(config, limits, plugins["scheduler"], attention_cls, name)
    check_layer_features(
        tuple(model_spec.sliding_windows),
        model_spec.attention_logit_soft_cap,
        attention_cls,
        name,
    )
    formats = registered_weight_formats(registry, config)
    quantization = model_spec.quantization_plan(config.quantization, config.torch_device, formats)
    if config.speculative_config is not None:
        plugins["proposer"] = check_speculative_decoding(config, registry)
        check_draft_model(model_spec, registry)
    resolved = config.model_copy(
        update={"attention_backend": name, "kv_cache_dtype": kv_cache_dtype}
    )
    return VerifiedConfig(resolved, plugins, limits, quantization)


def check_speculative_decoding(config: VliteConfig, registry: PluginRegistry) -> type:
    """The proposer class ``speculative_config.method`` names, where the configuration lets
    drafts be verified. (With async scheduling's two batches in flight, a request that may
    speculate is in one at a time, so its drafts follow known tokens.)"""
    method = config.speculative_config.method
    if method not in registry.names("proposer"):
        raise ConfigError(
            f"speculative_config.method={method!r} is not a registered proposer; registered: "
            f"{', '.join(registry.names('proposer'))} (a plugin adds one with register_proposers)"
        )
    if config.pipeline_parallel_size > 1:
        raise ConfigError(
            f"speculative_config with pipeline_parallel_size={config.pipeline_parallel_size}: "
            "the stages before the last learn a step's tokens from the next step's, which "
            "does not carry the drafts they accepted; allowed: pipeline_parallel_size=1"
        )
    return registry.get("proposer", method)


def check_draft_model(model_spec: ModelDescription, registry: PluginRegistry) -> None:
    """A draft model (``model_spec.draft``) must speak the target's vocabulary, reach its
    context length and be a registered architecture: its drafts are the target's token
    ids."""
    draft = getattr(model_spec, "draft", None)
    if draft is None:
        return
    check_architecture(registry, draft.architecture)
    if draft.vocab_size != model_spec.vocab_size:
        raise ConfigError(
            f"speculative_config.model has a vocabulary of {draft.vocab_size} tokens, the "
            f"model one of {model_spec.vocab_size}; allowed: a draft model sharing the "
            "model's tokenizer"
        )
    draft_vocab, vocab = draft.load_tokenizer().get_vocab(), model_spec.load_tokenizer().get_vocab()
    if draft_vocab != vocab:
        differing = sorted(set(draft_vocab.items()) ^ set(vocab.items()))[:3]
        raise ConfigError(
            f"speculative_config.model's tokenizer differs from the model's (e.g. "
            f"{differing}); allowed: a draft model sharing the model's tokenizer"
        )
    if draft.max_model_len < model_spec.max_model_len:
        raise ConfigError(
            f"speculative_config.model reaches {draft.max_model_len} tokens, fewer than "
            f"max_model_len={model_spec.max_model_len}; allowed: max_model_len <= "
            f"{draft.max_model_len}"
        )


def check_architecture(registry: PluginRegistry, architecture: str) -> None:
    """Refuse a model no plugin implements."""
    supported = registry.names("model")
    if architecture not in supported:
        raise ConfigError(
            f"model architecture {architecture!r} (config.json 'architectures') is not "
            f"supported; supported: {', '.join(supported)}. A plugin can add it with the "
            "register_models hook (see docs/models.md)"
        )


def without_conflicting_prefix_caching(
    config: VliteConfig, model_spec: ModelDescription
) -> VliteConfig:
    """``config``, with prefix caching off when the model's cached blocks cannot be shared.

    Refused when the caller set ``enable_prefix_caching=True`` explicitly; the default is
    turned off with a warning naming why.
    """
    conflict = model_spec.prefix_caching_conflict
    if conflict is None or not config.enable_prefix_caching:
        return config
    if "enable_prefix_caching" in config.model_fields_set:
        raise ConfigError(
            f"enable_prefix_caching=True cannot be exact for this model: {conflict}; turn it "
            "off (--no-prefix-caching)"
        )
    # stacklevel: past this function, verify_config and EngineCore.__init__ to its caller.
    warnings.warn(f"prefix caching is off for this model: {conflict}", stacklevel=4)
    return config.model_copy(update={"enable_prefix_caching": False})


def scheduler_limits(
    config: VliteConfig, scheduler_cls: type, model_spec: ModelDescription
) -> SchedulerLimits:
    """The scheduler's per-step limits, with chunked prefill as the scheduler defaults it."""
    max_model_len = model_spec.max_model_len
    return resolve_limits(
        scheduler_cls,
        SchedulerLimits(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.resolved_max_num_batched_tokens(max_model_len),
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            recompute_past_length=model_spec.recompute_past_length,
            num_lookahead_tokens=num_lookahead_tokens(config),
            speculative=config.speculative_config is not None,
            max_itl_ms=config.max_itl_ms,
        ),
    )


def num_lookahead_tokens(config: VliteConfig) -> int:
    """The slots past a request's scheduled tokens a draft model may write its drafts to."""
    speculative = config.speculative_config
    if speculative is None or speculative.method != DRAFT_MODEL:
        return 0
    return speculative.num_speculative_tokens


def resolve_attention(
    config: VliteConfig, model_spec: ModelDescription, registry: PluginRegistry
) -> tuple[str, type]:
    """``(name, class)`` of the attention backend ``config.attention_backend`` selects on
    ``config.torch_device`` in ``config.torch_dtype`` (``auto``: its choice), refused when it
    cannot run there or outside its declared dtype, head-dim and block-size limits."""
    dtype, head_dim, block_size = config.torch_dtype, model_spec.head_dim, config.block_size
    name, backend_cls = resolve_attention_backend(
        config.attention_backend,
        config.torch_device,
        dtype,
        registry,
        head_dim=head_dim,
        block_size=block_size,
    )
    violation = limits_violation(backend_cls, dtype, head_dim, block_size)
    if violation is not None:
        raise ConfigError(
            f"attention_backend={config.attention_backend!r}: attention backend {name!r} "
            f"does not support {violation}; choose another (attention_backend='auto' picks "
            "one within its limits)"
        )
    return name, backend_cls


def resolve_kv_cache(
    config: VliteConfig, model_spec: ModelDescription, attention_cls: type, name: str
) -> str:
    """The name of the dtype ``config.kv_cache_dtype`` selects for the backend (``auto``:
    its choice), refused when the backend takes no cache of that dtype."""
    dtype = resolve_kv_cache_dtype(
        config.kv_cache_dtype,
        config.torch_dtype,
        config.torch_device,
        attention_cls,
        name,
        gguf=getattr(model_spec, "is_gguf", False),
    )
    return dtype_name(dtype)


def check_prefix_caching(
    config: VliteConfig,
    limits: SchedulerLimits,
    scheduler_cls: type,
    attention_cls: type,
    attention_name: str,
) -> None:
    """Refuse a configuration that needs a capability its plugins say they lack.

    Prefix caching (on by default) and chunked prefill both hand the attention backend
    sequences that bring several new tokens after cached context; a plugin with
    ``supports_prefix_caching = False`` cannot take them.
    """
    plugins = (
        ("scheduler", config.scheduler, scheduler_cls),
        ("attention backend", attention_name, attention_cls),
    )
    for kind, name, cls in plugins:
        if config.enable_prefix_caching and not getattr(cls, "supports_prefix_caching", True):
            raise ConfigError(
                f"{kind} {name!r} does not support prefix caching (supports_prefix_caching = "
                "False); turn it off with enable_prefix_caching=False (--no-prefix-caching)"
            )
    if limits.enable_chunked_prefill and not getattr(
        attention_cls, "supports_prefix_caching", True
    ):
        raise ConfigError(
            "chunked prefill splits prompts into chunks, which attention backend "
            f"{attention_name!r} cannot attend over (supports_prefix_caching = False); "
            "turn it off with enable_chunked_prefill=False (--no-enable-chunked-prefill)"
        )


def check_layer_features(
    windows: tuple[int | None, ...],
    soft_cap: float | None,
    attention_cls: type,
    attention_name: str,
) -> None:
    """Refuse a windowed or soft-capped model for an attention backend without it."""
    windowed = [index for index, window in enumerate(windows) if window is not None]
    needs = []
    if windowed and not getattr(attention_cls, "supports_sliding_window", False):
        needs.append(
            f"its layers {_ranges(windowed)} attend over a sliding window of "
            f"{windows[windowed[0]]} tokens (supports_sliding_window = False)"
        )
    if soft_cap is not None and not getattr(attention_cls, "supports_logits_soft_cap", False):
        needs.append(f"it caps attention scores at {soft_cap} (supports_logits_soft_cap = False)")
    if needs:
        raise ConfigError(
            f"attention backend {attention_name!r} cannot run this model: "
            + "; ".join(needs)
            + "; use --attn auto, torch, cpu, triton or flash"
        )


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)

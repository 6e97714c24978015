"""How layers are split into pipeline stages, and what a stage builds and loads."""

from __future__ import annotations

import pytest

from vlite.distributed.pipeline import PipelineParallelGroup, stage_layer_ranges


@pytest.mark.parametrize(
    "num_layers, stages, expected",
    [
        (4, 2, [(0, 2), (2, 4)]),
        (5, 2, [(0, 3), (3, 5)]),  # the first stage takes the extra layer
        (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_equal_runs_with_the_remainder_on_the_first_stages(num_layers, stages, expected):
    assert stage_layer_ranges(num_layers, stages) == expected


def test_an_explicit_partition_and_its_errors():
    assert stage_layer_ranges(14, 3, (5, 5, 4)) == [(0, 5), (5, 10), (10, 14)]
    with pytest.raises(ValueError, match="pp_layer_partition=5,5,5 .* 14 layers in all"):
        stage_layer_ranges(14, 3, (5, 5, 5))
    with pytest.raises(ValueError, match="at least one layer"):
        stage_layer_ranges(4, 2, (4, 0))
    with pytest.raises(ValueError, match="pipeline_parallel_size=5 exceeds the model's 4"):
        stage_layer_ranges(4, 5)


def test_a_stage_builds_and_loads_only_its_layers(tmp_path):
    from vlite.models.llama import LlamaForCausalLM, PipelineMissingLayer
    from vlite.models.loader import build_model, iter_safetensors_weights, load_hf_config
    from vlite.plugins.attention.torch_ref import TorchAttentionBackend
    from vlite.testing.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path, "LlamaForCausalLM", num_hidden_layers=4)
    config = load_hf_config(folder)
    stages = [
        PipelineParallelGroup(0, 2, next_rank=1),
        PipelineParallelGroup(1, 2, prev_rank=0),
    ]
    models = [
        build_model(
            config,
            LlamaForCausalLM,
            TorchAttentionBackend,
            block_size=16,
            dtype=config.torch_dtype,
            device="cpu",
            weights=iter_safetensors_weights(folder),
            pp_group=stage,
        )
        for stage in stages
    ]
    first, last = models
    assert first.num_layers == last.num_layers == 2
    assert [isinstance(layer, PipelineMissingLayer) for layer in first.model.layers] == [
        False,
        False,
        True,
        True,
    ]
    names = [{name for name, _ in model.named_parameters()} for model in models]
    assert names[0] & names[1] == {"model.embed_tokens.weight"}  # tied: on both ends
    assert not hasattr(first, "lm_head") and not hasattr(first.model, "norm")
    assert hasattr(last.model, "norm") and hasattr(last, "lm_head")


def test_what_cannot_be_split_is_refused_before_any_worker_starts(tmp_path, monkeypatch):
    from vlite import LLM
    from vlite.models.gemma import GemmaForCausalLM
    from vlite.testing.tiny_models import make_tiny_model

    gemma = make_tiny_model(tmp_path / "gemma", "Gemma2ForCausalLM")
    monkeypatch.setattr(GemmaForCausalLM, "supports_pipeline_parallel", False)
    with pytest.raises(ValueError, match="does not support pipeline parallelism"):
        LLM(model=str(gemma), executor="multiproc", pipeline_parallel_size=2)
    llama = make_tiny_model(tmp_path / "llama", "LlamaForCausalLM")  # two layers
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2"):
        LLM(model=str(llama), executor="multiproc", pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="'uniproc' runs one worker; pipeline_parallel_size=2"):
        LLM(model=str(llama), pipeline_parallel_size=2)

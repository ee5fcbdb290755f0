"""``gconfig.min_p`` reaches the servers (vLLM's ``min_p``; SGLang's ``sampling_params.min_p``), off when greedy."""

from megarl.api.io_struct import GenerationHyperparameters
from megarl.serving.sglang import SGLangBackend
from megarl.serving.vllm import VLLMBackend


def test_min_p_in_the_payloads():
    g = GenerationHyperparameters(min_p=0.05, top_p=0.9, top_k=20)
    vllm = VLLMBackend().generate_payload([1, 2], g, 8, 0)
    assert (vllm["min_p"], vllm["top_p"], vllm["top_k"]) == (0.05, 0.9, 20)
    assert SGLangBackend().generate_payload([1, 2], g, 8, 0)["sampling_params"]["min_p"] == 0.05
    assert VLLMBackend().generate_payload([1, 2], g.new(greedy=True), 8, 0)["min_p"] == 0.0
    assert SGLangBackend().generate_payload([1, 2], g.new(min_p=0.0), 8, 0)["sampling_params"]["min_p"] == 0.0


def test_the_vllm_payload_names_every_field_vllm_would_take_from_the_models_generation_config():
    """vLLM's own list (``ModelConfig.get_diff_sampling_param``, ``--generation-config auto``) of the
    sampling fields it fills from ``generation_config.json`` for a request that leaves them out."""
    from types import SimpleNamespace

    from vllm.config.model import ModelConfig

    every = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5, temperature=0.5, top_k=3)
    every.update(top_p=0.5, min_p=0.2, max_new_tokens=7)
    model = SimpleNamespace(generation_config="auto", try_get_generation_config=lambda: dict(every))
    filled = ModelConfig.get_diff_sampling_param(SimpleNamespace(**vars(model), override_generation_config={}))
    assert filled, "vLLM reads the model's defaults another way now: update this test"
    for gconfig in (GenerationHyperparameters(), GenerationHyperparameters(greedy=True)):
        payload = VLLMBackend().generate_payload([1, 2], gconfig, 8, 0)
        assert set(filled) <= set(payload), sorted(set(filled) - set(payload))

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
    assert "min_p" not in SGLangBackend().generate_payload([1, 2], g.new(min_p=0.0), 8, 0)["sampling_params"]

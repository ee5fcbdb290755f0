"""Upcycling: a dense Llama checkpoint into a mixture-of-experts that starts where the dense model is.

:func:`upcycle` writes a Mixtral-layout HF directory (``MixtralForCausalLM``: Llama's attention and
norms, every MLP a routed mixture of experts) from a dense Llama one (SmolLM2):

* attention, norms, embeddings and the LM head are copied unchanged;
* each layer's MLP is copied into ``num_experts`` experts, each weight ``W`` as
  ``W + noise * std(W) * N(0, 1)`` (its own draw per expert), so that the experts can tell apart
  the tokens the router sends them;
* the router (``block_sparse_moe.gate``) starts at ``N(0, router_std^2)``: any routing is right at
  the start, because the top-k experts' outputs are weighted by renormalised probabilities (they
  sum to 1) and the experts are (nearly) the dense MLP.

So the upcycled model's logprobs equal the dense model's up to the experts' noise:
:func:`check_upcycled` measures the largest |logprob difference| on a probe and refuses a model
above ``max_logprob_diff``. The Mixtral layout, not Qwen3-MoE's, because Qwen3's attention
normalises each head's queries and keys (QK norm), which a Llama checkpoint does not have.

megarl provisions the upcycled SmolLM2 under the short name ``smollm2-135m-moe``
(:mod:`megarl.models.provision`), made once from ``smollm2-135m-instruct`` with :data:`SMOLLM2_MOE`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

UPCYCLED_FAMILY = "mixtral"
"""The family :func:`upcycle` writes."""
_COPIED_CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
    "attention_dropout",
    "initializer_range",
)
_NOT_COPIED = ("config.json", "megarl_source.json")  # written anew
_MLP = ("gate_proj", "up_proj", "down_proj")
_EXPERT = ("w1", "w3", "w2")  # Mixtral's names for the same three projections


@dataclasses.dataclass(frozen=True)
class UpcycleRecipe:
    """How a dense MLP becomes a mixture of experts."""

    num_experts: int = 4
    """Experts per layer (Mixtral's ``num_local_experts``)."""
    top_k: int = 2
    """Experts each token is routed to (``num_experts_per_tok``)."""
    noise: float = 0.001
    """Std of each expert's perturbation, relative to the std of the weight it perturbs (SmolLM2's logprobs
    move by up to 0.036 at 0.001, 0.37 at 0.01: the 30 layers add up)."""
    router_std: float = 0.02
    """Std of the router's initial weights."""
    seed: int = 0
    """Seed of the perturbations and the router."""
    max_logprob_diff: float = 0.05
    """:func:`check_upcycled` refuses a model whose logprobs differ more from the dense model's."""

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"upcycle: top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.noise < 0 or self.router_std <= 0:
            raise ValueError(f"upcycle: noise={self.noise} must be >= 0 and router_std={self.router_std} > 0")


SMOLLM2_MOE = UpcycleRecipe()
"""The recipe of megarl's ``smollm2-135m-moe``: 4 experts, top-2, 0.1% noise."""


def upcycle(dense_dir: str | Path, out_dir: str | Path, recipe: UpcycleRecipe = SMOLLM2_MOE) -> Path:
    """Write the Mixtral-layout upcycling of the dense Llama model ``dense_dir`` into ``out_dir``."""
    import torch
    from safetensors.torch import load_file, save_file

    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    config = json.loads((dense_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"upcycle: {dense_dir} is a {config.get('model_type')!r} model; expected a dense llama")
    out_dir.mkdir(parents=True, exist_ok=True)
    for entry in dense_dir.iterdir():  # tokenizer, generation config, chat template
        weights = entry.suffix == ".safetensors" or entry.name.endswith(".safetensors.index.json")
        if entry.is_file() and entry.name not in _NOT_COPIED and not weights:
            shutil.copy2(entry, out_dir / entry.name)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(dense_dir.glob("*.safetensors")):
        weights.update(load_file(file))
    gen = torch.Generator().manual_seed(recipe.seed)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if ".mlp." not in name:
            out[name] = tensor
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        moe = f"{prefix}.block_sparse_moe"
        hidden = weights[f"{prefix}.mlp.gate_proj.weight"].shape[1]
        router = torch.randn((recipe.num_experts, hidden), generator=gen) * recipe.router_std
        out[f"{moe}.gate.weight"] = router.to(weights[f"{prefix}.mlp.gate_proj.weight"].dtype)
        for expert in range(recipe.num_experts):
            for dense_name, expert_name in zip(_MLP, _EXPERT):
                w = weights[f"{prefix}.mlp.{dense_name}.weight"]
                noise = torch.randn(w.shape, generator=gen) * (recipe.noise * w.float().std())
                out[f"{moe}.experts.{expert}.{expert_name}.weight"] = (w.float() + noise).to(w.dtype).contiguous()
    save_file(out, out_dir / "model.safetensors", metadata={"format": "pt"})
    moe_config = {key: config[key] for key in _COPIED_CONFIG_KEYS if key in config}
    moe_config.update(
        architectures=["MixtralForCausalLM"],
        model_type=UPCYCLED_FAMILY,
        num_local_experts=recipe.num_experts,
        num_experts_per_tok=recipe.top_k,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
        sliding_window=None,
        torch_dtype=config.get("torch_dtype", "float32"),
        upcycled_from={"model": dense_dir.name, "recipe": dataclasses.asdict(recipe)},
    )
    (out_dir / "config.json").write_text(json.dumps(moe_config, indent=2) + "\n")
    return out_dir


def check_upcycled(dense_dir: str | Path, moe_dir: str | Path, recipe: UpcycleRecipe = SMOLLM2_MOE) -> float:
    """The largest |logprob difference| of the two models over a chat probe's tokens; a RuntimeError above
    ``recipe.max_logprob_diff`` (the upcycled model would not start as the dense model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(dense_dir))
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 times 7? Answer with the number."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = torch.tensor([tokenizer(probe + " 12 times 7 is 84.", add_special_tokens=False)["input_ids"]])
    logprobs = []
    for directory in (dense_dir, moe_dir):
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].double()
        logprobs.append(logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0])
    diff = float((logprobs[0] - logprobs[1]).abs().max())
    if diff > recipe.max_logprob_diff:
        raise RuntimeError(
            f"upcycled model {moe_dir} differs from {dense_dir} by {diff:.4f} in a logprob "
            f"(more than {recipe.max_logprob_diff}): lower the recipe's noise"
        )
    return diff

"""actor.megatron.moe_router_load_balancing_type / moe_aux_loss_coeff reach Megatron's TransformerConfig."""

from types import SimpleNamespace

from megarl.actor.engine_settings import moe_aux_loss_coeff
from megarl.config.train import MegatronConfig, TrainEngineConfig
from megarl.models.build import describe, transformer_config

SINGLE = SimpleNamespace(tp=1, pp=1, vpp=1, ep=1, expert_tp=1, cp=1)


def test_the_load_balancing_loss_is_built_only_when_weighted(tiny_model_dir):
    desc = describe(tiny_model_dir("qwen3_moe"))
    off = transformer_config(desc, SINGLE, dtype="float32")
    on = transformer_config(desc, SINGLE, dtype="float32", moe_aux_loss_coeff=0.01)
    assert (off.moe_router_load_balancing_type, off.moe_aux_loss_coeff) == ("none", 0.0)
    assert (on.moe_router_load_balancing_type, on.moe_aux_loss_coeff) == ("aux_loss", 0.01)


def test_the_engine_weights_the_loss_as_configured():
    def weight(**megatron) -> float:
        return moe_aux_loss_coeff(TrainEngineConfig(megatron=MegatronConfig(**megatron)))

    assert weight() == 0.0  # off by default
    assert weight(moe_router_load_balancing_type="aux_loss") == 1e-3
    assert weight(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.02) == 0.02
    assert weight(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.02) == 0.0

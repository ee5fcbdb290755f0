"""megarl: asynchronous RL (GRPO, PPO) for LLMs on Megatron-Core.

Rollouts run on vLLM / SGLang servers driven by an asyncio pool; the Megatron-Core
actor trains with TP/PP/VPP/EP; a weight bridge streams new parameters back to the
servers. See README.md and DESIGN in the repository.
"""

__version__ = "0.1.0"

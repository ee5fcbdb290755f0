"""Run-level services of a training run: what the trainer loop uses around the RL step.

Pre-launch checks of what a config names (``prelaunch``), checkpoints and HF exports on a
schedule (``saver``), recover points (``recover``), evaluation (``evaluator``), metrics to the
console, wandb, tensorboard and ``metrics.jsonl`` (``stats_logger``) and the HTML report
(``report``). They stand above the actor, the bridge and the rollout side, and below the
trainer script (``megarl.train``) and the launchers; ``megarl.config.run`` holds their configs.
"""

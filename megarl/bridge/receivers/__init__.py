"""Server-side receivers: code that runs inside an inference server (vLLM plugin / engine).

SGLang needs none: its native ``/init_weights_update_group``,
``/update_weights_from_distributed`` and ``/update_weights_from_disk`` are the receiver
(see :class:`megarl.serving.sglang.SGLangControl`).
"""

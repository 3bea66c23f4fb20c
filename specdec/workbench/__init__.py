"""The workbench: profile a workload, predict and measure the speedup, report it, prove losslessness,
compare with transformers' assisted generation, and export the configuration to other engines.

Modules: ``profile`` (measurements and the cost-model prediction), ``report`` (HTML, PNG, Markdown),
``lossless`` (the chi-square self-test), ``peer_hf`` (transformers as a peer in ``specdec bench``),
``export`` (vLLM, SGLang, TensorRT-LLM and llama.cpp settings), ``cli`` (the commands).
"""

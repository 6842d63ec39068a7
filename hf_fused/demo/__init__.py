"""Runnable demos on real data: ``python -m hf_fused.demo {sft,grpo} --help``.

Building blocks, importable on their own:

* ``hf_fused.demo.tokenizer``: the real Qwen tokenizer, built offline from the dashscope wheel;
* ``hf_fused.demo.text``: English text from CPython's pydoc topics, as SFT token blocks;
* ``hf_fused.demo.memory``: peak tensor memory of a code region on CPU or CUDA.

Nothing is imported here, so ``import hf_fused.demo.text`` stays cheap.
"""

"""Runnable demos on real data: ``python -m examples {sft,grpo} --help``.

Building blocks, importable on their own:

* ``examples.tokenizer``: the real Qwen tokenizer, built offline from the dashscope wheel;
* ``examples.text``: English text from CPython's pydoc topics, as SFT token blocks;
* ``examples.memory``: peak tensor memory of a code region on CPU or CUDA.

Nothing is imported here, so ``import examples.text`` stays cheap.
"""

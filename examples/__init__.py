"""Runnable demos on real data, from a clone (not installed with the package):
``python -m examples {sft,grpo} --help`` (``make demo``, ``make demo-grpo``).

Building blocks, importable on their own:

* ``examples.tokenizer``: the real Qwen tokenizer, built offline from the dashscope wheel;
* ``examples.text``: English text from CPython's pydoc topics, as SFT token blocks;
* ``examples.model``: the demos' small Qwen3 with Qwen's real, padded vocabulary.

Peak memory is read with :func:`benchmarks.measure.track_peak_memory`, shared with the benchmarks.

Nothing is imported here, so ``import examples.text`` stays cheap.
"""

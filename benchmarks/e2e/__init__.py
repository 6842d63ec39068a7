"""End-to-end training benchmark: whole training steps of real-shaped models, not the loss alone.

``python -m benchmarks.e2e [--parts sft,grpo,distill] [--seq-lens 4096,16384,32768] [--steps 3] --out DIR``

Modules: :mod:`.models` (shapes, model and data), :mod:`.sft` (part A), :mod:`.grpo` (part B), :mod:`.distill`
(part C), :mod:`.report` (the table and plot), :mod:`.__main__` (command line), :mod:`.distributed` (part A under
each distributed engine); timing, memory, environment and output come from :mod:`benchmarks.measure`, shared with
the ops benchmark.

Part A, SFT: a Qwen3-1.7B-shaped model (random init from ``transformers.Qwen3Config``, bf16 weights,
tied embeddings, SDPA attention, gradient checkpointing, batch size 1, random token ids) trained by
``transformers.Trainer`` for ``--warmup`` + ``--steps`` optimizer steps at each sequence length, in
these variants:

* ``plain``: the unpatched model (full ``[tokens, vocab]`` logits, upcast to fp32 by transformers' loss);
* ``liger``: ``TrainingArguments(use_liger_kernel=True)``, i.e. Liger's fused linear cross-entropy
  **and** its RoPE / RMSNorm / SwiGLU kernels (transformers' default Liger config; ``liger_flce``, not run
  by default, applies the fused linear cross-entropy alone);
* ``hf_fused``: ``hf_fused.apply_fused_loss(model)``, then the same ``Trainer``;
* ``hf_fused_liger`` (not run by default): ``apply_fused_loss(model)``, then ``Trainer(use_liger_kernel=True)``:
  Liger's RoPE / RMSNorm / SwiGLU kernels with hf_fused's loss (hf_fused leaves Liger's fused cross-entropy out);
* ``trl_sft``: ``trl.SFTTrainer`` (TRL 1.16, ``loss_type="nll"``, ``max_length`` = the row length, no packing) on
  the same rows as pre-tokenized ``input_ids``: TRL's own chunked fused LM head (which also computes the
  entropy and top-1 accuracy it logs);
* ``hf_fused_trl_sft``: ``apply_fused_loss(model)``, then the same ``SFTTrainer``: hf_fused answers TRL's
  fused-head call (``hf_fused.integrations.trl``).

``--model gemma2-2b`` swaps the SFT model for a Gemma-2-2B shape (``transformers.Gemma2Config``: 256,000-token
vocabulary, hidden 2304, 26 layers, 8 heads, 4 KV heads, head_dim 256, intermediate 9216, final-logit
soft-capping 30, attention soft-capping 50, sliding window 4096) under ``eager`` attention, since transformers
refuses SDPA for Gemma-2; Liger's patches then go to ``modeling_gemma2``.

Each run records tokens/s as the row length over the median timed step (a ``TrainerCallback`` synchronizes the
GPU at step begin/end; the median, as in part B and the ops benchmark, because a step that hosts one of Python's full
garbage collections, 0.3–0.5 s with transformers, TRL and QuACK imported, says nothing about the variant),
``torch.cuda.max_memory_allocated()`` over the whole ``train()`` (weights, gradients, optimizer states, activations
and loss; the counter is reset after the model is built) and the logged losses (step 1 is the same model and batch
for every variant, so the first losses should agree to bf16 precision). ``torch.cuda.OutOfMemoryError`` is recorded
as ``OOM`` (any other exception as ``error``, with its traceback in the JSON); a variant that failed at one length is
not run at longer ones. Runs go variant by variant, shortest length first, and everything is freed between runs.
Liger patches ``transformers.models.qwen3.modeling_qwen3`` globals (RoPE function, RMSNorm and MLP classes); they
are restored after each Liger run.

Optimizer: ``adamw_torch`` by default (``--optim``). With bf16 weights its two states are bf16, so
weights + gradients + states take 4 × 2 bytes × 1.72 G params ≈ 13.8 GB for the 1.7B shape, the same
for every variant.

Part B, GRPO: ``hf_fused.FusedGRPOTrainer`` vs ``trl.GRPOTrainer`` (TRL 1.16, whose own chunked fused
LM head is the baseline) on a Qwen3-0.6B-shaped model. No generation: both trainers are built offline
(word-level tokenizer, no reward model, no vLLM) and each step calls ``trainer._compute_loss(model,
inputs)`` + ``backward()`` on a synthetic batch with the keys ``_generate_and_score_completions``
returns (``prompt_ids``, ``prompt_mask``, ``completion_ids``, ``completion_mask``, ``advantages``,
``num_items_in_batch``): ``--grpo-completions`` completions of ``--grpo-prompt-len`` prompt tokens and
``--grpo-completion-len`` completion tokens, every token valid, loss ``dapo``, beta 0, one iteration
per generation (so, as in TRL, there is no ``old_per_token_logps``: the loss uses the detached current
log-probs). Reports the median fwd+bwd time of the timed steps (no optimizer step) and the peak memory.
Variants: ``trl``, ``hf_fused`` (default budget) and ``hf_fused_one_pass`` (``fused_options`` with a
``tile_budget_bytes`` holding the fp32 ``[V, H]`` accumulator + 2048 vocabulary rows, so the on-policy
``grad_hint`` gives the head's gradients in the forward pass). ``--grpo-precision trl-default`` builds the model
in float32 and runs each step under bf16 autocast, as ``GRPOTrainer`` trains a model it loads itself
(``GRPOConfig.bf16=True``); the default is bf16 weights.

Part C, distillation (``--parts distill``, not run by default): TRL's ``DistillationTrainer`` (TRL 1.16, ``beta``
``--distill-beta``, default 1.0: reverse KL) with a Qwen3-1.7B-shaped student and a Qwen3-8B-shaped teacher (hidden
4096, 36 layers, untied head; both random init from ``Qwen3Config``, bf16), variants ``trl`` (stock: TRL's
``ChunkedDivergenceFunction``) and ``hf_fused`` (``apply_fused_loss(student)`` before the trainer is built: the
divergence from :func:`hf_fused.ops.linear_distillation_loss`). No generation: like part B, each step calls
``trainer.compute_loss(model, inputs)`` + ``backward()`` on a synthetic batch with the keys TRL's generation step
returns (``--distill-completions`` completions of ``--grpo-prompt-len`` + ``--grpo-completion-len`` tokens, every
completion token valid: 8 x 2048 = 16,384 head rows by default, the ops benchmark's distillation shape). Records the
median step, tokens/s, peak memory, the losses, the logged entropy, the gradient norm and how many loss calls went
through hf_fused's op.

Writes ``DIR/e2e.json`` after every run (a command cut short keeps what it measured), ``DIR/e2e.txt`` (the table
printed last) and ``DIR/e2e.png`` (SFT tokens/s and peak memory by sequence length). ``--time-budget`` (seconds since start) skips the runs that
would start after it. ``--tiny`` shrinks everything for a CPU smoke test:
``python -m benchmarks.e2e --tiny --device cpu --out /tmp/e2e``.
"""

"""hf_fused: causal-LM losses from hidden states and lm_head, tile by tile."""

"""The model shapes the benchmarks share, as Hugging Face ``config.json`` dicts.

Kept apart from the benchmark programs so that one can import them without the other's absl flags.
"""

# A Qwen3-Next-shaped model of ~1.38B parameters (dense FFN; random weights in the benchmarks): the
# decode benchmark's part A and the drafter-prefill rows of bench_kernels.py.
BIG = dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, num_hidden_layers=16,
           full_attention_interval=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
           partial_rotary_factor=0.25, rope_theta=10000000.0, intermediate_size=5632,
           linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
           linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=0, tie_word_embeddings=True,
           num_nextn_predict_layers=1, max_position_embeddings=32768)
# ``--small``: the same architecture at toy sizes, for checking the scripts on a CPU.
SMALL = dict(BIG, vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
             intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16)

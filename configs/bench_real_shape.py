"""The real-shape benchmark of the model family on one GPU (`experiments/bench_real_shape.py`)."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # "real": the published configs (configs/models/qwen3_5_35b_a3b.json, qwen3_next_80b_a3b.json,
    # qwen3_5_27b.json); "fp8": Qwen3-Next-80B-A3B in block-scaled FP8 at all 48 layers, then bf16 and
    # FP8 at the depth bf16 fits; "tiny" / "tiny_fp8": small configs of the same kinds, to check the
    # script on a CPU.
    c.model = "real"
    c.models = ""  # a comma-separated subset of the set's model names, each with its own suite; "" = all
    # Models deeper than this many GiB of bf16 weights (MTP head included) run at the depth that
    # fits, in whole periods of the 3:1 layer pattern (Qwen3-Next-80B-A3B's 48 layers do not).
    c.fit_memory_gib = 116.0
    c.seed = 0
    c.context = 2048  # KV positions (and drafter rows) already cached per sequence in every decode measurement
    c.batches = (1, 8, 32)  # plain decode step batch sizes (every model)
    c.verify_widths = (2, 3, 4, 5, 6, 7, 8)  # verify K at batch 1 (the first model)
    c.prefill_chunk = 512  # tokens of the timed prefill chunk (batch 1)
    c.spec_k = 4  # the speculative loop's verify width
    c.alphas = (0.6, 0.8, 0.9)  # synthetic per-draft acceptance probabilities of the speculative loop
    # The speculative loop again with the drafter's vocabulary reduced to this many ids (0: not run),
    # each draft's LM head then reading that many rows.
    c.draft_vocab = 32768
    c.loop_tokens = 32  # the timed loops run this many and twice as many tokens (a token's time is the slope)
    c.steps_per_call = 8  # step measurements run this many and 4x as many steps per call (the slope)
    c.reps = 5  # timed repetitions per measurement (medians)
    c.compile_workers = 6  # programs compiled at once, in threads (XLA's compiles release the GIL)
    # Wall-clock budget of the whole run: measurements that would start after it are skipped and
    # listed as such, so that a run cut short still writes its tables.
    c.deadline_s = 440.0
    # The first model's compiles are waited for at most until this many seconds before the deadline
    # (its timings then start, each waiting for its own program).
    c.first_model_timing_s = 150.0
    # transformers' Qwen3NextForCausalLM on the same weights as ours: the peer's config (a name
    # of configs/models, or "" for none) at this many layers.
    c.peer_model = "qwen3_next_80b_a3b"
    c.peer_layers = 4
    c.peer_prompt = 512  # prompt tokens before the peer's (and our) timed decode
    c.out_dir = "runs/bench_real_shape"
    c.tree_commit = ""  # the git commit a copied tree (no .git) was made from, for the results' provenance
    return c

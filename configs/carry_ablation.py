"""The drafter-context ablation (the README's main job) on the embedded default model."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.checkpoint = "assets/default_model"
    c.sessions = "assets/sessions/eval_sessions.jsonl"
    c.preamble = "assets/sessions/preamble.txt"
    c.num_sessions = 3  # a subset that runs on a 2-core CPU in minutes; -1 = all
    c.prompt_mode = "append"  # or "rerender"
    c.verify_width = 3  # K: two drafts per verify step
    c.mtp_quant = "bf16"
    c.dtype = "float32"  # compute dtype on the host CPU (fp32 keeps greedy ties stable)
    # None: MTP_MARCONI_MIN_TOKENS, else the shipped 256. A value is set process-wide
    # through carry.set_marconi_min_tokens (first writer wins) and recorded in the results.
    c.marconi_min_tokens = ml_collections.config_dict.placeholder(int)
    c.refeed_accepted = False
    # The carry's turns rewrite their output's drafter rows from the target's hiddens at the
    # turn's end (EngineConfig.rebuild_output_rows), so the entry holds a rebuild's rows.
    c.rebuild_output_rows = True
    # name -> (policy, batch_slots, carry_slots). B > 1 disarms the single-slot carry.
    c.variants = ml_collections.ConfigDict({
        "cold": ("cold", 1, 1),
        "blind": ("blind", 1, 1),
        "rebuild": ("rebuild", 1, 1),
        "carry": ("carry", 1, 1),
        "carry_single_B2": ("carry", 2, 1),
        "carry_multi_B2": ("carry", 2, 8),
    })
    # A device mesh for a checkpoint one device cannot hold (mtp.sharding): tensor-parallel
    # devices, and expert-parallel groups for MoE checkpoints. 1 x 1: one device.
    c.tp = 1
    c.ep = 1
    c.max_context = 2048
    c.num_pages = 2048
    # How long one policy's engine serves before the next takes over: "wave" (one turn at
    # batch 1) or "session" (until one of its sessions ends; see harness.run_policies_interleaved).
    c.stint = "wave"
    c.bootstrap_samples = 2000
    c.seed = 0
    c.out_dir = "runs/carry_ablation"
    return c

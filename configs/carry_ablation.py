"""The drafter-context ablation (the README's main job) on the embedded default model.

``FIELDS`` says what each field means and which values it takes: ``--help`` lists it, and
`experiments.cli.run` checks a config against it before anything is loaded.
"""

import ml_collections

from experiments import cli
from experiments.harness import STINTS
from mtp.checkpoint import WEIGHT_QUANT_CHOICES
from mtp.carry import DEFAULT_MARCONI_MIN_TOKENS
from mtp.config import MTP_HIDDEN_SOURCES
from mtp.serving import DRAFTER_POLICIES, TextPrompts
from mtp.quant import QUANT_CHOICES, parse_quant
from mtp.speculative import MAX_VERIFY_WIDTH


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.checkpoint = "assets/default_model"
    c.sessions = "assets/sessions/eval_sessions.jsonl"
    c.preamble = "assets/sessions/preamble.txt"
    c.num_sessions = 3  # a subset that runs on a 2-core CPU in minutes; -1 = all
    c.prompt_mode = "append"  # or "rerender"
    c.verify_width = 3  # K: two drafts per verify step
    c.mtp_quant = "bf16"
    # "fp8": the target's and the head's Linear weights quantized to 128 x 128 FP8 blocks at
    # load, as Qwen's FP8 checkpoints are (mtp.checkpoint.load_pretrained); "none": as stored.
    c.weight_quant = "none"
    c.dtype = "float32"  # compute dtype on the host CPU (fp32 keeps greedy ties stable)
    # Every variant's engine (EngineConfig.marconi_min_tokens); recorded in the results.
    c.marconi_min_tokens = DEFAULT_MARCONI_MIN_TOKENS
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


def _variant_problem(v):
    """What is wrong with a variant ``(policy, batch_slots, carry_slots)``, or None."""
    if not isinstance(v, (tuple, list)) or len(v) != 3:
        return "not a (policy, batch_slots, carry_slots) triple"
    policy, *slots = v
    if policy not in DRAFTER_POLICIES:
        return f"policy {policy!r} is no drafter policy"
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in slots):
        return f"slots {tuple(slots)} are not both integers >= 1"
    return None


VERIFY_WIDTH = cli.integer(2, MAX_VERIFY_WIDTH)
MTP_QUANT = cli.parsed_by(parse_quant, QUANT_CHOICES)
MTP_HIDDEN_SOURCE = cli.one_of(*MTP_HIDDEN_SOURCES)
MARCONI_MIN_TOKENS = cli.integer(0)
SESSION_COUNT = cli.integer(1, also={-1: "all of them"})
MODEL_FIELDS = {
    "checkpoint": cli.Field("The model: a Hugging Face checkpoint directory.",
                            cli.existing_path("dir", ("config.json", "tokenizer.json"))),
    "sessions": cli.Field("The multi-turn evaluation sessions (JSON lines, mtp/data/sessions.py).",
                          cli.existing_path("file")),
    "preamble": cli.Field("The system preamble every session's first prompt starts with.",
                          cli.existing_path("file")),
    "num_sessions": cli.Field("How many of the sessions are served, from the first.", SESSION_COUNT),
    "prompt_mode": cli.Field("How a warm turn's prompt is built: 'append' extends the previous turn's full "
                             "token sequence; 'rerender' re-tokenizes the whole transcript (its boundary "
                             "tokens may differ, which the carry truncates).", cli.one_of(*TextPrompts.MODES)),
    "verify_width": cli.Field("K, the verify width: K - 1 drafts per verify step.", VERIFY_WIDTH),
    "mtp_quant": cli.Field("The MTP head's weight precision.", MTP_QUANT),
    "weight_quant": cli.Field("Quantize the target's (and head's) bf16 checkpoint at load: 'fp8' is Qwen's "
                              "block-scaled E4M3 layout (a checkpoint published in FP8 loads as it is).",
                              cli.one_of(*WEIGHT_QUANT_CHOICES)),
    "dtype": cli.Field("The compute dtype the checkpoint is loaded at (float32 keeps greedy near-ties stable "
                       "on a CPU).", cli.one_of("float32", "bfloat16")),
    "marconi_min_tokens": cli.Field(
        "The shortest matched prefix for which an SSM snapshot is restored rather than recomputed with a "
        "full drafter prefill (every variant's engine).", MARCONI_MIN_TOKENS),
    "rebuild_output_rows": cli.Field("At a turn's end, rewrite the drafter rows of its output from the target's "
                                     "hiddens of the committed positions (inside the decode call), so the carried "
                                     "entry holds what a full rebuild writes.", cli.BOOLEAN),
    "refeed_accepted": cli.Field("Rebuild the accepted rows written from drafter hiddens from the target's "
                                 "hidden after each verify.", cli.BOOLEAN),
    "tp": cli.Field("Tensor-parallel devices the checkpoint is split over (1: none).", cli.integer(1)),
    "ep": cli.Field("Expert-parallel groups of a MoE checkpoint (1: none).", cli.integer(1)),
    "max_context": cli.Field("Prompt + reply tokens one engine slot can address.", cli.integer(1)),
    "num_pages": cli.Field("KV pages of the target's and of the drafter's page pools.", cli.integer(1)),
    "out_dir": cli.Field("Where the results are written (created if missing).", cli.OUTPUT_PATH),
}
FIELDS = {
    **MODEL_FIELDS,
    "variants.*": cli.Field("One served configuration: (policy, batch_slots, carry_slots). batch_slots > 1 "
                            "disarms the single-slot carry; carry_slots > 1 is the multi-slot carry.",
                            cli.Values(f"a (policy, batch_slots, carry_slots) triple, policy one of "
                                       f"{', '.join(DRAFTER_POLICIES)}, slots integers >= 1", _variant_problem)),
    "stint": cli.Field("How long one policy's engine serves before the next takes over: one 'wave', or until "
                       "one of its sessions ends ('session').", cli.one_of(*STINTS)),
    "bootstrap_samples": cli.Field("Resamples of the paired bootstrap over sessions.", cli.integer(100)),
    "seed": cli.Field("Seed of the bootstrap's resampling.", cli.integer()),
}

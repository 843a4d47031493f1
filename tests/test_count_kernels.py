"""Reading XLA's thunk dumps (`experiments/count_kernels.py`), on excerpts of real H200 dumps.

The compile itself needs JAX's CUDA plugin (`.venv-aot`), which CI does not install; what
is tested here is the part that turns XLA's dump text into the counts it reports.
"""

import textwrap

from experiments.count_kernels import hlo_copies, loop_in_graph, read_thunks, summarize

# A decode loop's thunk sequence before XLA's thunk passes: the loop's set-up, its while
# (condition + body: two fusions, a Mosaic GPU custom call, a copy, a Triton kernel), after.
BEFORE = """\
001: kCopy         [source        | next=002 (1)] kCopy
002: kCustomKernel [prev=001 (1)  | next=014 (1)] wrapped_transpose grid: [512, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
014: kWhile        [prev=002 (1)  | next=385 (1) ]
condition:
  015: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    016: kCustomKernel [source       | sink         ] loop_add_fusion_16 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    017: kCustomKernel [source       | next=099 (82)] input_reduce_fusion_97 grid: [1, 1, 1] threads: [4, 1, 1]  shared_memory: 0 bytes
    099: kCustomCall   [prev=017 (1)  | next=100 (1)] kCustomCall
    100: kCopy         [prev=099 (1)  | next=101 (1)] kCopy
    101: kCustomKernel [prev=100 (1)  | sink        ] _kernel grid: [1, 32, 1] threads: [256, 1, 1]  shared_memory: 4096 bytes
385: kCustomKernel [source | sink] input_transpose_fusion_11 grid: [512, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
"""

# The same after the thunk passes: the body's kernels in two command buffers around the call.
AFTER = """\
000: kCommandBuffer [source       | next=014 (1)]
    001: kCopy         [source | sink] kCopy
    002: kCustomKernel [source | sink] wrapped_transpose grid: [512, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
014: kWhile         [prev=000 (1) | next=000 (1)]
condition:
    015: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    000: kCommandBuffer [source       | next=099 (1)]
        016: kCustomKernel [source       | sink         ] loop_add_fusion_16 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
        017: kCustomKernel [source       | sink         ] input_reduce_fusion_97 grid: [1, 1, 1] threads: [4, 1, 1]  shared_memory: 0 bytes
    099: kCustomCall    [prev=000 (1) | next=000 (1)] kCustomCall
    000: kCommandBuffer [prev=099 (1) | sink        ]
        100: kCopy         [source | sink] kCopy
        101: kCustomKernel [source | sink] _kernel grid: [1, 32, 1] threads: [256, 1, 1]  shared_memory: 4096 bytes
000: kCommandBuffer [prev=014 (1) | sink        ]
    385: kCustomKernel [source | sink] input_transpose_fusion_11 grid: [512, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
"""


def test_whole_sequence_counts_every_launch():
    thunks = read_thunks(BEFORE)
    assert [t[0] for t in thunks] == ["kCopy", "kCustomKernel", "kWhile", "kCustomKernel", "kCustomKernel",
                                      "kCustomKernel", "kCustomCall", "kCopy", "kCustomKernel", "kCustomKernel"]
    s = summarize(thunks)
    assert (s["launches"], s["custom_calls"], s["memory_ops"]) == (7, 1, 2)
    assert thunks[1][1:3] == ("wrapped_transpose", "grid: [512, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes")


def test_while_body_and_its_command_buffers():
    body = read_thunks(BEFORE, while_body=True)
    assert [t[1] for t in body] == ["loop_add_fusion_16", "input_reduce_fusion_97", "", "", "_kernel"]
    s = summarize(body, read_thunks(AFTER, while_body=True))
    assert (s["launches"], s["custom_calls"], s["memory_ops"]) == (4, 1, 1)
    # The custom call splits the body into two graphs and runs between them.
    assert s["command_buffers"] == 2 and s["outside_graphs"] == {"kCustomCall": 1}
    assert s["by_name"] == {"loop_add_fusion": 1, "input_reduce_fusion": 1, "kCustomCall": 1, "_kernel": 1}


# The same loop compiled for a target that states its CUDA driver (13.0): the custom call may be
# recorded, and so may the while, so the set-up, the loop and what follows are one command buffer.
AFTER_CUDA_13 = "000: kCommandBuffer [source | sink]\n" + textwrap.indent(BEFORE, "    ")


def test_a_loop_inside_one_command_buffer_is_told_from_a_host_driven_one():
    assert not loop_in_graph(AFTER)  # the while at the top level: the host reads its predicate
    assert loop_in_graph(AFTER_CUDA_13)
    body = read_thunks(AFTER_CUDA_13, while_body=True)
    assert [t[1] or t[0] for t in body] == ["loop_add_fusion_16", "input_reduce_fusion_97", "kCustomCall", "kCopy",
                                            "_kernel"]
    assert summarize(read_thunks(BEFORE, while_body=True), body)["launches"] == 4


# An optimized HLO excerpt: the entry copies a parameter; the loop body copies a slice
# fusion's output into the carry (twice) and a kernel's tuple output.
HLO = """\
%fused_slice (param_0: bf16[1,6,8]) -> bf16[1,3,8] {
  %param_0 = bf16[1,6,8]{2,1,0} parameter(0)
  ROOT %slice.1 = bf16[1,3,8]{2,1,0} slice(%param_0), slice={[0:1], [3:6], [0:8]}
}

%region_0.81 (arg_tuple.1: (s32[], bf16[1,3,8])) -> (s32[], bf16[1,3,8]) {
  %loop_slice_fusion.3 = bf16[1,3,8]{2,1,0} fusion(%x), kind=kLoop, calls=%fused_slice
  %copy.85 = bf16[1,3,8]{2,1,0} copy(%loop_slice_fusion.3), metadata={scheduling_name="copy.85"}
  %copy.86 = bf16[1,3,8]{2,1,0} copy(%loop_slice_fusion.12), metadata={scheduling_name="copy.86"}
  %copy.99 = f32[1,4,8,8]{3,2,1,0} copy(%pallas_call.78#1), metadata={scheduling_name="copy.99"}
}

ENTRY %main.5 (state_0__kv_k_0_.1: bf16[4,8]) -> bf16[4,8] {
  %copy.18 = bf16[4,8]{1,0} copy(%state_0__kv_k_0_.1)
  %while.39 = (s32[], bf16[1,3,8]{2,1,0}) while(%tuple.192), condition=%region_57.82, body=%region_0.81
}
"""


def test_hlo_copies_name_what_each_memcpy_copies():
    assert hlo_copies(HLO) == {("bf16[4,8]", "state_*__kv_k_*_"): 1}
    assert hlo_copies(HLO, while_body=True) == {("bf16[1,3,8]", "loop_slice_fusion"): 2,
                                                ("f32[1,4,8,8]", "pallas_call"): 1}


# The optimized HLO's stack-frame tables and two of its ops, for grouping launches by model
# source line. As XLA prints them, a frame's parent_frame_id is the parent's row + 1 (1: none).
COMPILED = """\
HloModule jit_step

FileNames
1 "/work/main/mtp/model/target.py"
2 "/work/main/mtp/model/layers.py"
3 "/usr/lib/python3/site-packages/jax/_src/numpy/lax_numpy.py"

FunctionNames
1 "decoder_layer"
2 "rms_norm"
3 "dense"
4 "pad"

FileLocations
1 {file_name_id=1 function_name_id=1 line=64 end_line=64 column=1 end_column=9}
2 {file_name_id=2 function_name_id=2 line=113 end_line=113 column=1 end_column=9}
3 {file_name_id=2 function_name_id=3 line=78 end_line=78 column=1 end_column=9}
4 {file_name_id=3 function_name_id=4 line=900 end_line=900 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=2}
4 {file_location_id=4 parent_frame_id=4}

ENTRY %main {
  %fusion.855 = bf16[2,2048]{1,0} fusion(%a, %b), kind=kCustom, calls=%c, metadata={op_name="x" stack_frame_id=2}
  %gemm_fusion_dot.36 = f32[2,11264]{1,0} fusion(%d, %e), kind=kCustom, calls=%f, metadata={op_name="y" stack_frame_id=4}
}
"""


def test_launches_are_grouped_by_model_source_line():
    from experiments.count_kernels import by_source

    thunks = [("kCustomKernel", "fusion_855", "", 4), ("kCustomKernel", "gemm_fusion_dot_36", "", 4),
              ("kCustomKernel", "fusion_855", "", 4), ("kCopy", "", "", 4), ("kCustomCall", "", "", 4)]
    got = by_source(thunks, COMPILED)
    # Frames outside mtp/ (jax's own pad) are skipped; the innermost mtp/ frames come first.
    assert got == {"rms_norm:113 < decoder_layer:64 -> bf16[2,2048]": 2,
                   "dense:78 < decoder_layer:64 -> f32[2,11264]": 1, "? kCustomCall": 1}


def test_bench_decode_flags_it_does_not_read_are_refused():
    """It imports bench_decode's helpers and so parses all of its flags; one it would ignore
    (e.g. --tp: it compiles one device) stops it by name before anything compiles."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "experiments.count_kernels", "--tp=2", "--reps=3", "--context=512"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "--reps, --tp: experiments.bench_decode's flag(s), which this script does not use" in run.stderr

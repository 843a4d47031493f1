"""Reading XLA's thunk dumps (`experiments/count_kernels.py`), on excerpts of real H200 dumps.

The compile itself needs JAX's CUDA plugin (`.venv-aot`), which CI does not install; what
is tested here is the part that turns XLA's dump text into the counts it reports.
"""

from experiments.count_kernels import read_thunks, summarize

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

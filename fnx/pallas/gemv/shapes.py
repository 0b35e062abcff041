"""One list of shapes for the tests and the benchmark (CONVENTIONS.md rule 7): (name, N, K) of W [N, K]."""

# the released model's 2-D projections at decode (hidden 2560), by the layer they belong to
RELEASED = [
    ("gdn.in_proj_qkv", 10240, 2560),
    ("gdn.in_proj_z", 6144, 2560),
    ("gdn.in_proj_a/b", 48, 2560),
    ("gdn.out_proj", 2560, 6144),
    ("qsa.q_proj", 12288, 2560),
    ("qsa.o_proj", 2560, 6144),
    ("moe.router", 512, 2560),
    ("moe.shared.gate/up", 640, 2560),
    ("moe.shared.down", 2560, 640),
    ("ple.value_proj", 2560, 2560),
    ("hc.down", 320, 10240),
    ("hc.up", 10240, 320),
    ("lm_head", 248320, 2560),
]

# the same layers after fnx.model.fuse (FP8 groups: GDN qkv+z, QSA q+k+v, shared gate+up, PLE key+value), which
# the decode step runs instead when its projections are fused: tuned (and benchmarked) like the rest
FUSED = [
    ("fused.gdn_qkvz", 16384, 2560),
    ("fused.qsa_qkv", 13312, 2560),
    ("fused.shared_gate_up", 1280, 2560),
    ("fused.ple_kv", 12800, 2560),
]

# a layer's FP8 product and its narrow bf16 one, run together by `gemv_pair` at one token and by `gemv_pair_many` at
# several: (name, N1, N2, K)
PAIRS = [
    ("pair.gdn_qkvz+ba", 16384, 96, 2560),
    ("pair.shared_gate_up+router", 1280, 513, 2560),
    ("pair.qsa_qkv+indexer", 13312, 640, 2560),
]

# small shapes of every class the kernels distinguish (wide, narrow N = 48, K not a multiple of 128, split-K)
TEST = [
    ("wide", 256, 512),
    ("narrow", 48, 256),
    ("k_tail", 128, 320),
    ("deep", 64, 2048),
]

M_DECODE = (1, 2, 5, 8, 16, 32)

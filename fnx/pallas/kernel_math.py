"""Small arithmetic shared by the Pallas kernels (importable inside a kernel body: plain jnp on values), and the
one helper that turns a window into a wider product back into an array (`take_window`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
E2M1_F16_SCALE = 2.0 ** 14


def _pallas_dot():
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton
    return getattr(pltriton, "dot", None) or pl.dot      # moved to pallas.triton in newer JAX


dot = _pallas_dot()     # the in-kernel matrix product (tensor cores on the Triton lowering)


def rnd(x, dt):
    """x rounded to dt and back to fp32: where the reference rounds an intermediate to the activation dtype, the
    kernels round at the same place and keep computing in fp32."""
    return x.astype(dt).astype(F32)


def block_cols(s, cw: int):
    """FP8 128x128 blocks: a K chunk's block scales s [cw / 128], one per 128 columns, spread to its cw columns
    ([cw]; a chunk inside one block keeps its scalar), for x * s per activation column."""
    return s if cw <= 128 else jnp.broadcast_to(s[:, None], (cw // 128, 128)).reshape(cw)


def e2m1_f16(codes):
    """E2M1 codes (integers 0..15) -> value * 2^-14 as float16, with two shifts, an or and a bitcast.

    Code s|ee|m placed as fp16 bits s<<15 | ee<<11 | m<<9 has exponent field ee and mantissa top bit m, so it
    reads 2^(ee-15) * (1 + m/2) for ee > 0 and the subnormal m * 2^-15 for ee = 0: exactly the E2M1 value times
    2^-14 in both cases (fp16 subnormals convert exactly on the GPU; no flush to zero). Callers fold
    E2M1_F16_SCALE into a scale: code * 2^-14 times (scale * 2^14) is code * scale exactly."""
    c = codes.astype(jnp.int32)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)


# Four packed bytes (one 32-bit register: Triton's `pack` = 4 for 8-bit elements) -> the fp32 values x 2^-14 of
# their low nibbles (SHIFTS 9, 12) or their high nibbles (SHIFTS 5, 8), $0-$3 in element order. prmt spreads two
# bytes into the two 16-bit halves of a word; per half, the code's magnitude bits land on fp16 bits 9-11 and its
# sign on bit 15 (the `e2m1_f16` placement, two codes per shift / and / or), and cvt.f32.f16 converts each half.
# One block per nibble: JAX's lowering of a multi-result inline-asm primitive returns one result (JAX 0.10.2).
_E2M1_ASM = """{{
.reg .b32 z, x01, x23, t1, t2, w;
.reg .b16 h0, h1;
mov.b32 z, 0;
prmt.b32 x01, $4, z, 0x4140;
prmt.b32 x23, $4, z, 0x4342;
shl.b32 t1, x01, {0}; and.b32 t1, t1, 0x0E000E00; shl.b32 t2, x01, {1}; and.b32 t2, t2, 0x80008000; or.b32 w, t1, t2;
mov.b32 {{h0, h1}}, w; cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1;
shl.b32 t1, x23, {0}; and.b32 t1, t1, 0x0E000E00; shl.b32 t2, x23, {1}; and.b32 t2, t2, 0x80008000; or.b32 w, t1, t2;
mov.b32 {{h0, h1}}, w; cvt.f32.f16 $2, h0; cvt.f32.f16 $3, h1;
}}"""
E2M1_ASM_SHIFTS = {"low": (9, 12), "high": (5, 8)}


# The low or the high nibbles of four bytes (one 32-bit word $4 of Triton's `pack` = 4) without byte permutes: the
# fp16 placement of `e2m1_f16` (sign at bit 15, the three E2M1 bits at 11-9 of each 16-bit half) done on the word
# shifted so that two bytes' nibbles land in the two halves at once. Low nibbles: bytes 0 and 2 from q << 9 (sign
# q << 12), bytes 1 and 3 from q << 1 (sign q << 4); high nibbles: bytes 0 and 2 from q << 5 (q << 8), bytes 1 and
# 3 from q >> 3 (q's own sign bits). $0-$3: the four codes in byte order.
_E2M1_ASM_Q_PAIR = "{op} t, $4, {a}; and.b32 t, t, 0x0E000E00; {sign} or.b32 {w}, t, u;"


def _e2m1_asm_q(half: str) -> str:
    """The PTX block for the `half` ("low" / "high") nibbles of four bytes (see above)."""
    shifts = {"low": ((9, 12), (1, 4)), "high": ((5, 8), (-3, 0))}[half]
    lines = ["{", ".reg .b32 t, u, w0, w1;", ".reg .b16 h0, h1, h2, h3;"]
    for w, (a, sg) in enumerate(shifts):
        op = "shl.b32" if a >= 0 else "shr.b32"
        sign = f"shl.b32 u, $4, {sg}; and.b32 u, u, 0x80008000;" if sg else "and.b32 u, $4, 0x80008000;"
        lines.append(_E2M1_ASM_Q_PAIR.format(op=op, a=abs(a), sign=sign, w=f"w{w}"))
    lines += ["mov.b32 {h0, h2}, w0;", "mov.b32 {h1, h3}, w1;"]      # w0: bytes 0 and 2, w1: bytes 1 and 3
    lines += [f"cvt.f32.f16 ${i}, h{i};" for i in range(4)]
    return "\n".join(lines + ["}"])


# The low or the high nibbles of four bytes with the integer multiplier doing the shifts (`_e2m1_asm_i`): each
# pair of codes is masked out of the word ($4) by two ANDs, one for the three E2M1 bits and one for the sign, and
# moved into place by a multiply and a multiply-add (the bits are disjoint, so the add is an or). On Hopper the
# ANDs run on the ALU pipe and the multiplies on the FMA pipe, where `_E2M1_ASM` runs its shifts and merges on the
# ALU pipe too (the MoE decode kernels are bound by that pipe: BENCHMARKS.md, twenty-eighth session). The high
# nibbles of bytes 1 and 3 need a right shift (bits 12-14 to 9-11), which no multiply does. (mask, multiplier) for
# the E2M1 bits, then for the sign, per pair: bytes 0 and 2 (output halves h0, h2), then bytes 1 and 3 (h1, h3).
_E2M1_ASM_I_PAIRS = {"low": (((0x00070007, 512), (0x00080008, 4096)), ((0x07000700, 2), (0x08000800, 16))),
                     "high": (((0x00700070, 32), (0x00800080, 256)), None)}


def _e2m1_asm_i(half: str) -> str:
    """The PTX block for the `half` ("low" / "high") nibbles of four bytes (see above); $0-$3 in byte order."""
    lines = ["{", ".reg .b32 a, s, w0, w1;", ".reg .b16 h0, h1, h2, h3;"]
    for w, pair in enumerate(_E2M1_ASM_I_PAIRS[half]):
        if pair is None:        # the high nibbles of bytes 1 and 3: bits 12-14 -> 9-11, the sign already at 15
            lines.append(f"shr.b32 a, $4, 3; and.b32 a, a, 0x0E000E00; and.b32 s, $4, 0x80008000; "
                         f"or.b32 w{w}, a, s;")
            continue
        (ma, ka), (ms, ks) = pair
        lines.append(f"and.b32 a, $4, {ma:#010x}; and.b32 s, $4, {ms:#010x}; mul.lo.u32 s, s, {ks}; "
                     f"mad.lo.u32 w{w}, a, {ka}, s;")
    lines += ["mov.b32 {h0, h2}, w0;", "mov.b32 {h1, h3}, w1;"]      # w0: bytes 0 and 2, w1: bytes 1 and 3
    lines += [f"cvt.f32.f16 ${i}, h{i};" for i in range(4)]
    return "\n".join(lines + ["}"])


E2M1_ASM_VARIANTS = ("prmt", "shifts", "imad")   # `_E2M1_ASM`, `_e2m1_asm_q`, `_e2m1_asm_i`


def _e2m1_asm_h(half: str) -> str:
    """`_E2M1_ASM` (the `half` nibbles of four bytes) with the fp16 values as the block's outputs, packed as an fp16
    operand packs them: $0 the values of bytes 0 and 1 (low and high half), $1 those of bytes 2 and 3 (Triton
    packs 16-bit results of a `pack` 4 block two to a 32-bit register), the input word $2; no conversion to fp32.
    For products on fp16 operands (the prefill blocks' `Tiles.e2m1_asm`)."""
    text = _E2M1_ASM.format(*E2M1_ASM_SHIFTS[half]).replace(".reg .b16 h0, h1;\n", "").replace("$4", "$2")
    for reg, (a, b) in enumerate((("$0", "$1"), ("$2", "$3"))):
        text = text.replace(f"or.b32 w, t1, t2;\nmov.b32 {{h0, h1}}, w; cvt.f32.f16 {a}, h0; cvt.f32.f16 {b}, h1;",
                            f"or.b32 ${reg}, t1, t2;", 1)
    if "cvt." in text or "h0" in text:      # `_E2M1_ASM`'s text changed under this rewrite
        raise AssertionError(f"_e2m1_asm_h: the fp32 block no longer rewrites to fp16 outputs:\n{text}")
    return text


def e2m1_pair_f16(packed, asm: bool = False):
    """Packed NVFP4 bytes (uint8, low nibble = even column) -> (low, high) nibble values x 2^-14 in fp16 (exact:
    `e2m1_f16`'s values). asm=True (inside a Pallas Triton kernel on an NVIDIA GPU only) decodes four bytes per
    inline-PTX block (`_e2m1_asm_h`: byte permutes, then two codes per shift / and / or, the fp16 bits straight
    into the outputs); the jnp form, which the interpreter runs, works on one 32-bit value per code."""
    if asm:
        from jax.experimental.pallas import triton as plt
        out = jax.ShapeDtypeStruct(packed.shape, jnp.float16)
        u8 = packed.astype(jnp.uint8)
        return tuple(plt.elementwise_inline_asm(_e2m1_asm_h(h), args=[u8], constraints="=r,=r,r", pack=4,
                                                result_shape_dtypes=[out])[0] for h in ("low", "high"))
    p = packed.astype(jnp.uint32)
    return e2m1_f16(p & 0xF), e2m1_f16(p >> 4)


def e2m1_pair_f32(packed, asm: bool = False, variant: str = "prmt"):
    """Packed NVFP4 bytes (uint8, low nibble = even column) -> (low, high) nibble values x 2^-14 in fp32, the
    values of `e2m1_f16` (callers fold E2M1_F16_SCALE into a scale). asm=True (inside a Pallas Triton kernel on an
    NVIDIA GPU only) decodes four bytes per inline-PTX block: `variant` "prmt" `_E2M1_ASM` (byte permutes, then
    shifts), "shifts" `_e2m1_asm_q` (the placement from shifts of the whole word, no byte permutes), "imad"
    `_e2m1_asm_i` (masks, then the shifts as integer multiplies); the jnp form is the same arithmetic, and what
    the interpreter runs (it cannot run PTX)."""
    if variant not in E2M1_ASM_VARIANTS:
        raise ValueError(f"e2m1_pair_f32: variant {variant!r}, one of {E2M1_ASM_VARIANTS}")
    if asm:
        from jax.experimental.pallas import triton as plt
        out = jax.ShapeDtypeStruct(packed.shape, F32)
        u8 = packed.astype(jnp.uint8)
        if variant != "prmt":
            block = _e2m1_asm_q if variant == "shifts" else _e2m1_asm_i
            return tuple(plt.elementwise_inline_asm(block(h), args=[u8], constraints="=f,=f,=f,=f,r", pack=4,
                                                    result_shape_dtypes=[out])[0] for h in ("low", "high"))
        return tuple(plt.elementwise_inline_asm(_E2M1_ASM.format(*E2M1_ASM_SHIFTS[h]), args=[u8],
                                                constraints="=f,=f,=f,=f,r", pack=4, result_shape_dtypes=[out])[0]
                     for h in ("low", "high"))
    p = packed.astype(jnp.uint32)
    return e2m1_f16(p & 0xF).astype(F32), e2m1_f16(p >> 4).astype(F32)


# One NVFP4 group (16 codes: two 32-bit words $8, $9 of Triton's `pack` = 8 for 8-bit elements) times its 16
# activations, in half2 arithmetic: the e2m1 -> fp16 placement of `e2m1_f16` done on the top nibble of both 16-bit
# halves of a word at once ((w & 0x80008000) | ((w >> 3) & 0x0E000E00): the codes of columns 3 and 7), then on the word
# shifted left by 4, 8 and 12 (columns 2 and 6, 1 and 5, 0 and 4); each half2 of codes is multiplied with its
# activation pair {x'[q], x'[q + 4]} ($10-$13 for the first word's q = 0..3, $14-$17 for the second's) and added into
# one half2 accumulator (the products are exact in fp16: a code has 2 significant bits, x' 8; the 15 sums round
# to fp16). $0 = the two halves' sum in fp32; $1-$7 = 0 (the caller sums each 8 outputs: one group).
# Not elementwise: it assumes the 8 bytes Triton packs into one block are one group's 8 consecutive bytes, which
# holds when each thread owns 16 contiguous bytes of the tile (the vectorised loads' layout) and fails otherwise
# (the compiled test and the benchmark's check against the reference catch a layout that splits them). The byte-wise
# block below makes no such assumption.
_E2M1_HFMA_PAIR = ("and.b32 w, q, 0x80008000; shr.b32 t, q, 3; and.b32 t, t, 0x0E000E00; or.b32 w, w, t; "
                   "{op} acc, w, ${x}{acc};\n")


def _hfma_asm() -> str:
    lines = ["{", ".reg .b32 q, t, w, acc;", ".reg .b16 h0, h1;", ".reg .f32 f0, f1;"]
    for word, (src, x0) in enumerate((("$8", 10), ("$9", 14))):
        lines.append(f"mov.b32 q, {src};")
        for k in range(4):           # columns (3 - k, 7 - k) of the word: activation pair q = 3 - k
            if k:
                lines.append("shl.b32 q, q, 4;")
            first = word == 0 and k == 0
            lines.append(_E2M1_HFMA_PAIR.format(op="mul.rn.f16x2" if first else "fma.rn.f16x2", x=x0 + 3 - k,
                                                acc="" if first else ", acc").rstrip("\n"))
    lines += ["mov.b32 {h0, h1}, acc;", "cvt.f32.f16 f0, h0;", "cvt.f32.f16 f1, h1;", "add.f32 $0, f0, f1;"]
    lines += [f"mov.f32 ${i}, 0f00000000;" for i in range(1, 8)]
    return "\n".join(lines + ["}"])


_E2M1_HFMA_ASM = _hfma_asm()
HFMA_X_TOP = 14          # the prescale puts max |x'| in [2^14, 2^15): 16 products of codes (<= 6 * 2^-14) stay < 96


# The same arithmetic byte by byte (elementwise, Triton `pack` 4): `prmt` spreads two bytes into the halves of a word
# (as `_E2M1_ASM`), the low and the high nibbles of both are placed as fp16 codes, two more `prmt`s gather the two
# bytes' even- and odd-column activations from their pairs {x'[2e], x'[2e+1]} ($5-$8), and one half2 multiply and
# one half2 fma give each byte's two products summed (rounded once to fp16): $0-$3, one per byte, in fp32.
_E2M1_HFMA_BYTE_PAIR = """prmt.b32 x, $4, z, {sel};
shl.b32 t1, x, 9; and.b32 t1, t1, 0x0E000E00; shl.b32 t2, x, 12; and.b32 t2, t2, 0x80008000; or.b32 lo, t1, t2;
shl.b32 t1, x, 5; and.b32 t1, t1, 0x0E000E00; shl.b32 t2, x, 8; and.b32 t2, t2, 0x80008000; or.b32 hi, t1, t2;
prmt.b32 a, {xa}, {xb}, 0x5410; prmt.b32 b, {xa}, {xb}, 0x7632;
mul.rn.f16x2 p, lo, a; fma.rn.f16x2 p, hi, b, p;
mov.b32 {{h0, h1}}, p; cvt.f32.f16 {o0}, h0; cvt.f32.f16 {o1}, h1;"""
_E2M1_HFMA_BYTE_ASM = "\n".join(
    ["{", ".reg .b32 z, x, t1, t2, lo, hi, a, b, p;", ".reg .b16 h0, h1;", "mov.b32 z, 0;",
     _E2M1_HFMA_BYTE_PAIR.format(sel="0x4140", xa="$5", xb="$6", o0="$0", o1="$1"),
     _E2M1_HFMA_BYTE_PAIR.format(sel="0x4342", xa="$7", xb="$8", o0="$2", o1="$3"), "}"])


def hfma_prescale(mx):
    """(2^s, 2^-s) fp32 for a row whose max |x| is mx: x' = x * 2^s has its max in [2^14, 2^15) (fp16 holds it, and
    a group's 16 products, codes * 2^-14 * x', sum below 96), s clipped to the fp32 normal exponents. Exact powers
    of two (built from their bits): the rescale by 2^-s is exact."""
    e = ((lax.bitcast_convert_type(mx.astype(F32), jnp.int32) >> 23) & 0xFF) - 127
    s = jnp.clip(HFMA_X_TOP - e, -126, 127)
    up = lax.bitcast_convert_type(((s + 127) << 23).astype(jnp.int32), F32)
    down = lax.bitcast_convert_type(((127 - s) << 23).astype(jnp.int32), F32)
    return up, down


def group_bytes(sc, group: int = 16):
    """Per-group NVFP4 values [rows, cw/group] spread to the packed bytes [rows, cw/2] (each byte's two codes share
    its group: group/2 bytes per group), by a broadcast and a reshape."""
    rows, ng = sc.shape
    return jnp.broadcast_to(sc[:, :, None], (rows, ng, group // 2)).reshape(rows, ng * (group // 2))


def hfma_pairs(lo, hi):
    """x' at columns 8w + q and 8w + q + 4 (each [cw/2], element 4w + q), as fp16 -> uint32 half2 words
    {lo, hi} (lo in the low half), the activation operand of `e2m1_hfma_group_sums` with asm."""
    b = lambda v: lax.bitcast_convert_type(v.astype(jnp.float16), jnp.uint16).astype(jnp.uint32)
    return b(lo) | (b(hi) << 16)


def unpack_f16_pairs(pr):
    """`hfma_pairs`' words [n] uint32 -> (lo, hi) [n] fp32 holding their fp16 values."""
    half = lambda v: lax.bitcast_convert_type(v.astype(jnp.uint16), jnp.float16).astype(F32)  # noqa: E731
    return half(pr & 0xFFFF), half(pr >> 16)


def hfma_pair_columns(n_bytes: int):
    """The column of x' each element of `hfma_pairs`' lo operand reads (hi: + 4), for a chunk of n_bytes packed
    bytes: element 4w + q -> column 8w + q."""
    k = lax.broadcasted_iota(jnp.int32, (n_bytes,), 0)
    return k + 4 * (k // 4)


def _hfma_block_sums(asm_text: str, pack: int, packed, x):
    """One of the half2 PTX blocks over packed [rows, cw/2] NVFP4 bytes and their activation pairs x [cw/2] uint32
    (`pack` bytes per block: `pack` fp32 outputs, one 32-bit register per 4 bytes and one per activation pair; each
    group's 8 outputs summed): [rows, cw/16] fp32."""
    from jax.experimental.pallas import triton as plt
    rows, half = packed.shape
    out = plt.elementwise_inline_asm(
        asm_text, args=[packed.astype(jnp.uint8), jnp.broadcast_to(x, packed.shape)],
        constraints=",".join(["=f"] * pack + ["r"] * (pack // 4 + pack)), pack=pack,
        result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, F32)])[0]
    return jnp.sum(out.reshape(rows, half // 8, 8), axis=2)


def e2m1_hfma_byte_group_sums(packed, x, asm: bool = False):
    """`e2m1_hfma_group_sums` byte by byte (`_E2M1_HFMA_BYTE_ASM`, elementwise): per byte, its two codes times its
    columns' activations summed once in fp16; the 8 bytes of a group summed in fp32. asm=True: x is `hfma_pairs` of
    the even and the odd columns [cw/2] uint32; otherwise x = (even, odd) columns of x' (fp32 holding fp16 values).
    Returns [rows, cw/16] fp32."""
    if asm:
        return _hfma_block_sums(_E2M1_HFMA_BYTE_ASM, 4, packed, x)
    rows, half = packed.shape
    p = packed.astype(jnp.uint32)
    f16 = jnp.float16
    lo = (e2m1_f16(p & 0xF) * x[0].astype(f16)[None, :]).astype(f16)      # exact in fp16
    hi = (e2m1_f16(p >> 4) * x[1].astype(f16)[None, :]).astype(f16)
    out = (lo + hi).astype(f16).astype(F32)
    return jnp.sum(out.reshape(rows, half // 8, 8), axis=2)


def e2m1_hfma_group_sums(packed, x, asm: bool = False):
    """Per row and 16-column group, sum_c code_c * 2^-14 * x'_c in fp32: packed [rows, cw/2] uint8 NVFP4 codes (low
    nibble = even column). asm=True (a Pallas Triton kernel on an NVIDIA GPU): x is `hfma_pairs` [cw/2] uint32 and
    the products are summed in half2 (`_E2M1_HFMA_ASM`). Otherwise x is x' [cw] (fp32 holding fp16 values) and the
    same arithmetic runs in jnp: the fp16 products, each half's 8 fp16 sums in the asm's order, the halves added in
    fp32. Returns [rows, cw/16] fp32."""
    if asm:
        return _hfma_block_sums(_E2M1_HFMA_ASM, 8, packed, x)
    rows, half = packed.shape
    p = packed.astype(jnp.uint32)
    f16 = jnp.float16
    v = jnp.stack([e2m1_f16(p & 0xF), e2m1_f16(p >> 4)], axis=-1).reshape(rows, 2 * half)
    prod = (v * x.astype(f16)[None, :]).reshape(rows, half // 8, 16)            # exact in fp16
    sums = []
    for base in (0, 4):      # half 0: columns 0-3 of each word, half 1: columns 4-7; words in order, q = 3..0
        acc = None
        for word in (0, 8):
            for q in (3, 2, 1, 0):
                t = prod[:, :, word + base + q]
                acc = t if acc is None else (acc + t).astype(f16)
        sums.append(acc.astype(F32))
    return sums[0] + sums[1]


@jax.tree_util.register_pytree_node_class
class Partials:
    """A split-K product not yet summed: buf [S, Mp, W] fp32 partials whose first m rows are the product's rows
    (the tokens of `lead`, flattened), summed in split order and rounded to `dtype` by whoever reads it: a kernel
    that takes it sums the S values of each element it loads (no sum kernel before it), the rest take
    `window(start, size)`, the sum as S - 1 elementwise adds that XLA fuses into its consumer. Both sum in split
    order in fp32 and round once: with two splits (the GDN pair's tiles) the bits of `fnx.pallas.gemv`'s own split
    sum (a reduce); with more, XLA's reduce may add in another order (one rounding apart at most)."""

    def __init__(self, buf, m: int, lead: tuple, dtype):
        self.buf, self.m, self.lead, self.dtype = buf, int(m), tuple(lead), jnp.dtype(dtype)

    def tree_flatten(self):
        return (self.buf,), (self.m, self.lead, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def splits(self) -> int:
        return self.buf.shape[0]

    @property
    def width(self) -> int:
        return self.buf.shape[-1]

    def window(self, start: int = 0, size: int | None = None):
        """Columns [start, start + size) of the summed product, [*lead, size] in dtype."""
        size = self.width - start if size is None else size
        parts = [self.buf[i, :self.m, start:start + size] for i in range(self.splits)]
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        return acc.astype(self.dtype).reshape(*self.lead, size)


def window_operand(a, size: int, lead: tuple, what: str = "operand"):
    """(buffer [*lead, W], start column) for a kernel operand of `size` columns given as an array (its trailing
    axes flattened: [*lead, ...]) or as a window (buffer, start) into a wider product (the fused projections), which
    the kernel reads in place. A buffer of rank len(lead) is one column. Raises for a window past its buffer. A
    window of `Partials` is returned as it is (checked against lead and its width): the kernel sums it."""
    if isinstance(a, tuple) and isinstance(a[0], Partials):
        buf, start = a[0], int(a[1])
        if buf.lead != tuple(lead) or start < 0 or start + size > buf.width:
            raise ValueError(f"{what}: window [{start}, {start + size}) of split partials {tuple(buf.buf.shape)} "
                             f"(rows of {buf.lead}) does not fit leading axes {tuple(lead)}")
        return buf, start
    buf, start = a if isinstance(a, tuple) else (a, 0)
    if buf.ndim == len(lead) or not isinstance(a, tuple):
        buf = buf.reshape(*lead, -1)
    start = int(start)
    if tuple(buf.shape[:-1]) != tuple(lead) or start < 0 or start + size > buf.shape[-1]:
        raise ValueError(f"{what}: window [{start}, {start + size}) is outside an operand of shape "
                         f"{tuple(buf.shape)} (leading axes {tuple(lead)})")
    return buf, start


def take_window(buf, start: int, size: int):
    """Columns [start, start + size) of buf [..., W] (the last axis): a projection's output inside a fused
    product, which the kernels read in place as (buffer, start) and the references take as an array. The buffer
    itself when the window is all of it (no slice op). `Partials`: the summed window (`Partials.window`)."""
    start = int(start)
    if isinstance(buf, Partials):
        return buf.window(start, size)
    if start == 0 and size == buf.shape[-1]:
        return buf
    return buf[..., start:start + size]


# e2m1 "mma" (the MoE gate/up kernel at one token): one inline-PTX block per 4 packed gate bytes and the 4 up bytes
# at the same columns (Triton's `pack` = 4), each lane's own codes as the A fragment of `mma.sync.m16n8k16` (gate
# in rows g, up in rows g + 8; g = lane / 4) and its own activations as column n = g of B. D[g][g] and D[g+8][g]
# then hold the sums over the four lanes of quad g of their own weights times their own activations, whatever
# columns they hold, provided a quad's lanes hold one row (Triton's blocked layouts put >= 4 lanes on a row of a
# [rows, cw/2] byte tile with cw/2 >= 64). The lane t = g / 2 keeps them (c0 / c1, c2 / c3 by g's parity); every
# other output is 0. Codes are placed as fp16 bits (value * 2^-14, two codes of bytes j and j + 2 per half2, so one
# shift serves both), times their group scale in fp16 (exact: e2m1 x e4m3 * 2^-14 needs at most 5 significant bits
# and stays >= 2^-24); fp32 accumulation in the tensor core.
def _e2m1_mma_place(dst: str, word: str, mag: str, sign: str) -> str:
    """PTX placing two codes of `word` as the fp16 bits s << 15 | eem << 9 in dst's halves: `mag` / `sign` shift
    the word so the codes' eem bits land on 9-11 / 25-27 and their sign bits on 15 / 31."""
    return f"{mag.format(t='t1', w=word)}; and.b32 t1, t1, 0x0E000E00; {sign.format(t='t2', w=word)}; " \
           f"and.b32 t2, t2, 0x80008000; or.b32 {dst}, t1, t2;"


_MMA_PLACE = (("shl.b32 {t}, {w}, 9", "shl.b32 {t}, {w}, 12"),    # low nibbles of bytes 0 and 2
              ("shl.b32 {t}, {w}, 5", "shl.b32 {t}, {w}, 8"),     # high nibbles of bytes 0 and 2
              ("shl.b32 {t}, {w}, 1", "shl.b32 {t}, {w}, 4"),     # low nibbles of bytes 1 and 3
              ("shr.b32 {t}, {w}, 3", "mov.b32 {t}, {w}"))        # high nibbles of bytes 1 and 3
E2M1_MMA_ASM = "\n".join([
    "{",
    ".reg .b32 t1, t2, g0, g1, g2, g3, u0, u1, u2, u3, sa, sb, xa, xb, xc, xd;",
    *[_e2m1_mma_place(f"g{i}", "$4", *p) for i, p in enumerate(_MMA_PLACE)],
    *[_e2m1_mma_place(f"u{i}", "$5", *p) for i, p in enumerate(_MMA_PLACE)],
    # group scales {s(byte 0), s(byte 2)} and {s(byte 1), s(byte 3)} (each input word holds its byte's scale twice)
    "prmt.b32 sa, $6, $8, 0x5410; prmt.b32 sb, $7, $9, 0x5410;",
    "mul.rn.f16x2 g0, g0, sa; mul.rn.f16x2 g1, g1, sa; mul.rn.f16x2 g2, g2, sb; mul.rn.f16x2 g3, g3, sb;",
    "prmt.b32 sa, $10, $12, 0x5410; prmt.b32 sb, $11, $13, 0x5410;",
    "mul.rn.f16x2 u0, u0, sa; mul.rn.f16x2 u1, u1, sa; mul.rn.f16x2 u2, u2, sb; mul.rn.f16x2 u3, u3, sb;",
    # the activations of the same columns: byte j's pair {x'[2j], x'[2j+1]} regrouped as the codes are
    "prmt.b32 xa, $14, $16, 0x5410; prmt.b32 xb, $14, $16, 0x7632;",
    "prmt.b32 xc, $15, $17, 0x5410; prmt.b32 xd, $15, $17, 0x7632;",
    # the lane's D fragment accumulates across blocks and chunks ($18-$21 in, $0-$3 out); its off-diagonal entries
    # are sums that `E2M1_MMA_DIAG_ASM` drops once, after the last chunk
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {g0, u0, g1, u1}, {xa, xb}, "
    "{$18, $19, $20, $21};",
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {g2, u2, g3, u3}, {xc, xd}, "
    "{$0, $1, $2, $3};",
    "}"])
# The diagonal of a lane's accumulated D fragment: lane (g, t) holds D[g][2t], D[g][2t+1] (c0, c1) and rows g + 8
# (c2, c3); the lane with t = g / 2 keeps D[g][g] (gate) and D[g+8][g] (up) in outputs 0 and 1, every other output 0.
E2M1_MMA_DIAG_ASM = "\n".join([
    "{",
    ".reg .b32 t1, t2, ln, lg, lt;",
    ".reg .f32 e0, e1;",
    ".reg .pred pd, po;",
    "mov.u32 ln, %laneid; shr.u32 lg, ln, 2; and.b32 lt, ln, 3; shr.u32 t1, lg, 1; and.b32 t2, lg, 1;",
    "setp.eq.u32 pd, t1, lt; setp.eq.u32 po, t2, 1;",
    "selp.f32 e0, $5, $4, po; selp.f32 e1, $7, $6, po;",
    "selp.f32 $0, e0, 0f00000000, pd; selp.f32 $1, e1, 0f00000000, pd;",
    "mov.f32 $2, 0f00000000; mov.f32 $3, 0f00000000;",
    "}"])


def f16_pairs(v):
    """fp32 values (fp16-representable) -> uint32 words holding each value's fp16 bits in both halves."""
    b = lax.bitcast_convert_type(v.astype(jnp.float16), jnp.uint16).astype(jnp.uint32)
    return b | (b << 16)


def e2m1_mma_row_pair(pg, pu, sg, su, x, acc, asm: bool = False):
    """One chunk of two NVFP4 row sets' products with one activation row, added to acc [rows, cw/2] fp32 (the MoE
    decode's gate and up rows in kernel 1, a column tile's two row halves in kernel 2): pg, pu [rows, cw/2]
    uint8 packed codes (both sets at the same columns, low nibble = even column), sg, su [rows, cw/2] their
    group scales per byte (`f16_pairs` words; as fp16, exact), x the activations prescaled into fp16's range
    (`hfma_prescale`): with asm, `hfma_pairs` of the even and odd columns [cw/2] uint32 (`E2M1_MMA_ASM`, a GPU
    only: each lane's D fragments, accumulated); otherwise (even, odd) [cw/2] fp32 holding fp16 values (the same
    products in jnp, summed in another order). After the last chunk `e2m1_mma_diag` leaves [rows, cw/2] whose
    elements 4i (pg's rows) and 4i + 1 (pu's), summed over a row, are sum_c code_c * 2^-14 * scale_c * x'_c; the
    others are 0."""
    rows, half = pg.shape
    if asm:
        from jax.experimental.pallas import triton as plt
        return plt.elementwise_inline_asm(
            E2M1_MMA_ASM, args=[pg.astype(jnp.uint8), pu.astype(jnp.uint8), sg, su, jnp.broadcast_to(x, pg.shape),
                                acc],
            constraints=",".join(["=f"] * 4 + ["r"] * 14 + ["f"] * 4), pack=4,
            result_shape_dtypes=[jax.ShapeDtypeStruct(pg.shape, F32)])[0]
    f16 = jnp.float16
    even, odd = (v.astype(F32)[None, :] for v in x)

    def terms(p, s):
        sc = lax.bitcast_convert_type((s & 0xFFFF).astype(jnp.uint16), f16).astype(F32)
        pi = p.astype(jnp.int32)
        lo = e2m1_f16(pi & 0xF).astype(F32) * sc           # exact in fp16, and so in fp32
        hi = e2m1_f16(pi >> 4).astype(F32) * sc
        return jnp.sum((lo * even + hi * odd).reshape(rows, half // 4, 4), axis=2)   # [rows, cw/8]

    pos = lax.broadcasted_iota(jnp.int32, (rows, half // 4, 4), 2)
    out = jnp.where(pos == 0, terms(pg, sg)[:, :, None], jnp.where(pos == 1, terms(pu, su)[:, :, None], 0.0))
    return acc + out.reshape(rows, half)


def e2m1_mma_diag(acc, asm: bool = False):
    """The accumulated D fragments of `e2m1_mma_row_pair` -> each quad's gate and up sums on its diagonal lane, 0
    elsewhere (`E2M1_MMA_DIAG_ASM`, once per program); the jnp form's accumulator already is that."""
    if not asm:
        return acc
    from jax.experimental.pallas import triton as plt
    return plt.elementwise_inline_asm(E2M1_MMA_DIAG_ASM, args=[acc], constraints=",".join(["=f"] * 4 + ["f"] * 4),
                                      pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(acc.shape, F32)])[0]

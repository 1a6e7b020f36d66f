//! Packing GGML blocks into the panels the 256-bit tiles read (the layout
//! in the parent's docs). This file is the block panels' packing code and
//! nothing else: its text is [`super::PACKING_SOURCE`], which the GEMM's
//! packed layout version hashes, so every edit here retires the compiled
//! artifacts made before it — keep code that does not decide where a byte
//! goes out of it.

use kvjit_core::DType;

use crate::microkernel::TILE_COLUMNS;

/// Bytes of a packed panel of `format` over `k` values of K: the GGML bytes
/// of 16 columns, `k / block · block_bytes · 16` (for an element dtype, the
/// plain `[k][16]` panel's bytes).
pub fn panel_bytes(format: DType, k: usize) -> usize {
    let (block, bytes) = format.block();
    k / block * bytes * TILE_COLUMNS
}

/// Pack up to 16 columns of GGML blocks into one panel (the layout in the
/// [module docs](super)): `columns[c]` holds column c's K / block blocks, raw;
/// columns past `columns.len()` are padding that decodes to +0.0.
///
/// # Panics
/// If `format` is not a block format, `k` not a multiple of its block,
/// more than 16 columns are given, a column's length is not
/// `k / block · block_bytes`, or `out.len() != panel_bytes(format, k)`.
pub fn pack_panel(format: DType, columns: &[&[u8]], k: usize, out: &mut [u8]) {
    assert!(format.is_block_format(), "pack_panel packs GGML block formats, not {format}");
    let (block, size) = format.block();
    assert!(k.is_multiple_of(block), "k = {k} is not a whole number of {format} blocks ({block})");
    assert!(columns.len() <= TILE_COLUMNS, "a panel holds at most {TILE_COLUMNS} columns, not {}", columns.len());
    let groups = k / block;
    for (c, column) in columns.iter().enumerate() {
        assert_eq!(
            column.len(),
            groups * size,
            "column {c} holds {} bytes, not {groups} {format} blocks",
            column.len()
        );
    }
    assert_eq!(out.len(), panel_bytes(format, k), "a {format} panel over k = {k}");
    let padding = padding_block(format);
    let group_bytes = size * TILE_COLUMNS;
    for (g, out) in out.chunks_exact_mut(group_bytes).enumerate() {
        let block_of = |c: usize| columns.get(c).map_or(&padding[..], |column| &column[g * size..(g + 1) * size]);
        match format {
            DType::Q4_0 | DType::Q4_1 | DType::Iq4Nl => pack_q4(format, out, block_of),
            DType::Q5_0 | DType::Q5_1 => pack_q5(format, out, block_of),
            DType::Q8_0 | DType::Q8Min => pack_q8(format, out, block_of),
            DType::Q4K => pack_q4k(out, block_of),
            DType::Q5K => pack_q5k(out, block_of),
            DType::Q6K => pack_q6k(out, block_of),
            DType::Q8KMin => pack_q8kmin(out, block_of),
            _ => unreachable!("checked a block format above"),
        }
    }
}

/// A block of `format` that decodes to +0.0 everywhere: zero scales and
/// quants whose integer is 0 (Q4_0 nibbles 8, Q5_0 `q` = 16, Q6_K `q` = 32).
fn padding_block(format: DType) -> Vec<u8> {
    let mut block = vec![0u8; format.block().1];
    match format {
        // Code 8 is IQ4_NL's level 1: 0·1 = +0.
        DType::Q4_0 | DType::Iq4Nl => block[2..].fill(0x88),
        // Every fifth bit set, nibbles 0: q = 16.
        DType::Q5_0 => block[2..6].fill(0xff),
        // High 2 bits 2 (low 4 bits 0): q = 32.
        DType::Q6K => block[128..192].fill(0xaa),
        _ => {}
    }
    block
}

/// The byte of the Q4 layout for 8 columns' 32 k at `k0` (see the
/// [layout](super)): vector `g`, column dword byte `j` holds the quants of
/// k0 + 8g + j (low nibble) and k0 + 8g + 4 + j (high nibble), from
/// `quant(k)` (0..16).
fn q4_layout(out: &mut [u8], column: usize, k0: usize, quant: impl Fn(usize) -> u8) {
    for g in 0..4 {
        for j in 0..4 {
            let k = k0 + 8 * g + j;
            out[32 * g + 4 * column + j] = quant(k) | (quant(k + 4) << 4);
        }
    }
}

/// One k-group of a Q4_0 / Q4_1 / IQ4_NL panel (see the [layout](super)).
fn pack_q4<'a>(format: DType, out: &mut [u8], block_of: impl Fn(usize) -> &'a [u8]) {
    let (quants, scales) = out.split_at_mut(256);
    let header = if format == DType::Q4_1 { 4 } else { 2 };
    for c in 0..TILE_COLUMNS {
        let (half, column) = (c / 8, c % 8);
        let b = block_of(c);
        let qs = &b[header..];
        // Weight j < 16 is qs[j] & 15, weight j ≥ 16 is qs[j − 16] >> 4.
        q4_layout(&mut quants[128 * half..], column, 0, |j| if j < 16 { qs[j] & 0x0f } else { qs[j - 16] >> 4 });
        scales[2 * c..2 * c + 2].copy_from_slice(&b[..2]);
        if format == DType::Q4_1 {
            scales[32 + 2 * c..32 + 2 * c + 2].copy_from_slice(&b[2..4]);
        }
    }
}

/// One k-group of a Q5_0 / Q5_1 panel (see the [layout](super)): Q4's
/// nibbles, then per half the 8 columns' fifth bits as one dword each,
/// whose byte `j` holds in bit `2g` that of k = 8g + j and in bit `2g + 1`
/// that of k = 8g + 4 + j, then the scales (and minimums).
fn pack_q5<'a>(format: DType, out: &mut [u8], block_of: impl Fn(usize) -> &'a [u8]) {
    let (quants, rest) = out.split_at_mut(256);
    let (high, scales) = rest.split_at_mut(64);
    let header = if format == DType::Q5_1 { 4 } else { 2 };
    for c in 0..TILE_COLUMNS {
        let (half, column) = (c / 8, c % 8);
        let b = block_of(c);
        let bits = u32::from_le_bytes([b[header], b[header + 1], b[header + 2], b[header + 3]]);
        let qs = &b[header + 4..];
        q4_layout(&mut quants[128 * half..], column, 0, |j| if j < 16 { qs[j] & 0x0f } else { qs[j - 16] >> 4 });
        for j in 0..4 {
            let bit = |k: usize| ((bits >> k) & 1) as u8;
            high[32 * half + 4 * column + j] =
                (0..4).map(|g| bit(8 * g + j) << (2 * g) | bit(8 * g + 4 + j) << (2 * g + 1)).sum();
        }
        scales[2 * c..2 * c + 2].copy_from_slice(&b[..2]);
        if format == DType::Q5_1 {
            scales[32 + 2 * c..32 + 2 * c + 2].copy_from_slice(&b[2..4]);
        }
    }
}

/// One k-group of a Q8_0 or q8_min panel (see the [layout](super)):
/// q8_min's u8 quants stored as `q − 128` (an i8, as Q8_0's), its
/// minimums after the scales.
fn pack_q8<'a>(format: DType, out: &mut [u8], block_of: impl Fn(usize) -> &'a [u8]) {
    let (quants, scales) = out.split_at_mut(512);
    let (header, bias) = if format == DType::Q8Min { (4, 0x80) } else { (2, 0) };
    for c in 0..TILE_COLUMNS {
        let (half, column) = (c / 8, c % 8);
        let b = block_of(c);
        for (k, &q) in b[header..header + 32].iter().enumerate() {
            let (g, j) = (k / 4, k % 4);
            quants[256 * half + 32 * g + 4 * column + j] = q ^ bias;
        }
        scales[2 * c..2 * c + 2].copy_from_slice(&b[..2]);
        if format == DType::Q8Min {
            scales[32 + 2 * c..32 + 2 * c + 2].copy_from_slice(&b[2..4]);
        }
    }
}

/// One k-group (a super-block of each column) of a Q4_K panel (see the
/// [layout](super)).
fn pack_q4k<'a>(out: &mut [u8], block_of: impl Fn(usize) -> &'a [u8]) {
    let (d, rest) = out.split_at_mut(64);
    let (scales, quants) = rest.split_at_mut(192);
    for c in 0..TILE_COLUMNS {
        let (half, column) = (c / 8, c % 8);
        let b = block_of(c);
        let qs = &b[16..144];
        // Sub-block s (32 k) is the low nibbles (s even) or high nibbles
        // (s odd) of bytes 32·(s / 2) ..+ 32.
        let quant = |k: usize| {
            let (s, l) = (k / 32, k % 32);
            let byte = qs[32 * (s / 2) + l];
            if s % 2 == 0 { byte & 0x0f } else { byte >> 4 }
        };
        for s in 0..8 {
            q4_layout(&mut quants[256 * s + 128 * half..], column, 32 * s, quant);
        }
        d[2 * c..2 * c + 2].copy_from_slice(&b[..2]);
        d[32 + 2 * c..32 + 2 * c + 2].copy_from_slice(&b[2..4]);
        for (i, &byte) in b[4..16].iter().enumerate() {
            scales[16 * i + c] = byte;
        }
    }
}

/// One k-group of a Q5_K panel (see the [layout](super)): Q4_K's k-group
/// of the blocks with their fifth bits left out, then per sub-block `s` and
/// half the 8 columns' fifth bits in Q5_0's arrangement (byte `j` of a
/// column dword: bit `2g` for k = 32s + 8g + j, bit `2g + 1` for
/// 32s + 8g + 4 + j).
fn pack_q5k<'a>(out: &mut [u8], block_of: impl Fn(usize) -> &'a [u8]) {
    let (q4k, high) = out.split_at_mut(TILE_COLUMNS * 144);
    // Q4_K's bytes of each block: the header and the nibbles.
    let q4k_blocks: Vec<Vec<u8>> = (0..TILE_COLUMNS)
        .map(|c| {
            let b = block_of(c);
            [&b[..16], &b[48..176]].concat()
        })
        .collect();
    pack_q4k(q4k, |c| &q4k_blocks[c]);
    for c in 0..TILE_COLUMNS {
        let (half, column) = (c / 8, c % 8);
        let qh = &block_of(c)[16..48];
        // Element l of sub-block s has its fifth bit at bit s of qh[l].
        let bit = |k: usize| (qh[k % 32] >> (k / 32)) & 1;
        for s in 0..8 {
            for j in 0..4 {
                let k = |g: usize, upper: usize| 32 * s + 8 * g + 4 * upper + j;
                high[64 * s + 32 * half + 4 * column + j] =
                    (0..4).map(|g| bit(k(g, 0)) << (2 * g) | bit(k(g, 1)) << (2 * g + 1)).sum();
            }
        }
    }
}

/// Q6_K's 6-bit quant `k` (0..256) of a super-block, as `kvjit_core::quant`
/// reads it: per 128 k, 32 k at a time, low nibbles of `ql[l]`,
/// `ql[l + 32]`, then their high nibbles, with bits 2·quarter.. of `qh[l]`.
fn q6k_quant(b: &[u8], k: usize) -> u8 {
    let (ql, qh) = (&b[..128], &b[128..192]);
    let (half, quarter, l) = (k / 128, k % 128 / 32, k % 32);
    let byte = ql[64 * half + 32 * (quarter % 2) + l];
    let low = if quarter < 2 { byte & 0x0f } else { byte >> 4 };
    low | (((qh[32 * half + l] >> (2 * quarter)) & 3) << 4)
}

/// One k-group (a super-block of each column) of a Q6_K panel (see the
/// [layout](super)).
fn pack_q6k<'a>(out: &mut [u8], block_of: impl Fn(usize) -> &'a [u8]) {
    let (scales, rest) = out.split_at_mut(256);
    let (d, quants) = rest.split_at_mut(32);
    for c in 0..TILE_COLUMNS {
        let (half, column) = (c / 8, c % 8);
        let b = block_of(c);
        for s in 0..8 {
            let sub = &mut quants[384 * s..384 * (s + 1)];
            q4_layout(&mut sub[128 * half..], column, 32 * s, |k| q6k_quant(b, k) & 0x0f);
            for t in 0..2 {
                for j in 0..4 {
                    let high = |f: usize| (q6k_quant(b, 32 * s + 16 * t + 4 * f + j) >> 4) << (2 * f);
                    sub[256 + 64 * half + 32 * t + 4 * column + j] = high(0) | high(1) | high(2) | high(3);
                }
            }
        }
        for (i, &scale) in b[192..208].iter().enumerate() {
            scales[16 * i + c] = scale;
        }
        d[2 * c..2 * c + 2].copy_from_slice(&b[208..210]);
    }
}

/// One k-group (a super-block of each column) of a q8_kmin panel (see the
/// [layout](super)): the 16 `d`, the 16 `dmin`, the i8 scales and the i16
/// minimums byte-sliced per 16 k, then per 32-k sub-group Q8_0's
/// arrangement of the quants, stored as `q − 128`.
fn pack_q8kmin<'a>(out: &mut [u8], block_of: impl Fn(usize) -> &'a [u8]) {
    let (d, rest) = out.split_at_mut(64);
    let (scales, rest) = rest.split_at_mut(256);
    let (mins, quants) = rest.split_at_mut(512);
    for c in 0..TILE_COLUMNS {
        let (half, column) = (c / 8, c % 8);
        let b = block_of(c);
        d[2 * c..2 * c + 2].copy_from_slice(&b[..2]);
        d[32 + 2 * c..32 + 2 * c + 2].copy_from_slice(&b[2..4]);
        for i in 0..16 {
            scales[16 * i + c] = b[4 + i];
            mins[2 * (16 * i + c)..2 * (16 * i + c) + 2].copy_from_slice(&b[20 + 2 * i..22 + 2 * i]);
        }
        for (k, &q) in b[kvjit_core::quant::Q8_KMIN_HEADER..].iter().enumerate() {
            let (s, g, j) = (k / 32, k % 32 / 4, k % 4);
            quants[512 * s + 256 * half + 32 * g + 4 * column + j] = q ^ 0x80;
        }
    }
}

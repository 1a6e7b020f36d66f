//! The dtype-converting loads and stores in `kvjit_jit::ir`, checked bit for
//! bit against the `half` crate: every bf16/f16 pattern when widening, and
//! every f32 around the rounding boundaries plus a million random patterns
//! when narrowing.

use cranelift_codegen::ir::{InstBuilder, types};
use half::{bf16, f16};
use kvjit_core::DType;
use kvjit_jit::cranelift_codegen;
use kvjit_jit::ir::{load_f32x4, load_f32x4_raw, load_splat_f32x4, load_splat_f32x4_raw, mem, store_f32x4, store_lane};
use kvjit_jit::{CaptureText, compile_function, pointer_type};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;
use common::{kernel, run};

fn elem_size(dtype: DType) -> i64 {
    dtype.size_bytes() as i64
}

fn to_f32_bits(dtype: DType, h: u16) -> u32 {
    match dtype {
        DType::BF16 => bf16::from_bits(h).to_f32().to_bits(),
        DType::F16 => f16::from_bits(h).to_f32().to_bits(),
        other => unreachable!("{other}"),
    }
}

fn from_f32_bits(dtype: DType, x: u32) -> u16 {
    match dtype {
        DType::BF16 => bf16::from_f32(f32::from_bits(x)).to_bits(),
        DType::F16 => f16::from_f32(f32::from_bits(x)).to_bits(),
        other => unreachable!("{other}"),
    }
}

/// Widen `src` with `load_f32x4` (groups of 4) and with `load_splat_f32x4`
/// (one element, all four lanes stored), or with their `_raw` forms.
fn widen(dtype: DType, src: &[u16], raw: bool) -> (Vec<u32>, Vec<[u32; 4]>) {
    let size = elem_size(dtype);
    let vector = kernel("widen", 4, size, 4, |b, s, d| {
        let v = if raw { load_f32x4_raw(b, dtype, s, 0) } else { load_f32x4(b, dtype, s, 0) };
        b.ins().store(mem(), v, d, 0);
    });
    let splat = kernel("widen_splat", 1, size, 16, |b, s, d| {
        let v = if raw { load_splat_f32x4_raw(b, dtype, s, 0) } else { load_splat_f32x4(b, dtype, s, 0) };
        b.ins().store(mem(), v, d, 0);
    });
    let mut out = vec![0u32; src.len()];
    run(&vector, src, &mut out, src.len());
    let mut out_splat = vec![[0u32; 4]; src.len()];
    run(&splat, src, &mut out_splat, src.len());
    (out, out_splat)
}

/// Narrow `src` with `store_f32x4` and with four `store_lane`s.
fn narrow(dtype: DType, src: &[u32]) -> (Vec<u16>, Vec<u16>) {
    assert_eq!(src.len() % 4, 0);
    let size = elem_size(dtype);
    let vector = kernel("narrow", 4, 4, size, |b, s, d| {
        let v = b.ins().load(types::F32X4, mem(), s, 0);
        store_f32x4(b, dtype, v, d, 0);
    });
    let lanes = kernel("narrow_lanes", 4, 4, size, |b, s, d| {
        let v = b.ins().load(types::F32X4, mem(), s, 0);
        for lane in 0..4u8 {
            store_lane(b, dtype, v, lane, d, i32::from(lane) * size as i32);
        }
    });
    let mut out = vec![0u16; src.len()];
    run(&vector, src, &mut out, src.len());
    let mut out_lanes = vec![0u16; src.len()];
    run(&lanes, src, &mut out_lanes, src.len());
    (out, out_lanes)
}

fn check_widen_all(dtype: DType) {
    let src: Vec<u16> = (0..=u16::MAX).collect();
    let (out, out_splat) = widen(dtype, &src, false);
    for (i, &h) in src.iter().enumerate() {
        let want = to_f32_bits(dtype, h);
        assert_eq!(out[i], want, "{dtype} load_f32x4 of {h:#06x}: got {:#010x}, want {want:#010x}", out[i]);
        assert_eq!(out_splat[i], [want; 4], "{dtype} load_splat_f32x4 of {h:#06x}: want {want:#010x}");
    }
}

/// The `_raw` loads: like `half` except that bf16 signalling NaNs stay
/// signalling (`h << 16`), and quieting them gives `half`'s value.
fn check_widen_raw_all(dtype: DType) {
    let src: Vec<u16> = (0..=u16::MAX).collect();
    let (out, out_splat) = widen(dtype, &src, true);
    let mut signalling = 0;
    for (i, &h) in src.iter().enumerate() {
        let exact = to_f32_bits(dtype, h);
        let want = if dtype == DType::BF16 && f32::from_bits(exact).is_nan() && h & 0x0040 == 0 {
            signalling += 1;
            assert_eq!(u32::from(h) << 16 | 0x0040_0000, exact);
            u32::from(h) << 16
        } else {
            exact
        };
        assert_eq!(out[i], want, "{dtype} load_f32x4_raw of {h:#06x}: got {:#010x}, want {want:#010x}", out[i]);
        assert_eq!(out_splat[i], [want; 4], "{dtype} load_splat_f32x4_raw of {h:#06x}: want {want:#010x}");
    }
    assert_eq!(signalling, if dtype == DType::BF16 { 126 } else { 0 });
}

#[test]
fn widens_every_bf16_pattern_like_half() {
    check_widen_all(DType::BF16);
    check_widen_raw_all(DType::BF16);
}

#[test]
fn widens_every_f16_pattern_like_half() {
    check_widen_all(DType::F16);
    check_widen_raw_all(DType::F16);
}

/// f32 patterns that exercise every rounding decision: all top halves with
/// low halves around the bf16 and f16 rounding bits, the midpoints between
/// consecutive f16 values and their neighbours, named boundaries, and a
/// million seeded random patterns.
fn narrowing_inputs() -> Vec<u32> {
    let mut v = Vec::with_capacity(3_000_000);
    for lo in [
        0x0000u32, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x2000, 0x2fff, 0x3000, 0x3001, 0x7fff, 0x8000, 0x8001,
        0xffff,
    ] {
        v.extend((0..=0xffffu32).map(|hi| (hi << 16) | lo));
    }
    // Midpoints between consecutive f16 values (ties) and one f32 ulp either
    // side; a midpoint has at most 12 significant bits, so it is exact in f32.
    for h in (0..0x7c00u16).chain(0x8000..0xfc00) {
        let (a, c) = (f16::from_bits(h).to_f64(), f16::from_bits(h + 1).to_f64());
        let mid = ((a + c) / 2.0) as f32;
        assert_eq!(f64::from(mid), (a + c) / 2.0);
        let m = mid.to_bits();
        v.extend([m, m.wrapping_sub(1), m + 1]);
    }
    let named: [f32; 16] = [
        65504.0,
        65519.996,
        65520.0,
        65536.0,
        2f32.powi(-14),
        2f32.powi(-14) * (1.0 - 2f32.powi(-11)),
        2f32.powi(-24),
        2f32.powi(-25),
        2f32.powi(-25) * (1.0 + 2f32.powi(-23)),
        2f32.powi(-26),
        f32::MIN_POSITIVE,
        1e-45,
        f32::MAX,
        f32::INFINITY,
        0.0,
        1.0,
    ];
    for x in named {
        v.extend([x.to_bits(), (-x).to_bits(), x.to_bits() + 1, x.to_bits().wrapping_sub(1)]);
    }
    // NaNs: quiet and signalling, payloads in the high, low and middle bits.
    for payload in [0x40_0000u32, 0x00_0001, 0x00_1fff, 0x00_2000, 0x3f_ffff, 0x7f_ffff, 0x12_3456, 0x00_8000] {
        v.extend([0x7f80_0000 | payload, 0xff80_0000 | payload]);
    }
    let mut rng = StdRng::seed_from_u64(0x006b_766a_6974);
    v.extend((0..1_000_000).map(|_| rng.r#gen::<u32>()));
    while v.len() % 4 != 0 {
        v.push(0);
    }
    v
}

fn check_narrow(dtype: DType) {
    let src = narrowing_inputs();
    let (out, out_lanes) = narrow(dtype, &src);
    for (i, &x) in src.iter().enumerate() {
        let want = from_f32_bits(dtype, x);
        assert_eq!(out[i], want, "{dtype} store_f32x4 of {x:#010x}: got {:#06x}, want {want:#06x}", out[i]);
        assert_eq!(out_lanes[i], want, "{dtype} store_lane of {x:#010x}: got {:#06x}, want {want:#06x}", out_lanes[i]);
    }
}

#[test]
fn narrows_to_bf16_like_half() {
    check_narrow(DType::BF16);
}

#[test]
fn narrows_to_f16_like_half() {
    check_narrow(DType::F16);
}

#[test]
fn f32_paths_are_identity() {
    let src: Vec<u32> = {
        let mut rng = StdRng::seed_from_u64(7);
        let mut v: Vec<u32> = (0..4096).map(|_| rng.r#gen()).collect();
        v.extend([0x7f80_0001, 0xffc0_0000, 0x8000_0000, 0x0000_0001]);
        v
    };
    let load = kernel("f32_load", 4, 4, 4, |b, s, d| {
        let v = load_f32x4(b, DType::F32, s, 0);
        store_f32x4(b, DType::F32, v, d, 0);
    });
    let mut out = vec![0u32; src.len()];
    run(&load, &src, &mut out, src.len());
    assert_eq!(out, src);

    let splat = kernel("f32_splat", 1, 4, 16, |b, s, d| {
        let v = load_splat_f32x4(b, DType::F32, s, 0);
        b.ins().store(mem(), v, d, 0);
    });
    let mut out_splat = vec![[0u32; 4]; src.len()];
    run(&splat, &src, &mut out_splat, src.len());
    assert!(src.iter().zip(&out_splat).all(|(&x, o)| *o == [x; 4]));

    let lanes = kernel("f32_lanes", 4, 4, 4, |b, s, d| {
        let v = load_f32x4(b, DType::F32, s, 0);
        for lane in 0..4u8 {
            store_lane(b, DType::F32, v, lane, d, i32::from(lane) * 4);
        }
    });
    let mut out_lanes = vec![0u32; src.len()];
    run(&lanes, &src, &mut out_lanes, src.len());
    assert_eq!(out_lanes, src);
}

#[test]
fn store_lane_writes_only_its_element() {
    const CANARY: u8 = 0xa5;
    const OFFSET: usize = 8;
    let values = [1.5f32, -2.25, 65520.0, f32::NAN];
    for dtype in DType::FLOATS {
        let size = dtype.size_bytes();
        for lane in 0..4u8 {
            // One call: src points at the 4 f32 values, dst at the buffer.
            let f = kernel("one_lane", 1, 0, 0, |b, s, d| {
                let v = b.ins().load(types::F32X4, mem(), s, 0);
                store_lane(b, dtype, v, lane, d, OFFSET as i32);
            });
            let mut buf = [CANARY; 24];
            run(&f, &values, &mut buf, 1);
            let x = values[usize::from(lane)];
            let want: Vec<u8> = match dtype {
                DType::F32 => x.to_le_bytes().to_vec(),
                other => from_f32_bits(other, x.to_bits()).to_le_bytes().to_vec(),
            };
            assert_eq!(&buf[OFFSET..OFFSET + size], &want[..], "{dtype} lane {lane}");
            assert!(
                buf[..OFFSET].iter().chain(&buf[OFFSET + size..]).all(|&c| c == CANARY),
                "{dtype} lane {lane} wrote outside its element: {buf:02x?}"
            );
        }
    }
}

#[test]
fn store_f32x4_writes_only_its_four_elements() {
    const CANARY: u8 = 0x5a;
    let values = [1.0f32, -0.0, 3.0e-6, -70000.0];
    for dtype in DType::FLOATS {
        let size = dtype.size_bytes();
        let f = kernel("four", 1, 0, 0, |b, s, d| {
            let v = b.ins().load(types::F32X4, mem(), s, 0);
            store_f32x4(b, dtype, v, d, 4);
        });
        let mut buf = [CANARY; 40];
        run(&f, &values, &mut buf, 1);
        for (k, &x) in values.iter().enumerate() {
            let at = 4 + k * size;
            let want: Vec<u8> = match dtype {
                DType::F32 => x.to_le_bytes().to_vec(),
                other => from_f32_bits(other, x.to_bits()).to_le_bytes().to_vec(),
            };
            assert_eq!(&buf[at..at + size], &want[..], "{dtype} element {k}");
        }
        assert!(buf[..4].iter().chain(&buf[4 + 4 * size..]).all(|&c| c == CANARY), "{dtype}: {buf:02x?}");
    }
}

#[test]
fn loads_honour_the_offset() {
    let src: Vec<u16> = (0..16u16).map(|k| bf16::from_f32(f32::from(k)).to_bits()).collect();
    let f = kernel("offset", 1, 0, 0, |b, s, d| {
        let v = load_f32x4(b, DType::BF16, s, 6);
        b.ins().store(mem(), v, d, 0);
        let w = load_splat_f32x4(b, DType::BF16, s, 10);
        b.ins().store(mem(), w, d, 16);
    });
    let mut out = [0f32; 8];
    run(&f, &src, &mut out, 1);
    assert_eq!(out, [3.0, 4.0, 5.0, 6.0, 5.0, 5.0, 5.0, 5.0]);
}

/// Compile one conversion alone and return its disassembly (printed with
/// `--nocapture`, for reviewing instruction counts).
fn disasm(dtype: DType, what: &str) -> String {
    let ptr = pointer_type();
    let f = compile_function("conv", &[ptr, ptr], &[], CaptureText { clif: false, disasm: true }, |b, args| {
        let (src, dst) = (args[0], args[1]);
        if what.starts_with("store") {
            let v = b.ins().load(types::F32X4, mem(), src, 0);
            if what == "store_f32x4" {
                store_f32x4(b, dtype, v, dst, 0);
            } else {
                store_lane(b, dtype, v, 2, dst, 0);
            }
        } else {
            let v = match what {
                "load_f32x4" => load_f32x4(b, dtype, src, 0),
                "load_f32x4_raw" => load_f32x4_raw(b, dtype, src, 0),
                "load_splat_f32x4" => load_splat_f32x4(b, dtype, src, 0),
                _ => load_splat_f32x4_raw(b, dtype, src, 0),
            };
            b.ins().store(mem(), v, dst, 0);
        }
        b.ins().return_(&[]);
    })
    .unwrap();
    f.disasm().unwrap().to_string()
}

/// Machine instructions of a disassembly, less the frame (push, mov; mov,
/// pop, ret) and the one f32 load or store around the conversion.
fn conversion_instructions(text: &str) -> usize {
    let pseudo = ["unwind ", "uninit "];
    let all = text.lines().filter(|l| l.starts_with("  ") && !pseudo.iter().any(|p| l.trim_start().starts_with(p)));
    all.count() - 6
}

#[test]
fn conversions_stay_short() {
    if !cfg!(target_arch = "x86_64") {
        return;
    }
    let whats =
        ["load_f32x4", "load_f32x4_raw", "load_splat_f32x4", "load_splat_f32x4_raw", "store_f32x4", "store_lane"];
    for dtype in [DType::BF16, DType::F16] {
        for what in whats {
            let text = disasm(dtype, what);
            let count = conversion_instructions(&text);
            println!("== {dtype} {what}: {count} instructions ==\n{text}");
            let limit = match (dtype, what) {
                (DType::BF16, "load_f32x4" | "load_splat_f32x4") => 4,
                (DType::BF16, "load_f32x4_raw" | "load_splat_f32x4_raw") => 2,
                (DType::BF16, _) => 13,
                (_, "store_f32x4" | "store_lane") => 29,
                _ => 16,
            };
            assert!(count <= limit, "{dtype} {what} grew to {count} instructions:\n{text}");
        }
    }
}

#[test]
#[should_panic(expected = "never convert to or from f32 lanes")]
fn u32_has_no_float_lanes() {
    kernel("u32", 4, 4, 4, |b, s, _| {
        load_f32x4(b, DType::U32, s, 0);
    });
}

//! GGML tensor types and GGUF metadata value types.

use std::fmt;

/// The type of a GGUF tensor's data (`ggml_type`): its id in the file, how
/// many elements one block holds and how many bytes a block takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[allow(missing_docs, reason = "each variant is the GGML type of the same name")]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    BF16,
    Tq1_0,
    Tq2_0,
    Mxfp4,
}

pub use kvjit_core::quant::QK_K;

/// (type, id, name, block size in elements, block size in bytes), as
/// `ggml.h` and gguf-py's `GGML_QUANT_SIZES` define them.
const TABLE: [(GgmlType, u32, &str, usize, usize); 32] = [
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 40),
    (GgmlType::Q2K, 10, "Q2_K", QK_K, 84),
    (GgmlType::Q3K, 11, "Q3_K", QK_K, 110),
    (GgmlType::Q4K, 12, "Q4_K", QK_K, 144),
    (GgmlType::Q5K, 13, "Q5_K", QK_K, 176),
    (GgmlType::Q6K, 14, "Q6_K", QK_K, 210),
    (GgmlType::Q8K, 15, "Q8_K", QK_K, 292),
    (GgmlType::Iq2Xxs, 16, "IQ2_XXS", QK_K, 66),
    (GgmlType::Iq2Xs, 17, "IQ2_XS", QK_K, 74),
    (GgmlType::Iq3Xxs, 18, "IQ3_XXS", QK_K, 98),
    (GgmlType::Iq1S, 19, "IQ1_S", QK_K, 50),
    (GgmlType::Iq4Nl, 20, "IQ4_NL", 32, 18),
    (GgmlType::Iq3S, 21, "IQ3_S", QK_K, 110),
    (GgmlType::Iq2S, 22, "IQ2_S", QK_K, 82),
    (GgmlType::Iq4Xs, 23, "IQ4_XS", QK_K, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::Iq1M, 29, "IQ1_M", QK_K, 56),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::Tq1_0, 34, "TQ1_0", QK_K, 54),
    (GgmlType::Tq2_0, 35, "TQ2_0", QK_K, 66),
    (GgmlType::Mxfp4, 39, "MXFP4", 32, 17),
];

impl GgmlType {
    /// Every type this reader knows, in id order.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|row| row.0)
    }

    fn row(self) -> &'static (GgmlType, u32, &'static str, usize, usize) {
        TABLE.iter().find(|row| row.0 == self).expect("every variant has a table row")
    }

    /// The type with this id, or `None` for an id GGML does not define (or
    /// one it removed).
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TABLE.iter().find(|row| row.1 == id).map(|row| row.0)
    }

    /// Its id in GGUF files.
    pub fn id(self) -> u32 {
        self.row().1
    }

    /// Its name as GGML spells it (`Q4_K`).
    pub fn name(self) -> &'static str {
        self.row().2
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> usize {
        self.row().3
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.row().4
    }

    /// The kvjit weight block format of this type, when kvjit keeps its
    /// blocks as they are (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K,
    /// Q6_K). (A stacked constant whose parts differ in type is held in a
    /// common format that holds each exactly: [`GgmlType::exact_in_q8_0`],
    /// [`GgmlType::exact_in_q8_min`], [`GgmlType::exact_in_q8_kmin`].)
    pub fn block_format(self) -> Option<kvjit_core::DType> {
        use kvjit_core::DType;
        Some(match self {
            GgmlType::Q8_0 => DType::Q8_0,
            GgmlType::Q4_0 => DType::Q4_0,
            GgmlType::Q4_1 => DType::Q4_1,
            GgmlType::Q5_0 => DType::Q5_0,
            GgmlType::Q5_1 => DType::Q5_1,
            GgmlType::Iq4Nl => DType::Iq4Nl,
            GgmlType::Q4K => DType::Q4K,
            GgmlType::Q5K => DType::Q5K,
            GgmlType::Q6K => DType::Q6K,
            _ => return None,
        })
    }

    /// Whether every value of this type is an f16 scale times an integer in
    /// −128..=127 per block of 32, so that it loads as Q8_0 blocks of
    /// exactly its values: Q8_0 itself, and Q4_0, Q5_0 and IQ4_NL rewritten
    /// ([`crate::dequant::to_q8_0`]). Parts of one constant stored in
    /// different such types (llama.cpp's mixes store a layer's V in Q8_0
    /// beside Q and K in Q5_0) load as one Q8_0 constant.
    pub fn exact_in_q8_0(self) -> bool {
        matches!(self, GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Iq4Nl)
    }

    /// Whether every value of this type is `d·q + m` for per-32 f16 `d` and
    /// `m` and a `q` in 0..=255, so that it loads as kvjit's q8_min blocks
    /// of exactly its values ([`crate::dequant::to_q8_min`], which refuses a
    /// block whose scale is not finite or too large): Q8_0, Q4_0, Q4_1,
    /// Q5_0, Q5_1 and IQ4_NL. Parts of one constant stored in different
    /// such types, not all [`GgmlType::exact_in_q8_0`] (llama.cpp's Q5_K_M
    /// mix of a 576-wide model stores a layer's V in Q8_0 beside Q and K in
    /// Q5_1), load as one q8_min constant.
    pub fn exact_in_q8_min(self) -> bool {
        matches!(
            self,
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Iq4Nl
        )
    }

    /// Whether every value of this type is `(d·sc)·q − dmin·m` per 16 with
    /// f16 `d` and `dmin`, an i8 `sc`, an i16 `m` and a `q` in 0..=255, one
    /// rounding, so that it loads as kvjit's q8_kmin super-blocks of exactly
    /// its values ([`crate::dequant::to_q8_kmin`], which refuses a
    /// super-block whose scales are not finite): Q4_K, Q5_K, Q6_K, and
    /// Q2_K, Q3_K and IQ4_XS, which kvjit has no kernels of their own for.
    /// Parts of one constant stored in different such types (llama.cpp's
    /// Q4_K_M mix stores a layer's V in Q6_K beside Q and K in Q4_K) load
    /// as one q8_kmin constant.
    pub fn exact_in_q8_kmin(self) -> bool {
        matches!(self, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K | GgmlType::Q2K | GgmlType::Q3K | GgmlType::Iq4Xs)
    }

    /// Whether kvjit can turn this type into f32, bf16 or f16
    /// ([`crate::Gguf::tensor`]): the plain floats and the block types of
    /// [`crate::dequant`] (not Q8_1/Q8_K, which files do not store, nor the
    /// IQ1–IQ3 and ternary types, whose grids kvjit does not carry).
    pub fn is_supported(self) -> bool {
        matches!(
            self,
            GgmlType::F32
                | GgmlType::F16
                | GgmlType::BF16
                | GgmlType::Q8_0
                | GgmlType::Q4_0
                | GgmlType::Q4_1
                | GgmlType::Q4K
                | GgmlType::Q6K
                | GgmlType::Q5_0
                | GgmlType::Q5_1
                | GgmlType::Q2K
                | GgmlType::Q3K
                | GgmlType::Q5K
                | GgmlType::Iq4Nl
                | GgmlType::Iq4Xs
        )
    }

    /// The names of the types [`GgmlType::is_supported`] accepts.
    pub fn supported_names() -> String {
        GgmlType::all().filter(|t| t.is_supported()).map(GgmlType::name).collect::<Vec<_>>().join(", ")
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The type of a GGUF metadata value (`gguf_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs, reason = "each variant is the GGUF value type of the same name")]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    /// The type with this id (0–12).
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Its id in GGUF files.
    pub fn id(self) -> u32 {
        use ValueType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            String => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }

    /// Bytes of one value, for the fixed-size types (not strings or arrays).
    pub fn fixed_size(self) -> Option<usize> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// Its lowercase name (`u32`, `string`).
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

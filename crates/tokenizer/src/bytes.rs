//! GPT-2's byte-level alphabet: every byte maps to one printable Unicode
//! character, so byte-level BPE vocabularies are stored as text.

use std::collections::HashMap;
use std::sync::OnceLock;

/// The byte → character table of GPT-2's `bytes_to_unicode`: the printable
/// bytes `!`..=`~`, `¡`..=`¬` and `®`..=`ÿ` stand for themselves, every other
/// byte `b` for U+0100 + its rank among those others.
pub(crate) fn byte_to_char() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        let mut table = ['\0'; 256];
        let mut next = 0u32;
        for b in 0..=255u8 {
            table[b as usize] = if printable(b) {
                char::from(b)
            } else {
                let c = char::from_u32(256 + next).expect("U+0100..U+0143 are chars");
                next += 1;
                c
            };
        }
        table
    })
}

/// The inverse of [`byte_to_char`].
pub(crate) fn char_to_byte() -> &'static HashMap<char, u8> {
    static TABLE: OnceLock<HashMap<char, u8>> = OnceLock::new();
    TABLE.get_or_init(|| byte_to_char().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect())
}

/// The bytes a byte-level token's text stands for. A character outside the
/// byte alphabet (a vocabulary may hold some) stands for its own UTF-8 bytes.
pub(crate) fn decode_byte_level(text: &str) -> Vec<u8> {
    let map = char_to_byte();
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match map.get(&c) {
            Some(&b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out
}

/// The byte-level text of `bytes`: one alphabet character per byte.
#[cfg(test)]
pub(crate) fn encode_byte_level(bytes: &[u8]) -> String {
    let table = byte_to_char();
    bytes.iter().map(|&b| table[b as usize]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_a_bijection() {
        let table = byte_to_char();
        assert_eq!(table[b' ' as usize], 'Ġ');
        assert_eq!(table[b'\n' as usize], 'Ċ');
        assert_eq!(table[b'a' as usize], 'a');
        assert_eq!(char_to_byte().len(), 256);
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(decode_byte_level(&encode_byte_level(&all)), all);
    }
}

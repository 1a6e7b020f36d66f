//! JSON read strictly: an object that names a key twice is an error.
//!
//! `serde_json::Value` keeps the last of duplicate keys without a word, so
//! `{"kind": "input", "kind": "constant"}` would be read as a constant and
//! a file edited by hand (or crafted) would mean something other than what
//! its first reader sees. Every kvjit file format with a JSON part (graph
//! files, the safetensors and artifact headers) is read through
//! [`parse_strict`].

use std::fmt;

use serde::de::{self, Deserialize, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// `bytes` parsed as one JSON value, refusing an object that names a key
/// twice ("duplicate key `name` at line L column C"). serde_json's limits
/// still apply (nesting deeper than 128 is an error).
pub fn parse_strict(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value = StrictValue.deserialize(&mut deserializer)?;
    deserializer.end()?;
    Ok(value)
}

/// Builds a [`Value`] as serde_json's own `Deserialize` does, except for
/// duplicate keys.
#[derive(Clone, Copy)]
struct StrictValue;

impl<'de> DeserializeSeed<'de> for StrictValue {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

/// One element or member value, read strictly.
struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        StrictValue.deserialize(deserializer).map(Strict)
    }
}

impl<'de> Visitor<'de> for StrictValue {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        // JSON text has no NaN or infinity, so every parsed f64 is finite.
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        self.deserialize(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(de::Error::custom(format!("duplicate key `{key}`")));
            }
            let Strict(value) = map.next_value()?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_serde_json_reads() {
        let text =
            r#"{"a": [1, -2, 3.5, 1e300, 18446744073709551615, true, null, "x\u00e9"], "b": {"c": {}}, "d": []}"#;
        assert_eq!(parse_strict(text.as_bytes()).unwrap(), serde_json::from_str::<Value>(text).unwrap());
    }

    #[test]
    fn refuses_a_key_named_twice_at_any_depth() {
        for (text, key) in [
            (r#"{"kind": "input", "kind": "constant"}"#, "kind"),
            (r#"{"values": [{"id": "v0", "shape": [1], "id": "v1"}]}"#, "id"),
            (r#"{"a": {"b": {"c": 1, "c": 1}}}"#, "c"),
        ] {
            let error = parse_strict(text.as_bytes()).unwrap_err().to_string();
            assert!(error.contains(&format!("duplicate key `{key}`")), "{text}: {error}");
            assert!(error.contains("line 1 column"), "{text}: the position is named: {error}");
        }
        // The same key in sibling objects is fine.
        assert!(parse_strict(br#"[{"a": 1}, {"a": 2}]"#).is_ok());
    }

    #[test]
    fn refuses_trailing_text_and_deep_nesting_as_serde_json_does() {
        assert!(parse_strict(b"{} {}").is_err());
        let deep = "[".repeat(10_000) + &"]".repeat(10_000);
        assert!(parse_strict(deep.as_bytes()).unwrap_err().to_string().contains("recursion limit"));
    }
}

//! Typed handles for values and nodes.
//!
//! Handles are `u32` newtypes rather than `usize` indices or references, so a
//! value handle cannot be passed where a node handle is meant, and their
//! `Display` (`v7`, `n3`) is exactly how graph files spell them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

macro_rules! handle {
    ($name:ident, $prefix:literal, $what:literal) => {
        #[doc = concat!("Handle of a ", $what, " in a graph; displays as `", $prefix, "N`.")]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u32);

        impl $name {
            /// The handle's position in the graph's table.
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                s.strip_prefix($prefix)
                    .and_then(|n| n.parse().ok())
                    .map($name)
                    .ok_or_else(|| format!(concat!("'{}' is not a ", $what, " id (expected ", $prefix, "N)"), s))
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

handle!(ValueId, "v", "value");
handle!(NodeId, "n", "node");
